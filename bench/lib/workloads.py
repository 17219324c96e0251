"""Benchmark inputs: a support-ticket log of a given token length, choice questions about it, the decision cases and
the HTTP requests built from them, and requests in System One's form.

Everything is generated from a fixed seed, so every arm and every run sees the same prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TEAMS = [
    "billing",
    "shipping",
    "technical support",
    "account security",
    "returns",
    "sales",
    "legal",
    "privacy",
    "accessibility",
    "mobile app",
    "web checkout",
    "warehouse",
    "customs",
    "partnerships",
    "marketing",
    "loyalty program",
    "gift cards",
    "subscriptions",
    "hardware repair",
    "installation",
    "training",
    "data export",
    "integrations",
    "fraud prevention",
    "translations",
    "executive escalations",
]
PRODUCTS = [
    "router",
    "invoice",
    "parcel",
    "password",
    "laptop",
    "subscription",
    "gift card",
    "monitor",
    "headset",
    "order",
    "refund",
    "coupon",
    "printer",
    "account",
    "charger",
    "camera",
]
PROBLEMS = [
    "was charged twice",
    "arrived damaged",
    "never arrived",
    "stopped working after an update",
    "cannot be reset",
    "shows the wrong price",
    "was sent to an old address",
    "is missing a part",
    "keeps logging the customer out",
    "was cancelled without notice",
    "cannot be exported",
    "is stuck in customs",
]
MOODS = ["calm", "frustrated", "angry", "polite", "confused", "in a hurry", "satisfied with the first reply"]
ACTIONS = [
    "asked for a refund",
    "asked for a replacement",
    "wants to speak to a manager",
    "attached a screenshot",
    "threatened to cancel the contract",
    "asked how to export their data",
    "asked for a callback tomorrow",
    "mentioned a similar issue last month",
    "asked whether the warranty still applies",
]
QUESTION_TEMPLATES = [
    "Which team should handle ticket #{n}?",
    "Which team owns the product named in ticket #{n}?",
    "Which team should reply first to the customer in ticket #{n}?",
    "Which team would close ticket #{n} fastest?",
    "If ticket #{n} is escalated, which team takes it?",
    "Which team should review the refund request in ticket #{n}, if any?",
    "Which team must be informed about ticket #{n}?",
    "Which team is best placed to prevent tickets like #{n} from recurring?",
]


def _ticket(rng: random.Random, n: int) -> str:
    """One ticket of the log."""
    return (
        f"Ticket #{n} ({2024 + rng.randint(0, 1)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}): "
        f"the customer's {rng.choice(PRODUCTS)} {rng.choice(PROBLEMS)}. They were {rng.choice(MOODS)} and "
        f"{rng.choice(ACTIONS)}. The agent noted that the {rng.choice(PRODUCTS)} {rng.choice(PROBLEMS)} "
        f"as well, and tagged it for {rng.choice(TEAMS)}.\n"
    )


def document(tokenizer, target_tokens: int, seed: int = 0) -> str:
    """A ticket log of about `target_tokens` tokens (whole tickets; the last one may overshoot a little)."""
    rng = random.Random(seed)
    parts, count, n = [], 0, 1
    while count < target_tokens:
        ticket = _ticket(rng, n)
        parts.append(ticket)
        count += len(tokenizer(ticket, add_special_tokens=False)["input_ids"])
        n += 1
    return "".join(parts)


def ticket_count(doc: str) -> int:
    """How many tickets a document holds."""
    return doc.count("Ticket #")


def questions(n_questions: int, n_options: int, n_tickets: int) -> dict:
    """`n_questions` choice questions about tickets of the log, each offering the first `n_options` teams.
    The first k questions of a larger set are the same as the k questions of a smaller one."""
    if not 1 <= n_options <= len(TEAMS):
        raise ValueError(f"n_options must be 1-{len(TEAMS)}")
    out = {}
    for i in range(n_questions):
        template = QUESTION_TEMPLATES[i % len(QUESTION_TEMPLATES)]
        ticket = 1 + (i * 7) % max(1, n_tickets)
        out[f"q{i:02d}"] = {"type": "choice", "instructions": template.format(n=ticket), "criteria": TEAMS[:n_options]}
    return out


def reworded(asked: dict) -> dict:
    """The same questions asked again in other words, under other names: new prompts over the same evidence."""
    return {
        f"r{k}": {**q, "instructions": q["instructions"].replace("Which team", "What team, in your view,")}
        for k, q in asked.items()
    }


def case_requests(tok, cfg: dict, rep: int) -> dict[str, list[tuple]]:
    """The decision cases of one repetition, each a list of (state, questions) requests: a document not seen before
    with `questions` questions ("document"), the same document with as many new questions ("again"), and
    `short_per_rep` (default 1) short yes/no questions, each over a short new text ("short")."""
    doc = document(tok, cfg["doc"], seed=1000 + rep)
    n = ticket_count(doc)
    first = questions(cfg["questions"], cfg["options"], n)
    again = reworded(first)
    short = [
        (
            f"Order {4100 + 100 * i + rep}: I was charged twice for the same order and want my money back.",
            {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}},
        )
        for i in range(cfg.get("short_per_rep", 1))
    ]
    return {"document": [(doc, first)], "again": [(doc, again)], "short": short}


CASES = ("document", "again", "short")


def http_requests(tok, n: int, doc_tokens: int, seed: int = 500) -> list[dict]:
    """n System One requests, each one choice question over its own short ticket log (seeds seed .. seed + n - 1)."""
    out = []
    for i in range(n):
        doc = document(tok, doc_tokens, seed=seed + i)
        out.append(system_one(doc, questions(1, 4, ticket_count(doc))))
    return out


@dataclass(frozen=True)
class HttpWorkload:
    """System One requests for concurrent HTTP clients: `primed` are sent once before any clock starts, `warm` before
    each level's clock (a request of its own, never timed), and at each level of `levels` ({clients: requests}) client
    c sends requests[c * per_client + r], r < per_client, where per_client = len(requests) // clients."""

    name: str
    what: str
    warm: dict
    primed: list[dict]
    levels: dict[int, list[dict]]


