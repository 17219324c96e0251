"""Hostile values in every field of every question type, in `abstain`'s keys and in the state: each request is
answered or refused with a BlinkError that names where it went wrong — on the mock engine, through the real
tokenizer, and through the launched app, where a normal request is answered while hostile bodies are held inside
their own checks, and each is refused once let go."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import math
import threading

import httpx
import pytest
from conftest import DEFAULTS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blink

BASE = {
    "pick": {
        "type": "choice",
        "instructions": "Which fruit is named?",
        "criteria": {"a": "apple", "b": "banana"},
        "permute": 2,
        "abstain": {"min_label_mass": 0.1, "min_confidence": 0.1},
    },
    "tags": {"type": "choice", "instructions": "Which apply?", "criteria": ["red", "round", "sweet"], "multi": True},
    "late": {"type": "noul", "instructions": "Was it late?", "criteria": {"true": "it was late", "false": "on time"}},
    "rate": {"type": "score", "instructions": "How bad?", "criteria": ["fine", "bad", "awful"]},
}
STATE = {"ticket": "The apple arrived late and bruised.", "id": 17}
DEEP_LIST: list = []
DEEP_DICT: dict = {}
for _ in range(100):
    DEEP_LIST, DEEP_DICT = [DEEP_LIST], {"k": DEEP_DICT}
HOSTILE = {
    "null": None,
    "true": True,
    "zero": 0,
    "negative": -1,
    "2**70": 2**70,
    "4001 digits": 10**4001,
    "nan": math.nan,
    "inf": math.inf,
    "-inf": -math.inf,
    "empty": "",
    "blank": "   ",
    "huge": "word " * 40_000,
    "surrogate": "\ud800",
    "inner surrogate": "a\udfffb",
    "control": "\x00\x01\x1f\x7f",
    "letter": "A",
    "empty list": [],
    "mixed list": [1, "a", None, 2.5],
    "empty object": {},
    "object": {"k": "v"},
    "list of type": ["noul"],
    "object of type": {"type": "noul"},
    "deep list": DEEP_LIST,
    "deep object": DEEP_DICT,
}
# every field of every question type, abstain's keys (a known one and an unknown one), and the state
FIELDS = [
    *((qkey, (name,)) for qkey in BASE for name in ("type", "instructions", "criteria", "abstain")),
    ("pick", ("criteria", "a")),
    ("pick", ("permute",)),
    ("pick", ("multi",)),
    ("pick", ("abstain", "min_label_mass")),
    ("pick", ("abstain", "min_confidence")),
    ("pick", ("abstain", "other")),
    ("tags", ("multi",)),
    ("tags", ("permute",)),
    ("tags", ("criteria", 0)),
    ("late", ("criteria", "true")),
    ("late", ("criteria", "false")),
    ("rate", ("criteria", 1)),
    ("state", ()),
    ("state", ("ticket",)),
    ("questions", ()),
]


# What blink takes at each place (docs/page.md, "The questions format"), of the hostile values above; any other value
# there is refused with its location. A value past JSON's limits (a 4001-digit integer, an unpaired surrogate, nesting
# deeper than 64) is refused wherever it stands.
UNREADABLE = {"4001 digits", "surrogate", "inner surrogate", "deep list", "deep object"}
ANY = set(HOSTILE) - UNREADABLE
NUMBERS = {"true", "zero", "negative", "2**70", "nan", "inf", "-inf"}  # a bool, or a number
TEXT = {"empty", "blank", "huge", "control", "letter"}
TAKEN = {
    **{(q, ("instructions",)): ANY - NUMBERS for q in BASE},  # absent, text, or JSON shown as text
    **{(q, ("abstain",)): {"null"} for q in BASE},  # absent, or an object of known thresholds
    ("pick", ("criteria",)): set(),  # two options at least (the question permutes 2), each key a string or a number
    ("tags", ("criteria",)): {"object", "list of type", "object of type"},  # a multi choice may have one option
    ("late", ("criteria",)): {"null", "empty object", "object", "object of type"},  # absent, or an object
    ("rate", ("criteria",)): {"mixed list"},  # a list of 2 to 10 levels
    ("pick", ("criteria", "a")): ANY,  # an option's description: any JSON value
    ("late", ("criteria", "true")): ANY,
    ("late", ("criteria", "false")): ANY,
    ("rate", ("criteria", 1)): ANY,  # a level, shown as text
    ("tags", ("criteria", 0)): (NUMBERS - {"true"}) | TEXT,  # an option key: a string or a number
    ("pick", ("permute",)): {"null"},  # absent; no other hostile value is a rotation count of 2 options or more
    ("tags", ("permute",)): {"null"},
    ("pick", ("multi",)): {"null"},  # multi cannot join permute
    ("tags", ("multi",)): {"null", "true"},
    ("pick", ("abstain", "min_label_mass")): {"zero"},  # a threshold from 0 to 1
    ("pick", ("abstain", "min_confidence")): {"zero"},
    ("state", ()): ANY - {"empty", "blank"},  # the evidence: any JSON value but blank text
    ("state", ("ticket",)): ANY,  # inside the evidence: any JSON value
}


def hostile_request(target: str, path: tuple, value) -> tuple[object, object]:
    """(state, questions) with `value` put at one place: a question's field, the state, or the questions object."""
    state, questions = copy.deepcopy(STATE), copy.deepcopy(BASE)
    if target == "questions":
        return state, value
    if target == "state":
        if not path:
            return value, questions
        state[path[0]] = value
        return state, questions
    node = questions[target]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return state, questions


