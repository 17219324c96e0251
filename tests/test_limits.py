"""Request size, nesting, type and token limits, enforced before any model work."""

from __future__ import annotations

import pytest

import blink

Q = {"q": {"type": "noul", "instructions": "ok?"}}


def nested(depth: int):
    """A list nested `depth` levels deep."""
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def test_deep_nesting_is_refused_without_recursion():
    with pytest.raises(blink.BlinkError, match="nests deeper than 64 levels") as caught:
        blink.validate_request({"a": nested(100_000)}, Q)
    assert caught.value.loc[:3] == ["body", "state", "a"]
    blink.validate_request(nested(60), Q)


def test_deep_json_text_state_stays_text():
    deep = "[" * 100_000 + "]" * 100_000
    assert blink.as_state(deep) == deep


def test_oversized_request_is_refused(monkeypatch):
    monkeypatch.setattr(blink, "MAX_REQUEST_CHARS", 1000)
    with pytest.raises(blink.BlinkError, match="over 1000 characters") as caught:
        blink.validate_request("x" * 1001, Q)
    assert caught.value.loc == ["body"]
    with pytest.raises(blink.BlinkError, match="over 1000 characters"):
        blink.validate_request("x" * 900, {"q": {"type": "noul", "instructions": "y" * 200}})


def test_non_json_values_are_refused():
    with pytest.raises(blink.BlinkError, match="must be text or JSON \\(got bytes\\)") as caught:
        blink.validate_request({"blob": b"\x00"}, Q)
    assert caught.value.loc == ["body", "state", "blob"]
    with pytest.raises(blink.BlinkError, match="non-text key 3"):
        blink.validate_request({3: "x"}, Q)
    with pytest.raises(blink.BlinkError, match="must be text or JSON"):
        blink.validate_request("x", {"q": {"type": "choice", "criteria": {"a": object()}}})


def test_total_tokens_are_capped_before_the_forward(standin, monkeypatch):
    monkeypatch.setattr(blink, "MAX_REQUEST_TOKENS", 300)
    calls = []
    monkeypatch.setattr(blink, "_forward", lambda *a: calls.append(a))
    qs = {f"q{i}": {"type": "noul", "instructions": f"question {i}?"} for i in range(4)}
    with pytest.raises(blink.BlinkError, match=r"renders to \d+ tokens over all questions, over the limit of 300"):
        standin.logits("some evidence", qs)
    assert calls == []


def test_decide_many_checks_its_batch(monkeypatch):
    monkeypatch.setattr(blink, "ENGINE", "mock")
    monkeypatch.setattr(blink, "_ENGINE", None)
    with pytest.raises(blink.BlinkError, match="requests must be a list of 1-64"):
        blink.decide_many([])
    with pytest.raises(blink.BlinkError, match="requests must be a list"):
        blink.decide_many([("x", Q)] * 65)
    out = blink.decide_many([("x", Q), "not a pair", ("x", {})])
    assert out[0]["meta"]["engine"] == "mock"
    assert isinstance(out[1], blink.BlinkError) and out[1].loc == ["body", "requests", 1]
    assert isinstance(out[2], blink.BlinkError) and "non-empty object" in str(out[2])
