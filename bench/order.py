"""Order robustness: how often does a choice flip when only the order of its options changes?

Every question is asked once per cyclic rotation of its options (the evidence and the option texts stay the same)
in the registry's three "order" arms (bench/arms.py): plain (one prompt), `permute: 2` (two evenly spaced rotations
averaged) and `permute: K` (all K rotations averaged). A question "flips" in an arm when its pick is not the same
under every rotation of the listed order. `permute: K` averages the same K rotations whatever order the request
lists, so it cannot flip by construction (0% checks the mapping back to option keys); `permute: 2` shows what a
cheaper partial average buys.
All prompts of an arm run through the engine's packed forward together, so the model time is comparable. Accuracy
is against the labelled answer of each question (chance is 1/K).

    python -m bench order [--model ID] [--quick]      ->  bench/results/order.json and one summary line
"""

from __future__ import annotations

import blink
from bench import answers, arms, harness

# (evidence, question, {option key: description}, the correct key)
QUESTIONS = [
    (
        "Order 5521: the blender arrived with a cracked jar. The customer wants the money back, not another blender.",
        "What does the customer ask for?",
        {"refund": "their money back", "replacement": "another unit sent", "repair": "the item fixed"},
        "refund",
    ),
    (
        "I reset my password twice and the app still logs me out every few minutes on my phone.",
        "Which team should handle this ticket?",
        {
            "billing": "payments and invoices",
            "shipping": "deliveries and parcels",
            "tech": "software, app and login problems",
        },
        "tech",
    ),
    (
        "Invoice 2211: 40 pallets of pine boards, 18,400 EUR, paid 29 April, 30 days after the 30 March due date.",
        "Was the invoice paid on time?",
        {"early": "paid before the due date", "on_time": "paid on the due date", "late": "paid after the due date"},
        "late",
    ),
    (
        "The parcel tracking has said 'held at customs' for nine days and nobody answers the phone.",
        "What is the main problem?",
        {
            "damaged": "the item is damaged",
            "delayed": "the delivery is stuck or late",
            "wrong": "the wrong item came",
            "price": "the price charged is wrong",
        },
        "delayed",
    ),
    (
        "Patient reports a dry cough for three weeks, no fever, worse at night, recently started an ACE inhibitor.",
        "What is the most likely cause of the cough?",
        {
            "infection": "a viral infection",
            "drug": "a side effect of the new medication",
            "asthma": "asthma",
            "reflux": "acid reflux",
        },
        "drug",
    ),
    (
        "Great hotel, friendly staff, but the room was noisy and the breakfast was cold both days.",
        "What is the overall tone of the review?",
        {"positive": "mostly positive", "mixed": "mixed, praise and complaints", "negative": "mostly negative"},
        "mixed",
    ),
    (
        "The tenant has not paid rent for March and April and stopped answering the landlord's messages.",
        "Which area of law does this fall under?",
        {
            "criminal": "criminal law",
            "tenancy": "landlord and tenant law",
            "employment": "employment law",
            "tax": "tax law",
            "family": "family law",
        },
        "tenancy",
    ),
    (
        "Our nightly backup job failed with 'No space left on device' on the storage server at 02:14.",
        "What should the on-call engineer check first?",
        {
            "disk": "free disk space on the server",
            "network": "the network link",
            "credentials": "expired passwords",
            "cpu": "processor load",
        },
        "disk",
    ),
    (
        "Thanks a lot, the replacement headset works perfectly. You can close the ticket.",
        "What should happen to the ticket?",
        {"close": "close it as solved", "escalate": "escalate to a manager", "wait": "wait for more information"},
        "close",
    ),
    (
        "The supplier delivered 200 units instead of the 2,000 ordered and invoiced for the full 2,000.",
        "What kind of discrepancy is this?",
        {
            "quantity": "fewer units delivered than billed",
            "quality": "defective goods",
            "price": "a wrong unit price",
            "date": "a late delivery",
        },
        "quantity",
    ),
    (
        "Please update the shipping address on my order to 14 Elm Street before it leaves the warehouse.",
        "What does the customer want to change?",
        {
            "address": "the delivery address",
            "payment": "the payment method",
            "items": "the items ordered",
            "date": "the delivery date",
            "name": "the name on the order",
        },
        "address",
    ),
    (
        "The student solved every problem correctly but showed no working for any of them.",
        "What feedback fits best?",
        {
            "praise": "praise the correct answers only",
            "method": "ask them to show their working",
            "redo": "ask them to redo the whole assignment",
        },
        "method",
    ),
]