DISTINCT, REPEATED = "distinct", "repeated"
HTTP_WORKLOADS = (DISTINCT, REPEATED)


def http_workload(tok, kind: str, clients: list[int], per_level: int, doc_tokens: int) -> HttpWorkload:
    """One of the two HTTP workloads, per_level requests at each level of `clients`. DISTINCT: every request new,
    across every level too (nothing a cache of answers or whole prompts could serve). REPEATED: per_level requests
    asked once unclocked (primed), then sent again at every level, as agents re-ask and clients retry. The two use
    documents of their own (seeds 500.. and 5000..)."""
    warm = http_requests(tok, 1, doc_tokens, seed=400)[0]
    if kind == DISTINCT:
        every = http_requests(tok, per_level * len(clients), doc_tokens, seed=500)
        levels = {c: every[i * per_level : (i + 1) * per_level] for i, c in enumerate(clients)}
        return HttpWorkload(kind, "every request new", warm, [], levels)
    if kind == REPEATED:
        asked = http_requests(tok, per_level, doc_tokens, seed=5000)
        return HttpWorkload(kind, "the same requests sent again", warm, asked, {c: asked for c in clients})
    raise ValueError(f"kind must be one of {HTTP_WORKLOADS}")


def system_one_question(q: dict) -> dict:
    """One blink question in System One form: list criteria become {option: null}, yes/no noul keys true/false,
    blink's opt-in fields (permute, multi, abstain) are dropped (they do not travel)."""
    out = {"type": q["type"]}
    if q.get("instructions") is not None:
        out["instructions"] = q["instructions"]
    crit = q.get("criteria")
    if q["type"] == "choice" and isinstance(crit, list):
        crit = {str(k): None for k in crit}
    elif q["type"] == "noul" and isinstance(crit, dict):
        crit = {"true": crit.get("true", crit.get("yes")), "false": crit.get("false", crit.get("no"))}
    if crit is not None:
        out["criteria"] = crit
    return out


def system_one(state, questions: dict) -> dict:
    """A whole request in System One form."""
    return {"state": state, "questions": {k: system_one_question(q) for k, q in questions.items()}}


# ---- python -m bench serve and route_sim: support logs asked over HTTP ----------------------------------------

WORDS = (
    "the customer wrote again about a refund for the annual plan and asked whether the invoice could be split across "
    "two cost centres because the finance team closes its books on friday while the card on file expired last month "
    "and the admin who set up single sign on left the company so nobody can reach the billing page or change the "
    "owner of the workspace before the renewal date which falls on the first of next month"
).split()
TOPICS = (
    "a refund",
    "the invoice",
    "single sign on",
    "the renewal date",
    "the card on file",
    "the finance team",
    "a cost centre",
    "the workspace owner",
    "the billing page",
    "the annual plan",
    "an admin leaving",
    "a deadline",
)
# The workloads' first document numbers: each workload asks about documents of its own, the warm-up about others.
FIRST_DOCUMENT = {"reask": 100, "distinct": 200, "hot": 300}
Request = tuple[int, str, dict]  # (document number, state, questions)


def support_log(n: int, words: int) -> str:
    """Document n: a support log of about `words` words, distinct for every n."""
    lines = [
        f"[{n}.{i}] " + " ".join(WORDS[(n * 13 + 24 * i + k) % len(WORDS)] for k in range(24))
        for i in range(-(-words // 24))
    ]
    return f"Support log {n}\n" + "\n".join(lines)


def serving_questions(ask: int) -> dict:
    """The two questions of ask number `ask` about a document, a yes/no and a three-way choice, worded for that ask
    alone (no two asks send the same questions)."""
    topic, nth = TOPICS[ask % len(TOPICS)], ask // len(TOPICS)
    return {
        "mentions": {"type": "noul", "instructions": f"Does the log mention {topic}? (check {nth})"},
        "team": {
            "type": "choice",
            "instructions": f"Which team owns what the log says about {topic}? (review {nth})",
            "criteria": {"billing": "payments and invoices", "access": "logins and admins", "other": None},
        },
    }


def serving_workloads(cfg: dict) -> dict[str, tuple[list[Request], int]]:
    """python -m bench serve's workloads: each one's requests, in the order they are sent, and its clients (every
    workload, or those cfg names)."""
    words, docs, asks = cfg["words"], cfg["docs"], cfg["asks"]
    first = FIRST_DOCUMENT
    hot = [first["hot"] if i % 2 == 0 else first["hot"] + 1 + i // 2 for i in range(cfg["hot_requests"])]
    every = {
        "reask": (
            [
                (first["reask"] + d, support_log(first["reask"] + d, words), serving_questions(a))
                for a in range(asks)
                for d in range(docs)
            ],
            cfg["clients"],
        ),
        "distinct": (
            [
                (first["distinct"] + d, support_log(first["distinct"] + d, words), serving_questions(0))
                for d in range(2 * docs)
            ],
            cfg["clients"],
        ),
        "hot": ([(n, support_log(n, words), serving_questions(i)) for i, n in enumerate(hot)], 2 * cfg["clients"]),
    }
    return {name: every[name] for name in cfg.get("workloads", every)}