def located(exc: blink.BlinkError) -> bool:
    """A refusal that says where: a location inside the request body."""
    return bool(exc.loc) and exc.loc[0] == "body"


def answered_or_located(call) -> str:
    """'answered' or 'refused' when the call answers every question or raises a located BlinkError; anything
    else fails the test."""
    try:
        call()
    except blink.BlinkError as exc:
        assert located(exc), f"refusal without a location: {exc!r}"
        return "refused"
    return "answered"


CASES = [(target, path, name) for target, path in FIELDS for name in HOSTILE]


@pytest.fixture(scope="module")
def mock_deployment() -> blink.Deployment:
    """The mock engine served at default settings."""
    return blink.Deployment.serving(blink.MockEngine("org/mock", DEFAULTS))


def test_every_field_with_every_hostile_value_answers_or_refuses_with_a_location(mock_deployment):
    unlike = []
    for target, path, name in CASES:
        state, questions = hostile_request(target, path, HOSTILE[name])

        def call(state=state, questions=questions):
            result = mock_deployment.decide(state, questions)
            assert set(result["answers"]) == set(questions)

        want = "answered" if name in TAKEN.get((target, path), set()) else "refused"
        if answered_or_located(call) != want:
            unlike.append((target, path, name, want))
    assert unlike == []
    assert sum(map(len, TAKEN.values())) == 190  # of 744 cases: the sweep has both outcomes


@pytest.mark.parametrize("name", ["list of type", "object of type", "4001 digits", "surrogate", "deep list"])
def test_the_refusal_names_the_field(mock_deployment, name):
    state, questions = hostile_request("pick", ("type",), HOSTILE[name])
    with pytest.raises(blink.BlinkError) as caught:
        mock_deployment.decide(state, questions)
    assert caught.value.loc[:3] == ["body", "questions", "pick"]


def test_the_real_tokenizer_renders_or_refuses_every_case(standin):
    for target, path, name in CASES:
        state, questions = hostile_request(target, path, HOSTILE[name])
        try:
            request = blink.parse_request(state, questions, settings=DEFAULTS)
        except blink.BlinkError as exc:
            assert located(exc), exc
            continue
        answered_or_located(lambda: standin.prepare(request))  # noqa: B023 (called at once)


JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**4100), max_value=10**4100),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(["\ud800", "\udfff", "", "choice", "noul", "score", "\x00"]),
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(place=st.sampled_from(FIELDS), value=JSON_VALUES)
def test_random_hostile_json_anywhere_answers_or_refuses_with_a_location(mock_deployment, place, value):
    state, questions = hostile_request(*place, value)
    answered_or_located(lambda: mock_deployment.decide(state, questions))


# ---------------------------------------------------------------------------------------------------------------
# Through the launched app: hostile bodies refused within seconds, a normal request answered meanwhile
# ---------------------------------------------------------------------------------------------------------------

QS = {"late": {"type": "noul", "instructions": "Was the invoice paid late?"}}
HOSTILE_BODIES = {
    "5 MB state": ["word " * (1024 * 1024), QS],
    "3 MB instruction": ["The invoice was paid.", {"q": {"type": "noul", "instructions": "x " * (1536 * 1024)}}],
    "100,000-deep JSON text state": ["[" * 100_000 + "]" * 100_000, QS],
    "5,000-digit integer in the state's JSON text": ['{"n": ' + "9" * 5000 + "}", QS],
    "state of control characters": ["".join(map(chr, range(32))) * 8000, QS],
    "question type that is a list": ["x", {"q": {"type": ["noul"]}}],
}


