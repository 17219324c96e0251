"""Request size, nesting, type and token limits, enforced before any model work."""

from __future__ import annotations

import pytest

import blink

Q = {"q": {"type": "noul", "instructions": "ok?"}}
DEFAULTS = blink.Settings()  # every setting at its default, on a machine without a GPU


def parse(state, questions, settings: blink.Settings = DEFAULTS) -> blink.Request:
    """A request checked and parsed under these settings."""
    return blink.parse_request(state, questions, settings=settings)


def nested(depth: int):
    """A list nested `depth` levels deep."""
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def test_deep_nesting_is_refused_without_recursion():
    with pytest.raises(blink.BlinkError, match="nests deeper than 64 levels") as caught:
        parse({"a": nested(100_000)}, Q)
    assert caught.value.loc[:3] == ["body", "state", "a"]
    parse(nested(60), Q)
    with pytest.raises(blink.BlinkError, match="nests deeper than 64 levels") as caught:
        parse("x", {"q": {"type": "choice", "criteria": {"a": nested(100)}}})
    assert caught.value.loc[:5] == ["body", "questions", "q", "criteria", "a"]
    with pytest.raises(blink.BlinkError, match="nests deeper than 8 levels"):
        parse(nested(9), Q, blink.Settings(max_json_depth=8))
    parse(nested(7), Q, blink.Settings(max_json_depth=8))
    assert blink.check_json(nested(8), ["body", "state"], 10, 8) == 0
    with pytest.raises(blink.BlinkError, match="nests deeper than 7 levels"):
        blink.check_json(nested(8), ["body", "state"], 10, 7)


def test_deep_json_text_state_is_refused_not_read_as_text():
    # JSON text too deep to parse is refused at body.state (it used to be read as plain evidence text)
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(blink.BlinkError, match="state nests too deep to read") as caught:
        blink.as_state(deep)
    assert caught.value.loc == ["body", "state"]
    assert blink.as_state("[[1, 2") == "[[1, 2"  # text that only looks like JSON still stays text


def test_over_long_integers_are_refused_with_their_location():
    long_int = 10**blink.MAX_INT_DIGITS  # one digit more than allowed
    with pytest.raises(blink.BlinkError, match="over 4000 digits") as caught:
        parse({"a": [1, long_int]}, Q)
    assert caught.value.loc == ["body", "state", "a", 1]
    with pytest.raises(blink.BlinkError, match="over 4000 digits") as caught:
        parse("x", {"q": {"type": "choice", "criteria": {"a": -long_int}}})
    assert caught.value.loc == ["body", "questions", "q", "criteria", "a"]
    parse({"a": long_int - 1}, Q)  # 4000 digits are allowed
    with pytest.raises(blink.BlinkError) as caught:  # as JSON text, too long to convert: refused, not read as text
        blink.as_state('{"a": ' + "9" * 5000 + "}")
    assert caught.value.loc == ["body", "state"]


def test_oversized_request_is_refused():
    small = blink.Settings(max_request_chars=1000)
    with pytest.raises(blink.BlinkError, match="over 1000 characters") as caught:
        parse("x" * 1001, Q, small)
    assert caught.value.loc == ["body"]
    with pytest.raises(blink.BlinkError, match="over 1000 characters"):
        parse("x" * 900, {"q": {"type": "noul", "instructions": "y" * 200}}, small)


def test_non_json_values_are_refused():
    with pytest.raises(blink.BlinkError, match="must be text or JSON \\(got bytes\\)") as caught:
        parse({"blob": b"\x00"}, Q)
    assert caught.value.loc == ["body", "state", "blob"]
    with pytest.raises(blink.BlinkError, match="non-text key 3"):
        parse({3: "x"}, Q)
    with pytest.raises(blink.BlinkError, match="must be text or JSON"):
        parse("x", {"q": {"type": "choice", "criteria": {"a": object()}}})


def test_total_tokens_are_capped_before_the_forward(monkeypatch):
    eng = blink.TorchEngine(blink.STANDIN_MODEL, settings=blink.Settings(max_request_tokens=300))
    calls = []
    monkeypatch.setattr(blink, "_forward", lambda *a: calls.append(a))
    qs = {f"q{i}": {"type": "noul", "instructions": f"question {i}?"} for i in range(4)}
    with pytest.raises(blink.BlinkError, match=r"renders to \d+ tokens over all questions, over the limit of 300"):
        eng.forward(parse("some evidence", qs))
    assert calls == []


def test_decide_many_checks_its_batch():
    dep = blink.Deployment(blink.Settings(engine="mock"))
    with pytest.raises(blink.BlinkError, match="requests must be a non-empty list"):
        dep.decide_many([])
    with pytest.raises(blink.BlinkError, match="65 requests; one call takes 1-64"):
        dep.decide_many([("x", Q)] * 65)
    out = dep.decide_many([("x", Q), "not a pair", ("x", {})])
    assert out[0]["meta"]["engine"] == "mock"
    # each item's refusal is located as the request alone would be: this one as a whole
    assert isinstance(out[1], blink.BlinkError) and out[1].loc == ["body"] and "requests[1]" in str(out[1])
    assert isinstance(out[2], blink.BlinkError) and "non-empty object" in str(out[2])
