"""Label mass, abstention, order-robust permute and multi-label choice: formulas by hand, then the
real stand-in model (one session engine, few short prompts)."""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import replace

import pytest
import torch

import blink
from adapters import record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATE = "The kettle arrived with a cracked lid and the customer asks for their money back."
INTENT = {
    "type": "choice",
    "instructions": "What does the customer want?",
    "criteria": {"refund": "their money back", "replacement": "a new item", "advice": "usage advice"},
}
TAGS = {
    "type": "choice",
    "instructions": "Which problems are reported?",
    "criteria": {"damaged": "the item is damaged", "late": "the delivery was late"},
    "multi": True,
}
UPSET = {"type": "noul", "instructions": "Is the customer upset?"}
DEFAULTS = blink.Settings()  # every setting at its default, on a machine without a GPU


def parse(q: dict, key: str = "q") -> blink.Question:
    """One question, parsed."""
    return blink.parse_question(key, q)


def req(state, questions: dict, **options) -> blink.Request:
    """A request parsed at default settings."""
    return blink.parse_request(state, questions, settings=DEFAULTS, **options)


def rot(q: dict, shift: int) -> dict:
    """The same choice question with its options listed rotated by `shift`."""
    items = list(q["criteria"].items())
    return {**q, "criteria": dict(items[shift:] + items[:shift])}


def mass_of(p_labels: list[float], other: float) -> tuple[list[float], float]:
    """Label logits and the vocabulary log-sum-exp of a distribution with these label masses plus `other` elsewhere."""
    return [math.log(p) for p in p_labels], math.log(sum(p_labels) + other)


# --- formulas by hand ---------------------------------------------------------------------------------------------


def test_label_mass_is_the_share_of_the_whole_vocabulary_on_the_labels():
    logits, lse = mass_of([0.2, 0.1], 0.7)
    assert blink.label_mass(logits, lse) == pytest.approx(0.3)
    assert blink.label_mass([2.0, 0.0], math.log(math.e**2 + 1 + 3 * math.e)) == pytest.approx(
        (math.e**2 + 1) / (math.e**2 + 1 + 3 * math.e)
    )
    assert blink.label_mass(logits, None) is None
    both = blink.Readout([logits, mass_of([0.5, 0.4], 0.1)[0]], [lse, mass_of([0.5, 0.4], 0.1)[1]])
    assert blink.readout_mass(both) == pytest.approx((0.3 + 0.9) / 2)
    assert blink.readout_mass(blink.Readout([logits, logits], [lse, None])) is None


def test_label_mass_does_not_depend_on_the_temperature():
    logits, lse = mass_of([0.6, 0.1], 0.3)
    q = {"type": "choice", "criteria": ["x", "y"]}
    hot = blink.answer_question(parse(q), blink.Readout([logits], [lse]), 5.0)
    cold = blink.answer_question(parse(q), blink.Readout([logits], [lse]), 0.2)
    assert hot["label_mass"] == cold["label_mass"] == pytest.approx(0.7)
    assert hot["probabilities"]["x"] < cold["probabilities"]["x"]


def test_rotations_are_evenly_spaced_and_lettered_in_shown_order():
    assert blink.rotation_shifts(3, 3) == [0, 1, 2]
    assert blink.rotation_shifts(4, 2) == [0, 2]
    assert blink.rotation_shifts(5, 2) == [0, 2]
    q = {"type": "choice", "criteria": ["a", "b", "c", "d"], "permute": 2}
    rows = parse(q).rows
    assert [[o.key for o in row.shown] for row in rows] == [["a", "b", "c", "d"], ["c", "d", "a", "b"]]
    plain = parse({"type": "choice", "criteria": ["a", "b", "c", "d"]})
    # one prompt, the request's own rendering: its criterion and its options in request order
    assert plain.rows == (blink.PromptRow("", plain.options),)
    assert [(o.key, o.text) for o in plain.options] == [("a", "a"), ("b", "b"), ("c", "c"), ("d", "d")]
    message = json.loads(blink.user_message("s", rows[1], ["A", "B", "C", "D"]))
    assert [(o["letter"], o["description"]) for o in message["options"]] == [
        ("A", "c"),
        ("B", "d"),
        ("C", "a"),
        ("D", "b"),
    ]