def rotated(criteria: dict, shift: int) -> dict:
    """The options listed rotated by `shift` (same keys, same texts)."""
    items = list(criteria.items())
    return dict(items[shift:] + items[:shift])


def arm_requests(questions: list, arm: arms.Arm) -> list[tuple[str, dict]]:
    """One request per (question, base rotation), each question with the arm's fields (`permute`: a number, or "all"
    for every one of its K rotations)."""
    permute = arm.question.get("permute")
    requests = []
    for state, ask, criteria, _ in questions:
        for shift in range(len(criteria)):
            q = {"type": "choice", "instructions": ask, "criteria": rotated(criteria, shift)}
            if permute is not None:
                q["permute"] = len(criteria) if permute == "all" else min(permute, len(criteria))
            requests.append((state, {"q": q}))
    return requests


def run_arm(eng: blink.TorchEngine, questions: list, arm: arms.Arm) -> dict:
    """Decide every rotation of every question in one packed call; picks, flips, accuracy, cost."""

    def decide_all() -> tuple[list, list]:
        requests = [blink.parse_request(state, qs, settings=eng.settings) for state, qs in arm_requests(questions, arm)]
        return requests, eng.run([eng.prepare(request) for request in requests])  # all packed into shared forwards

    wall, _, (requests, results) = harness.timed(decide_all)
    wall_ms = wall * 1000
    failed = next((r for r in results if isinstance(r, Exception)), None)
    if failed is not None:
        raise failed
    answered = [answers.of(request, res.readouts)["q"] for request, res in zip(requests, results)]
    per_question, k = [], 0
    for _state, ask, criteria, correct in questions:
        mine = answered[k : k + len(criteria)]
        k += len(criteria)
        picks = [a["choice"] for a in mine]
        per_question.append(
            {
                "question": ask,
                "correct": correct,
                "picks": picks,
                "flips": len(set(picks)) > 1,
                "disagree_with_listed_order": sum(p != picks[0] for p in picks[1:]) / (len(picks) - 1),
                "label_mass": sum(a["label_mass"] for a in mine) / len(mine),
                "order_sensitivity": (sum(a["order_sensitivity"] for a in mine) / len(mine) if arm.question else None),
            }
        )
    n_picks = sum(len(q["picks"]) for q in per_question)
    return {
        "permute": arm.question.get("permute"),
        "requests": len(requests),
        "prompts": sum(len(r.logits) for res in results for r in res.readouts.values()),
        "model_ms": results[-1].model_ms,
        "wall_ms": round(wall_ms, 1),
        "flip_rate": sum(q["flips"] for q in per_question) / len(per_question),
        "disagreement": sum(q["disagree_with_listed_order"] for q in per_question) / len(per_question),
        "accuracy": sum(p == q["correct"] for q in per_question for p in q["picks"]) / n_picks,
        "mean_label_mass": sum(q["label_mass"] for q in per_question) / len(per_question),
        "per_question": per_question,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the three arms on one model and write bench/results/order.json."""
    run = harness.Run(
        "order", argv, __doc__, lambda ap: ap.add_argument("--model", default=blink.STANDIN_MODEL, help="model id"), "0"
    )
    questions = QUESTIONS[:4] if run.quick else QUESTIONS
    eng = blink.TorchEngine(run.args.model)
    run.probe()
    result = {name: run_arm(eng, questions, arm) for name, arm in arms.of("order").items()}
    plain_prompts = result["plain"]["prompts"]
    path = run.write({"model": eng.model_id, "temperature": 1.0, "questions": len(questions), "arms": result})
    summary = "; ".join(
        f"{name}: flips {a['flip_rate']:.0%} of questions, disagrees with the listed order {a['disagreement']:.0%}, "
        f"accuracy {a['accuracy']:.0%}, {a['prompts'] / plain_prompts:.1f}x prompts, model {a['model_ms'] / 1000:.1f} s"
        for name, a in result.items()
    )
    print(
        f"order robustness, {eng.model_id}, {len(questions)} questions under every rotation of their options: "
        f"{summary}; mean label mass {result['plain']['mean_label_mass']:.3f} -> {path}"
    )
    return 0
