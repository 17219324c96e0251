"""Generated System One requests that blink and transformers' decision module both accept: all three question types,
descriptions null, text, object and array, generic and named option keys, one-sided nouls, unicode, JSON and text
states. Deterministic for a seed."""

from __future__ import annotations

import random

# Keys blink's option text drops (GENERIC_KEY: one or two ASCII letters, optionN / option_N / option N, optN, digits,
# Unicode decimal digits, any of them with one trailing newline) and keys it keeps, many of them near misses.
GENERIC_KEYS = [
    "A",
    "b",
    "ab",
    "Zq",
    "opt3",
    "opt12",
    "option_2",
    "option 7",
    "option9",
    "12",
    "0",
    "\u0663",
    "AB\n",
    "7\n",
    "option_\u0665",
]
NAMED_KEYS = [
    "calm",
    "pushy",
    "Option 5",
    "opt",
    "option",
    "option_x",
    "option__3",
    "opt-3",
    "ABC",
    "\u00b2",
    "\u00c4",
    "\u00fcn\u00ef",
    "same",
    "a b",
    "  padded ",
    "\u65e5\u672c\u8a9e",
    "emoji \U0001f642",
    'quote "q"',
    "tab\tkey",
    "x" * 40,
    "true",
    "AB\n\n",
    " A",
    "12a",
    "back\\slash",
]
TEXTS = [
    "A polite message",
    "",
    "   ",
    "Pressures the reader",
    "\u00fcn\u00efc\u00f6d\u00e9 \u201cquotes\u201d \u2014 \U0001f642",
    "line1\nline2",
    'back\\slash "dq"',
    "same",
    "Same ",
    "<b>html</b> & stuff",
    "\t tabbed \t",
    "Zweimal belastet",
    "\u0645\u0631\u062d\u0628\u0627",
    "null",
    '{"looks": "like json"}',
]
WORDS = (
    "the customer was charged twice and wants a refund before friday the router stopped after an update "
    "urgent please call back invoice 4417 shipment delayed in customs"
).split()


def structured(rng: random.Random, depth: int = 0):
    """A small JSON value: objects, arrays, numbers, booleans, null and unicode text."""
    roll = rng.random()
    if depth < 2 and roll < 0.3:
        return {
            rng.choice(["k", "n\u00e4me", "when", "list", "\U0001f642", "a b"]) + str(i): structured(rng, depth + 1)
            for i in range(rng.randint(1, 3))
        }
    if depth < 2 and roll < 0.5:
        return [structured(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return rng.choice([1, -2, 3.5, 1e-7, 12345678901234, True, False, None, rng.choice(TEXTS), "\u00fc"])


def sentence(rng: random.Random) -> str:
    """Some words, with unicode now and then."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 18))]
    if rng.random() < 0.4:
        words.insert(rng.randrange(len(words)), rng.choice(TEXTS))
    return " ".join(words)


def state(rng: random.Random):
    """Evidence as text or as JSON (an object or an array)."""
    roll = rng.random()
    if roll < 0.5:
        return sentence(rng)
    if roll < 0.8:
        return {"ticket": sentence(rng), "meta": structured(rng), "n": rng.randint(0, 9999)}
    return [sentence(rng), structured(rng)]


def content(rng: random.Random):
    """A description or an instruction: null, text, an object or an array."""
    roll = rng.random()
    if roll < 0.2:
        return None
    if roll < 0.65:
        return rng.choice(TEXTS + [sentence(rng)])
    if roll < 0.85:
        return {"meaning": rng.choice(TEXTS), "weight": structured(rng)}
    return [rng.choice(TEXTS), structured(rng)]


def instructions(rng: random.Random):
    """A question's instructions, sometimes padded with whitespace, sometimes structured or absent."""
    value = content(rng)
    if isinstance(value, str) and rng.random() < 0.3:
        value = f"  {value}\n"
    return value


def choice(rng: random.Random, n: int) -> dict:
    """A choice question with n options: generic and named keys, descriptions of every kind (some equal to the key)."""
    pool = GENERIC_KEYS + NAMED_KEYS
    keys = rng.sample(pool, n) if n <= len(pool) else [f"k{i}" for i in range(n)]
    criteria = {}
    for key in keys:
        roll = rng.random()
        criteria[key] = f" {key.upper()} " if roll < 0.08 else content(rng)
    return {"type": "choice", "instructions": instructions(rng), "criteria": criteria}


def noul(rng: random.Random) -> dict:
    """A yes/no question: no criteria, empty, one-sided (true or false only) or both sides."""
    q = {"type": "noul", "instructions": instructions(rng)}
    shape = rng.choice(["absent", "null", "empty", "true", "false", "both"])
    if shape != "absent":
        q["criteria"] = {
            "null": None,
            "empty": {},
            "true": {"true": content(rng)},
            "false": {"false": content(rng)},
            "both": {"true": content(rng), "false": content(rng)},
        }[shape]
    return q


def score(rng: random.Random) -> dict:
    """A score question with 2 to 10 levels of text, empty text, objects or arrays."""
    levels = [
        rng.choice([rng.choice(TEXTS), "", {"when": rng.choice(TEXTS)}, [rng.choice(TEXTS), 2]])
        for _ in range(rng.randint(2, 10))
    ]
    return {"type": "score", "instructions": instructions(rng), "criteria": levels}


def request(rng: random.Random, max_options: int = 60) -> dict:
    """One request of one to four questions of any type."""
    questions = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(["choice", "choice", "noul", "score"])
        if kind == "choice":
            many = rng.random() < 0.06
            q = choice(rng, rng.randint(min(27, max_options), max_options) if many else rng.randint(1, 8))
        else:
            q = noul(rng) if kind == "noul" else score(rng)
        questions[rng.choice(["q", "tone", "\u00e9tat", "spam \U0001f642", "urgency"]) + str(i)] = q
    return {"state": state(rng), "questions": questions}


def requests(count: int, seed: int = 0, max_options: int = 60) -> list[dict]:
    """`count` requests, the same ones for the same seed."""
    rng = random.Random(seed)
    return [request(rng, max_options) for _ in range(count)]