def post_decide(url: str, body_text: str, timeout: float = 120) -> tuple[str, str]:
    """POST a raw /decide body through Gradio's HTTP API: ('queued', event id) once the server holds it, or its
    HTTP status and text when it is refused at the door."""
    r = httpx.post(
        url + "gradio_api/call/decide", content=body_text, headers={"content-type": "application/json"}, timeout=timeout
    )
    return ("queued", r.json()["event_id"]) if r.status_code == 200 else (str(r.status_code), r.text)


def read_result(url: str, event_id: str, timeout: float = 120) -> tuple[str, str]:
    """The outcome of a queued /decide call: ('complete' | 'error', data)."""
    with httpx.stream("GET", url + f"gradio_api/call/decide/{event_id}", timeout=timeout) as stream:
        lines = [line for line in stream.iter_lines() if line]
    kind = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("event:"))
    data = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("data:"))
    return kind, data


def call_decide(url: str, body_text: str) -> tuple[str, str]:
    """POST a raw /decide body and read its result: ('complete' | 'error' | HTTP status, data)."""
    kind, data = post_decide(url, body_text)
    return read_result(url, data) if kind == "queued" else (kind, data)


def body(state, questions) -> str:
    """A /decide request body: state, questions, temperature, model, prefer, images."""
    return json.dumps({"data": [state, questions, 1.0, "", "live", None]})


def test_a_normal_request_is_answered_while_hostile_bodies_are_held_in_their_checks(launched, monkeypatch):
    # Every hostile body that reaches blink is held inside its own parse (a gate in Deployment.request) until a normal
    # request sent after them all has been answered: it never waited for them. Then each is let go and refused.
    app, url = launched
    state = "The invoice was due on 1 May and paid on 30 June."
    bodies = {name: body(*args) for name, args in HOSTILE_BODIES.items()}
    door = body(None, QS).replace("null", "9" * 5000, 1)  # refused by Gradio's JSON reader, before blink sees it
    arrived, release = threading.Semaphore(0), threading.Event()
    real = app.DEPLOYMENT.request

    def gated(got_state, questions, **options):
        if got_state != state:  # a hostile body: held here, inside its own checks
            arrived.release()
            release.wait(300)
        return real(got_state, questions, **options)

    monkeypatch.setattr(app.DEPLOYMENT, "request", gated)
    with concurrent.futures.ThreadPoolExecutor(len(bodies) + 1) as pool:
        refusals = {name: pool.submit(call_decide, url, text) for name, text in bodies.items()}
        try:
            for _ in bodies:  # every hostile body is inside blink, held
                assert arrived.acquire(timeout=300)
            kind, data = call_decide(url, body(state, QS))
            assert kind == "complete", data
        finally:
            release.set()
        want = app.DEPLOYMENT.decide(state, QS)["answers"]["late"]["noul"]  # the same request, in process
        assert abs(json.loads(data)[0]["answers"]["late"]["noul"] - want) < 1e-5
        refusals["5,000-digit integer in the JSON body"] = pool.submit(call_decide, url, door)
        for name, future in refusals.items():
            kind, data = future.result()
            assert kind in ("error", "400"), f"{name}: {kind} {data[:200]}"
            if kind == "error":
                assert "Bad request" in data and "field:" in data, f"{name}: {data[:300]}"


def test_a_hostile_item_in_a_batch_is_refused_in_its_place(launched, client):
    app, _ = launched
    requests = [
        {"state": "Paid on time.", "questions": QS},
        {"state": '{"n": ' + "9" * 5000 + "}", "questions": QS},
        {"state": "x", "questions": {"q": {"type": {"type": "noul"}}}},
    ]
    out = client.predict(requests, 1.0, "", api_name="/decide_batch")
    want = app.DEPLOYMENT.decide("Paid on time.", QS)["answers"]["late"]["noul"]  # the good item, in process
    assert abs(out[0]["answers"]["late"]["noul"] - want) < 1e-5
    assert out[1]["loc"] == ["body", "requests", 1, "state"]
    assert out[2]["loc"] == ["body", "requests", 2, "questions", "q", "type"]