def test_position_bias_averages_out_and_is_measured():
    q = {"type": "choice", "criteria": ["a", "b", "c"], "permute": 3}
    biased = [math.log(0.6), math.log(0.3), math.log(0.1)]  # always favours whatever is shown first
    out = blink.answer_question(parse(q), blink.Readout([biased] * 3, [None] * 3), 1.0)
    assert out["probabilities"] == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})
    assert out["rotation_choices"] == ["a", "b", "c"] and out["rotations"] == 3
    tv = 0.5 * (abs(0.6 - 1 / 3) + abs(0.3 - 1 / 3) + abs(0.1 - 1 / 3))
    assert out["order_sensitivity"] == pytest.approx(tv)
    assert out["choice"] == "a"  # an exact tie goes to the earlier option
    # a model that reads the options: b wins wherever b is shown (rotation 0 shows a b c, 1 shows b c a, 2 c a b)
    rows = [[0.0, 2.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 2.0]]
    steady = blink.answer_question(parse(q), blink.Readout(rows, [None] * 3), 1.0)
    assert steady["choice"] == "b" and steady["rotation_choices"] == ["b", "b", "b"]
    assert steady["order_sensitivity"] == pytest.approx(0.0, abs=1e-12)


def test_multi_reads_an_independent_yes_per_option():
    rows = [[math.log(0.8), math.log(0.2)], [math.log(0.3), math.log(0.7)]]
    out = blink.answer_question(parse(TAGS, "tags"), blink.Readout(rows, [None, None]), 1.0)
    assert out["multi"] is True and out["probabilities"] == pytest.approx({"damaged": 0.8, "late": 0.3})
    assert out["choices"] == ["damaged"] and out["confidence"] == pytest.approx(0.4)  # min(|2p - 1|)
    row = parse(TAGS, "tags").rows[1]
    assert [(o.key, o.text) for o in row.shown] == [("yes", "Yes"), ("no", "No")]
    assert row.criterion == "Which problems are reported?\nDoes this option apply: late: the delivery was late"


@pytest.mark.parametrize(
    "q, rows, lse, fields, reason",
    [
        (
            {**INTENT, "abstain": {"min_label_mass": 0.5}},
            [[math.log(0.2), math.log(0.05), math.log(0.05)]],
            [0.0],
            {"choice": None},
            "label mass 0.3000 is below min_label_mass 0.5",
        ),
        (
            {**INTENT, "abstain": {"min_confidence": 0.6}},
            [[math.log(0.5), math.log(0.3), math.log(0.2)]],
            [0.0],
            {"choice": None},
            "confidence 0.2500 is below min_confidence 0.6",
        ),
        (
            {**UPSET, "abstain": {"min_confidence": 0.3}},
            [[math.log(0.6), math.log(0.4)]],
            [0.0],
            {"noul": None},
            "confidence 0.2000 is below min_confidence 0.3",
        ),
        (
            {"type": "score", "criteria": ["lo", "hi"], "abstain": {"min_label_mass": 0.1}},
            [[0.0, 0.0]],
            [None],
            {"score": None, "choice": None},
            "label mass is unknown",
        ),
        (
            {**TAGS, "abstain": {"min_confidence": 0.5}},
            [[math.log(0.9), math.log(0.1)], [math.log(0.6), math.log(0.4)]],
            [0.0, 0.0],
            {"choices": None},
            "confidence 0.2000 is below min_confidence 0.5",
        ),
    ],
)
def test_abstention_replaces_the_pick_with_the_reason(q, rows, lse, fields, reason):
    out = blink.answer_question(parse(q), blink.Readout(rows, lse), 1.0)
    assert out["abstained"] is True and reason in out["reason"]
    assert {k: out[k] for k in fields} == fields
    assert sum(out["probabilities"].values()) > 0.99 or q.get("multi")  # the distribution stays for the reader


