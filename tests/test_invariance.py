"""An answer is a function of its request alone, at the defaults: the same question gives the same probabilities
asked alone, beside 3 and 15 other questions (krite-bench's interference run), packed with other callers' requests
of other lengths (decide_many, the Batcher) and asked again once its evidence is kept. Bit-identical is the goal;
the bar is krite-bench's: 1e-5 in float32, 1e-3 in bfloat16/float16."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
from conftest import invariance_bar as bar
from conftest import wait_until
from test_batching import held_batcher
from test_prefix import DOC

import blink

TARGET = {
    "type": "choice",
    "instructions": "Which team should handle this case?",
    "criteria": ["billing", "shipping", "technical support", "account security"],
}
SHORT = "The parcel arrived three days late and the box was crushed; the customer wants a refund."
LONG = " ".join([DOC] * 3)  # evidence past prefix_min_tokens: it runs from a kept prefix of its own
OTHERS = [  # other callers' requests: evidence and questions of other lengths
    ("Paid in full on Monday, thanks!", {"paid": {"type": "noul", "instructions": "Has the customer paid?"}}),
    (
        {"order": 17, "status": "unpaid", "note": "customer is delighted with the product " * 6},
        {"tone": {"type": "choice", "instructions": "Tone?", "criteria": ["calm", "angry", "happy"]}},
    ),
    (LONG[: len(LONG) // 2], {"sev": {"type": "score", "instructions": "Severity?", "criteria": ["low", "high"]}}),
]


def fillers(n: int) -> dict:
    """n filler questions of every type and of growing length (krite-bench's interference run adds 3 and 15)."""
    out = {}
    for i in range(n):
        words = " and why" * i
        kind = ("noul", "choice", "score")[i % 3]
        q = {"type": kind, "instructions": f"Filler question {i}: is anything unusual here{words}?"}
        if kind != "noul":
            q["criteria"] = [f"level {j}" for j in range(2 + i % 7)]
        out[f"filler_{i}"] = q
    return out


def spread(answers: list[dict]) -> float:
    """The largest difference of one probability across several answers to the same question."""
    probs = [list(a["probabilities"].values()) for a in answers]
    return max(abs(p[k] - probs[0][k]) for p in probs for k in range(len(p)))


_BFLOAT16: dict = {}


ENGINES = ["standin", "tiny_qwen", "standin-bfloat16", "tiny_qwen-bfloat16"]


@pytest.fixture(params=ENGINES)
def engine(request) -> blink.TorchEngine:
    """Each torch engine at the defaults, the stand-in (Llama-shaped) and a tiny Qwen3.5 (linear attention), and
    each at bfloat16: the default where the CPU computes it natively, asked for here on any CPU."""
    name, _, dtype = request.param.partition("-")
    base = request.getfixturevalue(name)
    if not dtype:
        return base
    if name not in _BFLOAT16:
        _BFLOAT16[name] = blink.TorchEngine(base.source, settings=replace(base.settings, dtype=dtype))
    return _BFLOAT16[name]


MEDIUM = LONG[: len(LONG) // 3]  # under prefix_min_tokens but long: a tail with many scores


STATES = {"short_evidence": SHORT, "medium_evidence": MEDIUM, "long_evidence": LONG}
# The stand-in in bfloat16 computes without bfloat16 instructions on many CPUs (several times float32's time), so
# beside fillers it is asked the medium evidence alone, the longest scored tail; its short evidence beside fillers is
# the packed test's request, its long evidence the batcher test's.
FILLER_CASES = [
    pytest.param(engine, state, id=f"{engine}-{name}")
    for engine in ENGINES
    for name, state in STATES.items()
    if engine != "standin-bfloat16" or name == "medium_evidence"
]


@pytest.mark.parametrize("engine,state", FILLER_CASES, indirect=["engine"])
def test_a_question_is_answered_the_same_alone_and_beside_fillers(engine, served, state):
    dep = served(engine)
    alone = dep.decide(state, {"target": TARGET})["answers"]["target"]
    beside = [dep.decide(state, {"target": TARGET, **fillers(n)})["answers"]["target"] for n in (3, 15)]
    again = dep.decide(state, {"target": TARGET})["answers"]["target"]  # its evidence kept by now
    assert spread([alone, *beside, again]) <= bar(engine)


def test_a_request_is_answered_the_same_alone_and_packed_with_other_callers(engine, served):
    dep = served(engine)
    mine = (SHORT, {"target": TARGET, **fillers(3)})
    alone = dep.decide(*mine)["answers"]
    packed = dep.decide_many([OTHERS[0], mine, OTHERS[1], (LONG, fillers(15)), OTHERS[2]])
    assert packed[1]["meta"]["batched_requests"] == 5  # one forward for all of them
    for q in alone:
        assert spread([alone[q], packed[1]["answers"][q]]) <= bar(engine)


def test_the_batcher_packs_callers_without_moving_their_answers(engine, served):
    dep = served(engine, blink.Settings(batch_max_requests=8))
    requests = [(SHORT, {"target": TARGET}), (LONG, {"target": TARGET, **fillers(3)}), *OTHERS]
    alone = [dep.decide(*r)["answers"] for r in requests]
    batcher, sizes, entered, release = held_batcher(dep)
    results: dict = {}
    threads = [
        threading.Thread(target=lambda i=i: results.setdefault(i, dep.submit(dep.request(*requests[i]))))
        for i in range(len(requests))
    ]
    threads[0].start()
    assert entered.wait(120)  # the first runs alone; the others wait and then share one forward
    for t in threads[1:]:
        t.start()
    assert wait_until(lambda: batcher.q.qsize() == len(requests) - 1)
    release.set()
    for t in threads:
        t.join(timeout=120)
    assert sizes == [1, len(requests) - 1]
    for i, answers in enumerate(alone):
        for q in answers:
            assert spread([answers[q], results[i]["answers"][q]]) <= bar(engine)
