"""Answer formulas on hand-computed logits."""

from __future__ import annotations

import math

import pytest

import blink


def answer_for(q: dict, keys: list[str], probs: list[float]) -> dict:
    """blink.answer_for on the parsed question, after checking the keys are its option keys in request order."""
    question = blink.parse_question("q", q)
    assert question.keys == keys
    return blink.answer_for(question, probs)


def test_softmax_with_temperature_by_hand():
    p = blink.softmax([0.0, math.log(3.0)], 1.0)
    assert p == pytest.approx([0.25, 0.75])
    p2 = blink.softmax([0.0, math.log(3.0)], 2.0)  # exp(log3 / 2) = sqrt(3)
    assert p2 == pytest.approx([1 / (1 + math.sqrt(3)), math.sqrt(3) / (1 + math.sqrt(3))])
    assert blink.softmax([1000.0, 1000.0], 1.0) == pytest.approx([0.5, 0.5])  # stable at large logits


def test_choice_answer_and_confidence():
    q = {"type": "choice", "criteria": ["red", "green", "blue", "cyan"]}
    a = answer_for(q, ["red", "green", "blue", "cyan"], [0.1, 0.6, 0.2, 0.1])
    assert a["choice"] == "green"
    assert a["confidence"] == pytest.approx((0.6 - 0.25) / 0.75)
    assert a["probabilities"] == pytest.approx({"red": 0.1, "green": 0.6, "blue": 0.2, "cyan": 0.1})


def test_ties_go_to_the_earlier_option_in_request_order():
    q = {"type": "choice", "criteria": ["z", "a"]}
    assert answer_for(q, ["z", "a"], [0.5, 0.5])["choice"] == "z"
    s = {"type": "score", "criteria": ["lo", "mid", "hi"]}
    assert answer_for(s, ["0", "1", "2"], [0.2, 0.4, 0.4])["choice"] == "1"


def test_single_option_choice_is_certain():
    q = {"type": "choice", "criteria": ["only"]}
    a = answer_for(q, ["only"], [1.0])
    assert a["choice"] == "only" and a["confidence"] == 1.0


def test_noul_is_p_yes():
    q = {"type": "noul"}
    a = answer_for(q, ["yes", "no"], [0.3, 0.1])  # renormalised over the two labels
    assert a == {"type": "noul", "noul": pytest.approx(0.75), "probabilities": pytest.approx({"yes": 0.75, "no": 0.25})}


def test_score_expected_value_legend_and_confidence():
    q = {"type": "score", "criteria": ["none", "some", {"k": "all"}]}
    a = answer_for(q, ["0", "1", "2"], [0.2, 0.3, 0.5])
    assert a["score"] == pytest.approx(0 * 0.2 + 1 * 0.3 + 2 * 0.5)
    assert a["legend"] == {"0": "none", "1": "some", "2": '{\n  "k": "all"\n}'}
    assert a["choice"] == "2"
    assert a["confidence"] == pytest.approx((0.5 - 1 / 3) / (2 / 3))
    assert list(a) == ["type", "score", "probabilities", "legend", "choice", "confidence"]


def test_assemble_goes_from_logits_to_answers():
    qs = {"c": {"type": "choice", "criteria": {"x": "ex", "y": "why"}}, "n": {"type": "noul"}}
    raw = {"c": blink.Readout([[0.0, math.log(4.0)]], [None]), "n": blink.Readout([[math.log(9.0), 0.0]], [None])}
    out = blink.assemble(blink.parse_request("state", qs, settings=blink.Settings()), raw, {"c": 1.0, "n": 1.0})
    assert out["c"]["choice"] == "y" and out["c"]["probabilities"]["y"] == pytest.approx(0.8)
    assert out["n"]["noul"] == pytest.approx(0.9)