def test_an_answer_that_meets_its_thresholds_says_so_and_plain_ones_are_unchanged():
    rows = [[math.log(0.7), math.log(0.2), math.log(0.1)]]
    q = {**INTENT, "abstain": {"min_label_mass": 0.5, "min_confidence": 0.3}}
    out = blink.answer_question(parse(q), blink.Readout(rows, [0.0]), 1.0)
    assert out["abstained"] is False and out["choice"] == "refund" and "reason" not in out
    plain = blink.answer_question(parse(INTENT), blink.Readout(rows, [0.0]), 1.0)
    assert list(plain) == ["type", "choice", "probabilities", "confidence", "label_mass"]


@pytest.mark.parametrize(
    "extra, loc, message",
    [
        ({"permute": 0}, ["permute"], "permute must be a whole number of rotations from 1 to its 3 options"),
        ({"permute": 4}, ["permute"], "from 1 to its 3 options (got 4)"),
        ({"permute": True}, ["permute"], "permute must be a whole number"),
        ({"permute": 2.0}, ["permute"], "permute must be a whole number"),
        ({"multi": "yes"}, ["multi"], "multi must be true or false"),
        ({"multi": True, "permute": 2}, ["multi"], "multi and permute cannot be combined"),
        ({"abstain": 0.5}, ["abstain"], "abstain must be an object"),
        ({"abstain": {}}, ["abstain"], "abstain must be an object"),
        ({"abstain": {"min_mass": 0.5}}, ["abstain", "min_mass"], "abstain.min_mass is not a threshold"),
        ({"abstain": {"min_confidence": 1.5}}, ["abstain", "min_confidence"], "must be a number from 0 to 1"),
        ({"abstain": {"min_label_mass": "high"}}, ["abstain", "min_label_mass"], "must be a number from 0 to 1"),
    ],
)
def test_every_new_field_is_validated_with_its_location(extra, loc, message):
    with pytest.raises(blink.BlinkError) as caught:
        blink.parse_questions({"intent": {**INTENT, **extra}})
    assert message in str(caught.value) and "question 'intent'" in str(caught.value)
    assert caught.value.loc == ["body", "questions", "intent", *loc]


@pytest.mark.parametrize("q, field", [(UPSET, "permute"), ({"type": "score", "criteria": ["a", "b"]}, "multi")])
def test_permute_and_multi_are_for_choice_questions(q, field):
    with pytest.raises(blink.BlinkError, match=f"{field} applies to choice questions only") as caught:
        blink.parse_questions({"q": {**q, field: 2 if field == "permute" else True}})
    assert caught.value.loc == ["body", "questions", "q", field]


def test_prompt_count_is_capped():
    assert blink.MAX_PROMPTS == 2048
    # eight multi questions of 255 options render 2040 prompts; a permuted choice adds one prompt per rotation
    wide = {f"m{i}": {"type": "choice", "criteria": [f"o{j}" for j in range(255)], "multi": True} for i in range(8)}
    nine = {"type": "choice", "criteria": [f"k{j}" for j in range(9)]}
    at_cap = blink.parse_questions({**wide, "p": {**nine, "permute": 8}})
    assert sum(len(q.rows) for q in at_cap) == 2048
    with pytest.raises(blink.BlinkError, match="2049 prompts to run") as caught:
        blink.parse_questions({**wide, "p": {**nine, "permute": 9}})
    assert caught.value.loc == ["body", "questions"]


# --- engines without a model --------------------------------------------------------------------------------------


