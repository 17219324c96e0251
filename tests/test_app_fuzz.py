"""Property-based bad input over the launched app's API, through the real gradio_client: every case ends in a valid
answer or a refusal naming the field, never a crash, a 500 or a hang.

gradio_client raises AppError for both a gr.Error and a handler that crashed; they differ in what they carry. A
refusal keeps the app's title ("Bad request", "Busy") and message; a crash comes back titled "Error" with Gradio's
"has not enabled verbose error reporting" text, or with the app's own "the model failed on this request". So a
refusal here is an AppError titled "Bad request" whose message names the field.

Most cases run on the mock engine (fast, deterministic, so an answer can be checked against the same request
decided in process); a handful run on the live stand-in. gradio_client cannot send NaN, infinities or lone
surrogates (it encodes strict JSON), so those go in hand-written bodies to Gradio's REST route.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import httpx
import pytest
from conftest import serving
from gradio_client.exceptions import AppError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_fuzz import TRICKY, plausible

import blink

Q = {"q": {"type": "noul"}}
SERVED = blink.deployment().default_model  # the model the launched app serves (app.DEPLOYMENT is this deployment)
CRASH_MARKS = ("has not enabled verbose error reporting", "the model failed on this", "Traceback")
PNG_1PX = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="

# JSON the client can send: finite numbers, text without lone surrogates (hypothesis's default alphabet).
TEXT = st.one_of(st.text(max_size=40), TRICKY)
NUMBER = st.one_of(st.integers(-(10**6), 10**6), st.floats(allow_nan=False, allow_infinity=False))
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBER, TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=10,
)
DATA_URIS = [
    "data:image/png;base64,",
    "data:image/png;base64,!!!not base64",
    f"data:image/png;base64,{PNG_1PX}",
    f"data:image/jpeg;base64,{PNG_1PX}",
    "data:image/gif;base64,R0lGODlhAQABAAAAACw=",
    "data:image/png;charset=utf-8;base64,AAAA",
    "DATA:IMAGE/PNG ;BASE64,AAAA",
    "data:text/html;base64,PHNjcmlwdD4=",
    "data:image/png;base64," + "A" * 200_001,
    "data:image/png,plain",
    "data:image/",
]
DATA_URI = st.sampled_from(DATA_URIS)
DEEP_TEXT = st.sampled_from(["[" * 5000, "{" * 3000, '{"a": ' * 2000 + "1" + "}" * 2000, "[" * 63 + "]" * 63])
STATE = st.one_of(
    TEXT,
    st.text(min_size=1000, max_size=3000),
    JSON,
    JSON.map(json.dumps),
    DATA_URI,
    DEEP_TEXT,
    st.builds(lambda uri, note: f"{note} {uri} {note}", DATA_URI, TEXT),
    st.builds(lambda uri, note: {"chart": uri, "note": note}, DATA_URI, TEXT),
    st.sampled_from([None, 5, True, "", "   ", "x" * 100_000]),
)
N_OPTIONS = st.sampled_from([0, 1, 2, 255, 256, 300])
CRITERIA = st.one_of(
    JSON,
    st.lists(TEXT, max_size=12),
    st.dictionaries(TEXT, st.one_of(TEXT, st.none()), max_size=8),
    N_OPTIONS.map(lambda n: [f"o{i}" for i in range(n)]),
)
PLAUSIBLE = plausible(TEXT, JSON, levels=(1, 11))  # 1 and 11 score levels are refused
QUESTION = st.one_of(
    PLAUSIBLE,
    PLAUSIBLE,
    JSON,
    st.fixed_dictionaries(
        {"type": st.sampled_from(["choice", "noul", "score", "rank", None, 3])},
        optional={"criteria": CRITERIA, "instructions": st.one_of(TEXT, JSON)},
    ),
)
NAME = st.one_of(st.text(min_size=1, max_size=20), TRICKY)
PLAUSIBLE_QUESTIONS = st.dictionaries(NAME, PLAUSIBLE, min_size=1, max_size=4)
QUESTIONS_OBJECT = st.one_of(
    PLAUSIBLE_QUESTIONS,
    st.dictionaries(NAME, QUESTION, min_size=1, max_size=4),
    JSON,
    st.sampled_from([511, 512, 513]).map(lambda n: {f"q{i}": {"type": "noul"} for i in range(n)}),
)
QUESTIONS = st.one_of(
    PLAUSIBLE_QUESTIONS,
    PLAUSIBLE_QUESTIONS.map(json.dumps),
    QUESTIONS_OBJECT,
    QUESTIONS_OBJECT.map(json.dumps),
    QUESTIONS_OBJECT.map(lambda q: json.dumps(q)[:-1]),
    st.text(max_size=60),
    DEEP_TEXT,
    st.sampled_from(['{"q": {"type": "noul", "n": ' + "1" * 5000 + "}}", "", "null"]),
)
TEMPERATURE = st.one_of(
    st.floats(0.05, 5.0),
    NUMBER,
    st.integers(-3, 3),
    st.sampled_from(
        [
            0,
            -0.0,
            -1.5,
            5e-324,
            1e-310,
            1.7976931348623157e308,
            10**400,
            "nan",
            "inf",
            "-inf",
            "1e999",
            "0.7",
            "abc",
            "",
            None,
            True,
            False,
            [],
            {},
            [1.0],
        ]
    ),
)


def mostly(plain: st.SearchStrategy, odd: st.SearchStrategy) -> st.SearchStrategy:
    """Plain inputs most of the time and odd ones sometimes, so that a case often turns on one bad field (hypothesis
    draws a one_of's first and last branches most often)."""
    return st.one_of(plain, odd, plain, plain)


MODEL = mostly(st.just(""), st.one_of(st.sampled_from([None, "nobody/nothing", SERVED, 3, ["x"]]), TEXT))
PREFER = mostly(st.just("live"), st.sampled_from(["saved", "LIVE", "", None, 1, ["live"]]))
IMAGES = mostly(
    st.none(),
    st.one_of(
        st.just([]),
        st.lists(DATA_URI, min_size=1, max_size=3),
        JSON,
        st.lists(TEXT, min_size=1, max_size=2),
        st.just([f"data:image/png;base64,{PNG_1PX}"] * 9),
    ),
)
PLAIN_TEMPERATURE = mostly(st.floats(0.05, 5.0), TEMPERATURE)
BATCH = st.one_of(
    st.lists(
        st.one_of(
            st.fixed_dictionaries({"state": STATE, "questions": QUESTIONS}),
            st.fixed_dictionaries({"state": st.text(max_size=30), "questions": PLAUSIBLE.map(lambda q: {"q": q})}),
            JSON,
        ),
        max_size=6,
    ),
    JSON,
    st.text(max_size=40),
    DEEP_TEXT,
    st.sampled_from([65, 64]).map(lambda n: [{"state": f"s{i}", "questions": Q} for i in range(n)]),
)


def check_refusal(exc: AppError) -> str:
    """A refusal, not a crash: the app's own title and a message that names the field (or the whole request).
    Returns the top-level field it names."""
    message = exc.message or ""
    assert not any(mark in message for mark in CRASH_MARKS), message
    assert exc.title == "Bad request", (exc.title, message)
    field = re.search(r"\(field: ([^.)]+)", message)
    assert field or message.startswith("the request "), message
    return field.group(1) if field else "request"


def parsed(app, state, questions) -> tuple:
    """The request as the app reads it."""
    return blink.coerce_state(state), blink.coerce_questions(questions)


def check_answer(app, got: dict, state, questions, temperature) -> None:
    """A valid answer, exactly the one the same request gets when decided in process."""
    st_, qs = parsed(app, state, questions)
    assert list(got["answers"]) == list(qs)
    for qkey, q in qs.items():
        probs = got["answers"][qkey]["probabilities"]
        assert list(probs) == blink.parse_question(qkey, q).keys
        assert all(isinstance(p, float) and math.isfinite(p) for p in probs.values())
        if not q.get("multi"):  # a multi-label choice gives each option its own p(yes)
            assert math.isclose(sum(probs.values()), 1.0, abs_tol=1e-9)
    assert got["meta"]["generated_tokens"] == 0
    if got["meta"]["engine"] == "mock":
        want = app.DEPLOYMENT.decide(st_, qs, blink.check_temperature(temperature))["answers"]
        assert json.loads(json.dumps(want)) == got["answers"]


def check_batch(app, got, requests, temperature) -> None:
    """One item per request in order: a valid answer, or {error, loc} naming that request and its field."""
    if isinstance(requests, str):
        requests = json.loads(requests)
    assert isinstance(got, list) and len(got) == len(requests)
    for i, (item, req) in enumerate(zip(got, requests)):
        if "error" in item:
            assert item["loc"][:3] == ["body", "requests", i], item
            assert f"(field: requests.{i}" in item["error"] and not any(m in item["error"] for m in CRASH_MARKS)
        else:
            check_answer(app, item, req["state"], req["questions"], temperature)


@pytest.fixture()
def mock_app(launched, client):
    """The launched app serving the mock engine for the default model, and a client."""
    app = launched[0]
    assert app.DEPLOYMENT.default_model == SERVED
    with serving(app, blink.MockEngine(app.DEPLOYMENT.default_model, app.SETTINGS)):
        yield app, client


def run_decide(app, client, counts: Counter, args: tuple) -> None:
    """One /decide case: count it and check what came back."""
    state, questions, temperature, model, prefer, images = args
    try:
        got = client.submit(*args, api_name="/decide").result(timeout=120)
    except AppError as exc:
        counts[f"field {check_refusal(exc)}"] += 1
        counts["refused"] += 1
        return
    served = model is None or (isinstance(model, str) and (not model.strip() or model == app.DEPLOYMENT.default_model))
    assert served and prefer in ("live", "saved") and images in (None, [])
    check_answer(app, got, state, questions, temperature)
    counts["answered"] += 1


def report(endpoint: str, engine: str, counts: Counter) -> None:
    """Print how many cases ran and how they ended; both endings must have happened."""
    print(
        f"\n{endpoint} on the {engine} engine: {counts['answered'] + counts['refused']} cases, "
        f"{counts['answered']} answered, {counts['refused']} refused with the field named"
        + (f" ({counts['items']} batch items)" if counts["items"] else "")
        + " · refused on: "
        + ", ".join(f"{k[6:]} {v}" for k, v in sorted(counts.items()) if k.startswith("field "))
    )
    assert counts["answered"] and counts["refused"]


def case_of(state="x", questions=None, temperature=1.0, images=None):
    """An explicit /decide case, the other inputs plain."""
    return example(
        state=state,
        questions=Q if questions is None else questions,
        temperature=temperature,
        model="",
        prefer="live",
        images=images,
    )


def test_decide_api_on_arbitrary_input(mock_app):
    app, client = mock_app
    counts: Counter = Counter()

    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(state=STATE, questions=QUESTIONS, temperature=PLAIN_TEMPERATURE, model=MODEL, prefer=PREFER, images=IMAGES)
    @case_of(state="x" * (app.SETTINGS.max_request_chars + 1))
    @case_of(questions={f"q{i}": {"type": "noul"} for i in range(513)})
    @case_of(questions={"q": {"type": "choice", "criteria": [f"o{i}" for i in range(256)]}})
    @case_of(questions={"q": {"type": "choice", "criteria": []}})
    @case_of(questions="[" * 5000)
    @case_of(temperature=5e-324)
    @case_of(temperature=10**400)
    @case_of(temperature="nan")
    @case_of(state="İstanbul Straße ﬁ " * 50, temperature=-1.0)
    @case_of(state={"chart": "data:image/png;charset=utf-8;base64,AAAA"})
    @case_of(images=["data:image/png;base64," + "A" * 200_001])
    def case(state, questions, temperature, model, prefer, images):
        run_decide(app, client, counts, (state, questions, temperature, model, prefer, images))

    case()
    report("/decide", "mock", counts)


# Small enough for the stand-in to answer in a second or two on a CPU.
LIVE_PLAUSIBLE = st.dictionaries(NAME, PLAUSIBLE, min_size=1, max_size=2)
LIVE_STATE = st.one_of(TEXT, JSON.map(json.dumps), st.sampled_from([u for u in DATA_URIS if len(u) < 1000]))
LIVE_QUESTIONS = st.one_of(LIVE_PLAUSIBLE, LIVE_PLAUSIBLE.map(json.dumps), st.text(max_size=30), DEEP_TEXT)


def test_decide_api_on_the_live_model(launched, client):
    counts: Counter = Counter()

    @settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(state=LIVE_STATE, questions=LIVE_QUESTIONS, temperature=PLAIN_TEMPERATURE)
    @example(
        state="Order 17 arrived broken.",
        questions={"ok": {"type": "noul"}, "size": {"type": "score", "criteria": ["small", "large"]}},
        temperature=0.7,
    )
    @example(state="Order 17 arrived broken.", questions={"size": {"type": "score"}}, temperature=0.7)
    def case(state, questions, temperature):
        run_decide(launched[0], client, counts, (state, questions, temperature, "", "live", None))

    case()
    report("/decide", "live stand-in", counts)


def test_decide_batch_api_on_arbitrary_input(mock_app):
    app, client = mock_app
    counts: Counter = Counter()

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(requests=BATCH, temperature=PLAIN_TEMPERATURE, model=MODEL)
    @example(
        requests=[
            {"state": {"a": [[[[[[]]]]]] * 2}, "questions": Q},
            {"state": "x", "questions": "[" * 5000},
            {"state": "ok", "questions": Q},
        ],
        temperature=1.0,
        model="",
    )
    @example(requests="[" * 5000, temperature=1.0, model="")
    def case(requests, temperature, model):
        try:
            got = client.submit(requests, temperature, model, api_name="/decide_batch").result(timeout=120)
        except AppError as exc:
            counts[f"field {check_refusal(exc)}"] += 1
            counts["refused"] += 1
            return
        check_batch(app, got, requests, temperature)
        counts["answered"] += 1
        counts["items"] += len(got)

    case()
    report("/decide_batch", "mock", counts)


# ------------------------------------------------------------------------------------------------------------------
# Bodies gradio_client cannot write: NaN and infinities, lone surrogates, over-long integers, smuggled file references
# ------------------------------------------------------------------------------------------------------------------

# Gradio's REST route fills in no defaults (gradio_client does): every body carries all six inputs.
RAW = [
    (b'["x", {"q": {"type": "noul"}}, NaN, "", "live", null]', "temperature must be a finite number above 0"),
    (b'["x", {"q": {"type": "noul"}}, -Infinity, "", "live", null]', "temperature must be a finite number above 0"),
    (b'["x", {"q": {"type": "noul"}}, 1e999, "", "live", null]', "temperature must be a finite number above 0"),
    (b'["a\\ud800b", {"q": {"type": "noul"}}, 1.0, "", "live", null]', "state is not valid Unicode text"),
    (b'["x", {"q\\udfff": {"type": "noul"}}, 1.0, "", "live", null]', "questions has a non-text key"),
    (
        b'["x", "{\\"q\\": {\\"type\\": \\"noul\\", \\"n\\": ' + b"1" * 5000 + b'}}", 1.0, "", "live", null]',
        "questions cannot be read",
    ),
]


def raw_decide(url: str, data: bytes) -> tuple[int, dict | str]:
    """A hand-written `data` array POSTed to /gradio_api/call/decide: (HTTP status, the final event's payload)."""
    with httpx.Client(base_url=url, timeout=60) as http:
        posted = http.post(
            "gradio_api/call/decide", content=b'{"data": ' + data + b"}", headers={"content-type": "application/json"}
        )
        if posted.status_code != 200:
            return posted.status_code, posted.text
        events = http.get(f"gradio_api/call/decide/{posted.json()['event_id']}").text
    last = [line for line in events.splitlines() if line.startswith("data:")][-1]
    return 200, json.loads(last[5:])


@pytest.mark.parametrize("data,message", RAW, ids=[m for _, m in RAW])
def test_bodies_the_client_cannot_send_are_refused_clearly(mock_app, launched, data, message):
    status, payload = raw_decide(launched[1], data)
    assert status == 200 and payload.get("title") == "Bad request", payload
    assert message in payload["error"] and "(field: " in payload["error"]


def test_malformed_bodies_are_4xx_and_files_are_never_read(mock_app, launched):
    url = launched[1]
    assert raw_decide(url, b'["x", ' + b"1" * 5000 + b"]")[0] == 400  # an integer Python will not convert
    assert raw_decide(url, b'["x", {"q": ')[0] in (400, 422)  # not JSON
    smuggled = (
        b'[{"path": "/etc/passwd", "meta": {"_type": "gradio.FileData"}}, {"q": {"type": "noul"}}, 1.0, "", '
        b'"live", null]'
    )
    status, payload = raw_decide(url, smuggled)  # Gradio only moves files it received as uploads
    assert status == 200 and "answers" not in payload and "root:" not in json.dumps(payload)