def test_mock_fabricates_a_label_mass_and_says_so(served):
    mock = blink.MockEngine("org/mock")
    qs = {"intent": {**INTENT, "permute": 3}, "tags": TAGS}
    out = served(mock).decide(STATE, qs)
    assert out["meta"]["fabricated"] is True and "fabricated" in out["meta"]["notice"]
    # a question's label mass is the mean over its prompts (rotations, options) of the share of the whole
    # distribution on the labels, exp(LSE(label logits) - LSE(vocabulary)), from the engine's own readout
    (forward,) = mock.run([mock.prepare(blink.parse_request(STATE, qs))])
    for key, answer in out["answers"].items():
        readout = forward.readouts[key]
        shares = [
            math.exp(math.log(sum(math.exp(v) for v in row)) - lse) for row, lse in zip(readout.logits, readout.lse)
        ]
        assert len(shares) == (3 if key == "intent" else len(TAGS["criteria"]))
        assert answer["label_mass"] == pytest.approx(sum(shares) / len(shares), abs=1e-12)
    cooler = served(mock).decide(STATE, qs, temperature=0.5)  # the model's own distribution: no temperature in it
    assert {k: a["label_mass"] for k, a in cooler["answers"].items()} == pytest.approx(
        {k: a["label_mass"] for k, a in out["answers"].items()}, abs=1e-12
    )
    assert out["answers"]["intent"]["rotations"] == 3 and set(out["answers"]["tags"]["probabilities"]) == {
        "damaged",
        "late",
    }


def recording(path, model: str, state, questions: dict, entry: dict) -> None:
    """A recording file holding one request."""
    path.write_text(
        json.dumps(
            {
                "model": model,
                "hardware": "test CPU",
                "requests": {blink.request_key(state, questions): {**entry, "input_tokens": 40, "latency_ms": 5.0}},
            }
        )
    )


def test_old_recordings_give_no_label_mass_and_new_ones_replay_every_prompt(tmp_path, served):
    path = tmp_path / "replay.json"
    qs = {"upset": {**UPSET, "abstain": {"min_label_mass": 0.2}}}
    recording(path, "org/a", STATE, qs, {"logits": {"upset": [1.0, 0.0]}})
    old = served(blink.ReplayEngine(str(path), model_id="org/a")).decide(STATE, qs)["answers"]["upset"]
    assert old["label_mass"] is None and old["abstained"] is True and "unknown" in old["reason"]
    qs = {"intent": {**INTENT, "permute": 3}}
    rows = [[math.log(0.6), math.log(0.3), math.log(0.1)]] * 3
    recording(path, "org/a", STATE, qs, {"logits": {"intent": rows}, "lse": {"intent": [math.log(2.0)] * 3}})
    new = served(blink.ReplayEngine(str(path), model_id="org/a")).decide(STATE, qs)["answers"]["intent"]
    # each rotation's distribution, in request order, is a rotation of (0.6, 0.3, 0.1): their average is a third each,
    # and each lies the same total-variation distance from it
    spread = 0.5 * (abs(0.6 - 1 / 3) + abs(0.3 - 1 / 3) + abs(0.1 - 1 / 3))
    assert new["label_mass"] == pytest.approx(0.5) and new["order_sensitivity"] == pytest.approx(spread)
    recording(path, "org/a", STATE, qs, {"logits": {"intent": rows[:2]}})
    dep = served(blink.ReplayEngine(str(path), model_id="org/a"))
    with pytest.raises(blink.ReplayMiss, match="does not match its options"):
        dep.decide(STATE, qs)
    recording(path, "org/a", STATE, qs, {"logits": {"intent": rows}, "lse": {"intent": [0.0]}})
    with pytest.raises(blink.BlinkError, match="malformed entry"):
        blink.ReplayEngine(str(path))


# --- the real stand-in model --------------------------------------------------------------------------------------

LIVE_QS = {
    "intent": {**INTENT, "permute": 3},
    "tags": TAGS,
    # the multi question's two prompts, asked as plain noul questions: they must read exactly the same
    "as_noul_damaged": {
        "type": "noul",
        "instructions": blink.multi_criterion(TAGS["instructions"], "damaged: the item is damaged"),
    },
    "as_noul_late": {
        "type": "noul",
        "instructions": blink.multi_criterion(TAGS["instructions"], "late: the delivery was late"),
    },
    "upset": UPSET,
}


@pytest.fixture(scope="module")
def live(standin):
    """One request with permute, multi and plain questions through the stand-in, counting forward calls."""
    calls = []
    forward = blink._forward

    def counted(key, seqs, *rest):
        calls.append(len(seqs))
        return forward(key, seqs, *rest)

    request = req(STATE, LIVE_QS)
    blink._forward = counted
    try:
        result = standin.forward(request)
    finally:
        blink._forward = forward
    return {
        "raw": result.readouts,
        "n_tokens": result.input_tokens,
        "calls": calls,
        "request": request,
        "prompts": standin.render(request),
    }


def test_every_prompt_runs_in_the_same_forward(live):
    assert live["calls"] == [3 + 2 + 1 + 1 + 1]
    assert [len(r.logits) for r in live["raw"].values()] == [3, 2, 1, 1, 1]
    assert live["n_tokens"] == sum(len(p.ids) for p in live["prompts"])


def test_label_mass_matches_the_full_model_distribution(live, standin):
    rows = {}
    for p in live["prompts"]:
        rows.setdefault(p.qkey, []).append(p)
    # one prompt of each kind, each run alone through the model's own full forward: a rotation, a multi option, a noul
    for qkey, row in (("intent", 1), ("tags", 1), ("upset", 0)):
        p = rows[qkey][row]
        with torch.no_grad():
            logp = standin.model(input_ids=torch.tensor([p.ids])).logits[0, -1].float().log_softmax(-1)
        want = logp[p.cand].exp().sum().item()
        readout = live["raw"][qkey]
        assert blink.label_mass(readout.logits[row], readout.lse[row]) == pytest.approx(want, abs=1e-4)


def test_multi_prompts_are_the_noul_rendering(live, standin):
    raw = live["raw"]
    for row, twin in enumerate(["as_noul_damaged", "as_noul_late"]):
        assert raw["tags"].logits[row] == pytest.approx(raw[twin].logits[0], abs=1e-5)
        assert raw["tags"].lse[row] == pytest.approx(raw[twin].lse[0], abs=1e-5)
    answers = blink.assemble(live["request"], raw, {q: 1.0 for q in LIVE_QS})
    assert answers["tags"]["probabilities"]["late"] == pytest.approx(answers["as_noul_late"]["noul"], abs=1e-6)


def test_options_keep_the_trained_rendering(standin):
    plain = standin.render(req(STATE, {"intent": INTENT}))[0]
    opted = standin.render(req(STATE, {"intent": {**INTENT, "abstain": {"min_confidence": 0.2}, "multi": False}}))[0]
    rotations = standin.render(req(STATE, {"intent": {**INTENT, "permute": 3}}))
    assert opted.ids == plain.ids
    # permute's rotations are of the options in key order, each rendered as a plain question listing them so
    keyed = {**INTENT, "criteria": {k: INTENT["criteria"][k] for k in sorted(INTENT["criteria"])}}
    assert rotations[0].ids == standin.render(req(STATE, {"intent": keyed}))[0].ids
    assert rotations[1].ids == standin.render(req(STATE, {"intent": rot(keyed, 1)}))[0].ids
    assert rotations[1].keys == ["refund", "replacement", "advice"]


def test_batched_readout_and_shared_prefix_carry_the_same_label_mass(live):
    settings = replace(DEFAULTS, readout="batched", prefix_cache=True, prefix_min_tokens=8)
    eng = blink.TorchEngine(blink.STANDIN_MODEL, settings=settings)
    request = req(STATE, {"intent": LIVE_QS["intent"]})
    prompts = eng.render(request)
    seqs = [p.ids for p in prompts]
    # the three rotations share one prefix (the header and the evidence), encoded once
    ((rows, shared),) = blink.prefix_groups(seqs, [p.cuts for p in prompts], settings, eng.prefixes.keeps)
    assert rows == [0, 1, 2] and shared == prompts[0].cuts[-1] > 8
    result = eng.forward(request)
    assert result.prefill_tokens == sum(map(len, seqs)) - 2 * shared
    raw = result.readouts
    for row in range(3):
        assert raw["intent"].lse[row] == pytest.approx(live["raw"]["intent"].lse[row], abs=1e-4)
        assert raw["intent"].logits[row] == pytest.approx(live["raw"]["intent"].logits[row], abs=1e-4)


def test_a_recording_replays_every_prompt_and_the_label_mass(live, tmp_path, served):
    path = tmp_path / "replay.json"
    recording(path, blink.STANDIN_MODEL, STATE, LIVE_QS, record.recording_entry(live["raw"]))
    dep = served(blink.ReplayEngine(str(path), model_id=blink.STANDIN_MODEL))
    replayed = dep.decide(STATE, LIVE_QS)["answers"]
    assert replayed == blink.assemble(live["request"], live["raw"], {q: 1.0 for q in LIVE_QS})
    assert all(a["label_mass"] is not None for a in replayed.values())


def test_rotating_the_options_flips_the_plain_choice_but_not_the_robust_one(standin, served):
    dep = served(standin)
    q = {
        "type": "choice",
        "instructions": "Which department should handle this ticket?",
        "criteria": {
            "billing": "payments and invoices",
            "shipping": "deliveries and parcels",
            "tech": "software and login problems",
        },
    }
    requests = [(STATE, {"q": rot(q, s)}) for s in range(3)] + [
        (STATE, {"q": {**rot(q, s), "permute": 3}}) for s in range(3)
    ]
    results = dep.decide_many(requests)
    plain = [r["answers"]["q"] for r in results[:3]]
    robust = [r["answers"]["q"] for r in results[3:]]
    plain_flips = len({a["choice"] for a in plain}) > 1
    robust_flips = len({a["choice"] for a in robust}) > 1
    print(
        f"stand-in, 3 rotations: plain picks {[a['choice'] for a in plain]} (flips: {plain_flips}); "
        f"robust picks {[a['choice'] for a in robust]} (flips: {robust_flips}); "
        f"order sensitivity {robust[0]['order_sensitivity']:.3f}"
    )
    assert not robust_flips
    for a in robust:  # all three rotations averaged, whatever order the request listed them in
        assert a["probabilities"] == pytest.approx(robust[0]["probabilities"], abs=1e-6)
    # the plain requests are exactly the three rotations: their mean is the robust distribution
    mean = {k: sum(a["probabilities"][k] for a in plain) / 3 for k in q["criteria"]}
    assert robust[0]["probabilities"] == pytest.approx(mean, abs=1e-6)
    assert sorted(robust[0]["rotation_choices"]) == sorted(a["choice"] for a in plain)
    assert all(0 < a["label_mass"] < 1 for a in plain + robust)


def test_permute_rotates_the_key_order_so_the_listed_order_cannot_move_the_answer(standin, served):
    """Two rotations of four options: every one of the 24 listed orders renders the same prompts (the key order's
    rotations) and gets the same answer back; without permute the stand-in's pick follows the listed order."""
    q = {
        "type": "choice",
        "instructions": "Which department should handle this ticket?",
        "criteria": {
            "shipping": "deliveries and parcels",
            "billing": "payments and invoices",
            "tech": "software and login problems",
            "returns": "sending an item back",
        },
    }
    orders = [dict(p) for p in itertools.permutations(q["criteria"].items())]
    shown = {
        tuple(tuple(o.key for o in row.shown) for row in parse({**q, "criteria": c, "permute": 2}).rows) for c in orders
    }
    assert shown == {(("billing", "returns", "shipping", "tech"), ("shipping", "tech", "billing", "returns"))}
    results = served(standin).decide_many(
        [(STATE, {"q": {**q, "criteria": c, "permute": 2}}) for c in orders]
        + [(STATE, {"q": {**q, "criteria": c}}) for c in orders]
    )
    robust = [r["answers"]["q"] for r in results[: len(orders)]]
    plain = [r["answers"]["q"] for r in results[len(orders) :]]
    assert len({a["choice"] for a in plain}) > 1  # the listed order does move a plain pick on this model
    assert len({a["choice"] for a in robust}) == 1
    for a in robust:
        assert a["probabilities"] == pytest.approx(robust[0]["probabilities"], abs=1e-6)
        assert a["rotation_choices"] == robust[0]["rotation_choices"]
