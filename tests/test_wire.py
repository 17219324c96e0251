"""The wire protocols through the launched app, with the real clients: typesafe-sdk on /v1/systemone and /v1/models,
openai's decisions.create on /v1/decisions, an MCP client on Gradio's MCP server, and raw HTTP for every error class,
the body limit, the API key and a full queue.

Live tests run on the stand-in and compare each answer with the same request decided in process by the same engine;
the rest run on the mock engine (fabricated numbers, labelled so in x_meta)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import threading

import httpx
import pytest
from conftest import app_process, serving, wait_until
from openai import OpenAI
from PIL import Image as PILImage
from typesafe_sdk import (
    Choice,
    Image,
    Noul,
    RetryPolicy,
    Score,
    TypeSafeAuthenticationError,
    TypeSafeBadRequestError,
    TypeSafeClient,
    TypeSafeNotFoundError,
    TypeSafeUnprocessableEntityError,
)

import blink
from adapters import wire

KEY = "wire-test-key-7f3a9c"  # the guarded app's BLINK_API_KEY: it must never come back out
TICKET = {
    "message": "I was charged twice for March and now nobody on the team can log in. Please fix this ASAP.",
    "plan": "team",
    "seats": 12,
}
# Over 1 KiB as JSON: typesafe-sdk sends such a body zstd-compressed (with zstd available, as here)
THREAD = {
    **TICKET,
    "history": [f"2026-03-{d:02d}: customer wrote again about the double charge and the lockout" for d in range(1, 15)],
}


def png(rgb=(200, 30, 30), size=(96, 64)) -> bytes:
    """A small one-color PNG."""
    out = io.BytesIO()
    PILImage.new("RGB", size, rgb).save(out, format="PNG")
    return out.getvalue()


def systemone_client(url: str, key: str = "any-key", **options) -> TypeSafeClient:
    """typesafe-sdk pointed at a launched app (its base URL is the server root), retries off unless asked."""
    options.setdefault("retry", RetryPolicy(max_retries=0))
    return TypeSafeClient(api_key=key, base_url=url.rstrip("/"), timeout=120, **options)


def openai_client(url: str, key: str = "any-key") -> OpenAI:
    """openai pointed at a launched app (its base URL ends in /v1)."""
    return OpenAI(base_url=url.rstrip("/") + "/v1", api_key=key, max_retries=0, timeout=120)


def choice_confidence(probs: list[float]) -> float:
    """TypeSafe's choice confidence: (p_max - 1/n) / (1 - 1/n)."""
    n = len(probs)
    return (max(probs) - 1 / n) / (1 - 1 / n)


def score_confidence(probs: list[float]) -> float:
    """TypeSafe's score confidence: max(0, 1 - sum p_i |i - mode| / (sum_i |i - (n-1)/2| / n))."""
    n = len(probs)
    mode = probs.index(max(probs))
    spread = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return max(0.0, 1 - sum(p * abs(i - mode) for i, p in enumerate(probs)) / spread)


def close(a: float, b: float, tol: float = 1e-5) -> bool:
    """Two probabilities equal within the tolerance of packed vs alone forwards."""
    return math.isclose(a, b, abs_tol=tol)


@pytest.fixture()
def mock_app(launched):
    """The launched app answering with the mock engine; yields (app, url)."""
    app, url = launched
    with serving(app, blink.MockEngine(app.DEPLOYMENT.default_model, app.SETTINGS)):
        yield app, url


# ------------------------------------------------------------------------------------------------------------------
# typesafe-sdk on /v1/systemone
# ------------------------------------------------------------------------------------------------------------------

STRUCTURED = {
    "blocked": Noul(
        instructions={"task": "Is the customer blocked right now?", "field": "`message`"},
        criteria={"true": "they cannot use the product at all"},
    ),  # one-sided: only what counts as yes
    "legit": Noul(criteria={"false": "spam or a test message"}),  # one-sided the other way, no instructions
    "queue": Choice(
        instructions="Which team should take this ticket?",
        criteria={
            "billing": "payments, refunds, invoices",
            "access": {"covers": ["login", "SSO"]},
            "bug": ["crashes", "errors"],
            "other": None,
        },
    ),
    "urgency": Score(
        instructions=["How urgent is this?", {"scale": "0 = can wait, 2 = now"}],
        criteria=["can wait", {"when": "this week"}, ["today", "now"]],
    ),
}


def test_every_question_type_through_typesafe_sdk_on_the_live_model(launched):
    app, url = launched
    sent = []
    import httpx2

    hooks = {"request": [lambda request: sent.append(dict(request.headers))]}
    with systemone_client(url, http_client=httpx2.Client(timeout=120, event_hooks=hooks)) as ts:
        r = ts.system_one(state=THREAD, questions=STRUCTURED)  # model: the SDK's default, jev-latest
    assert sent[0]["content-encoding"] == "zstd"  # the SDK compresses a body of 1 KiB or more: decoded here
    assert r.model == app.DEPLOYMENT.default_model and r.request_id.startswith("req_")
    assert r.usage.output_tokens == 0 and isinstance(r.usage.input_tokens, int) and r.usage.input_tokens > 0
    assert set(r.answers) == set(STRUCTURED)
    questions = {k: q.model_dump(exclude_none=True) for k, q in STRUCTURED.items()}
    want = app.DEPLOYMENT.decide(THREAD, questions)["answers"]  # the same request, in process, same engine
    for key in ("blocked", "legit"):
        assert close(r.nouls[key].noul, want[key]["probabilities"]["yes"])
    queue = r.choices["queue"]
    probs = [want["queue"]["probabilities"][k] for k in questions["queue"]["criteria"]]
    assert list(queue.probabilities) == list(questions["queue"]["criteria"])
    assert all(close(queue.probabilities[k], want["queue"]["probabilities"][k]) for k in queue.probabilities)
    assert queue.choice == want["queue"]["choice"] and close(queue.confidence, choice_confidence(probs))
    urgency = r.scores["urgency"]
    levels = [want["urgency"]["probabilities"][str(i)] for i in range(3)]
    assert urgency.legend == {0: "can wait", 1: {"when": "this week"}, 2: ["today", "now"]}  # echoed as sent
    assert [urgency.probabilities[i] for i in range(3)] == pytest.approx(levels, abs=1e-5)
    assert close(urgency.score, sum(i * p for i, p in enumerate(levels)))
    assert close(urgency.confidence, score_confidence(levels))
    body = r.raw_http_response.json()
    extras = body["x_meta"]["answers"]  # blink's additions: one place, keyed by question
    assert extras.keys() == body["answers"].keys() and all(0 < extras[k]["label_mass"] <= 1 for k in extras)
    standard = {"noul": {"type", "noul"}, "choice": {"type", "choice", "confidence", "probabilities"}}
    standard["score"] = standard["choice"] - {"choice"} | {"score", "legend"}
    assert all(a.keys() == standard[a["type"]] for a in body["answers"].values())  # the standard fields only


def test_255_options_and_unicode_ids(mock_app):
    """On the mock engine: 255 described options render to about 7,000 tokens, minutes on the stand-in here."""
    app, url = mock_app
    options = {f"opción {i} ✓": (f"descripción {i}" if i % 3 else None) for i in range(255)}
    questions = {
        "分類 🙂": {"type": "choice", "instructions": "¿Cuál encaja?", "criteria": options},
        "ключ": {"type": "noul", "instructions": "Это срочно?"},
    }
    state = "Straße İstanbul — 付款两次"
    with systemone_client(url) as ts:
        r = ts.system_one(state=state, questions=questions, model=app.DEPLOYMENT.default_model)
    want = app.DEPLOYMENT.decide(state, questions)["answers"]
    assert set(r.answers) == set(questions)
    got = r.choices["分類 🙂"]
    assert list(got.probabilities) == list(options) and math.isclose(sum(got.probabilities.values()), 1, abs_tol=1e-9)
    assert got.choice == want["分類 🙂"]["choice"] and got.probabilities == want["分類 🙂"]["probabilities"]
    assert r.nouls["ключ"].noul == want["ключ"]["probabilities"]["yes"]


def test_renaming_adding_and_reordering_questions_leaves_each_answer_unchanged(launched):
    _, url = launched
    a = {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "payments", "access": "logins"}}
    b = {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high"]}
    c = {"type": "noul", "instructions": "Is the customer angry?"}
    variants = {
        "base": {"a": a, "b": b},
        "renamed": {"team ✓": a, "how urgent": b},
        "added": {"a": a, "x": c, "b": b},
        "reordered": {"b": b, "a": a},
    }
    with systemone_client(url, compression=False) as ts:
        got = {
            name: ts.system_one(state=TICKET, questions=qs).raw_http_response.json()["answers"]
            for name, qs in variants.items()
        }
    for name, answers in got.items():
        team, urgency = ("team ✓", "how urgent") if name == "renamed" else ("a", "b")
        for mine, base in ((answers[team], got["base"]["a"]), (answers[urgency], got["base"]["b"])):
            assert mine["type"] == base["type"] and mine.get("choice") == base.get("choice")
            assert mine["probabilities"].keys() == base["probabilities"].keys()
            assert all(close(mine["probabilities"][k], base["probabilities"][k]) for k in base["probabilities"])
            assert close(mine["confidence"], base["confidence"])


def test_multi_permute_and_abstain_keep_the_standard_fields(mock_app):
    app, url = mock_app
    options = {"billing": None, "access": None, "bug": None}
    questions = {
        "apply": {"type": "choice", "criteria": options, "multi": True},  # blink's opt-in features, as
        "team": {"type": "choice", "criteria": options, "permute": 3},  # dict questions the SDK sends
        "sure": {"type": "noul", "instructions": "Sure?", "abstain": {"min_confidence": 1.0}},
        "level": {"type": "score", "criteria": ["low", "high"], "abstain": {"min_label_mass": 1.0}},
    }
    with systemone_client(url) as ts:
        r = ts.system_one(state=TICKET, questions=questions)
    assert set(r.answers) == set(questions)  # none dropped by the SDK: each parses as its standard type
    raw = r.raw_http_response.json()
    want = app.DEPLOYMENT.decide(TICKET, questions)["answers"]
    apply, extras = raw["answers"]["apply"], raw["x_meta"]["answers"]
    assert extras["apply"]["multi"] is True and extras["apply"]["p_yes"] == want["apply"]["probabilities"]
    assert extras["apply"]["choices"] == want["apply"]["choices"] and math.isclose(
        sum(apply["probabilities"].values()), 1
    )
    assert apply["choice"] == max(extras["apply"]["p_yes"], key=extras["apply"]["p_yes"].get)
    assert extras["team"]["rotations"] == 3 and len(extras["team"]["rotation_choices"]) == 3
    for key in ("sure", "level"):
        assert extras[key]["abstained"] is True and extras[key]["reason"]
    assert not any(k.startswith("x_") for a in raw["answers"].values() for k in a)
    assert r.nouls["sure"].noul == want["sure"]["probabilities"]["yes"]  # abstained, yet the number is there
    assert raw["x_meta"]["fabricated"] is True and "fabricated" in raw["x_meta"]["notice"]


def test_models_list_through_typesafe_sdk(launched):
    app, url = launched
    with systemone_client(url) as ts:
        listing = ts.models.list()
    names = [m.name for m in listing.models]
    assert names == [*app.DEPLOYMENT.models(), "jev-latest"]
    assert all(len(m.release_date) == 10 and m.release_date[4] == "-" for m in listing.models)  # the weights' date


def test_text_only_model_refuses_an_asset_naming_it(launched):
    _, url = launched
    with systemone_client(url) as ts, pytest.raises(TypeSafeUnprocessableEntityError) as caught:
        ts.system_one(state={"chart": Image(png())}, questions={"red": Noul(instructions="Is the chart red?")})
    assert caught.value.status == 422 and "reads text only" in str(caught.value)
    assert caught.value.body["detail"][0]["loc"][:2] == ["body", "assets"]  # the SDK's <image:...> placeholder


def test_sdk_errors_name_the_field(mock_app):
    _, url = mock_app
    with systemone_client(url) as ts:
        with pytest.raises(TypeSafeNotFoundError, match="not served here; this deployment serves"):
            ts.system_one(state="x", questions={"q": Noul(instructions="?")}, model="jev-1.13.0")
        with pytest.raises(TypeSafeUnprocessableEntityError, match=r"questions\.q\.criteria: .*2 to 10 levels"):
            ts.system_one(state="x", questions={"q": Score(criteria=["only one"])})
        with pytest.raises(TypeSafeBadRequestError, match="box questions .* are not supported"):
            ts.system_one(state="x", questions={"where": {"type": "box", "instructions": "the logo"}})


# ------------------------------------------------------------------------------------------------------------------
# openai decisions.create on /v1/decisions
# ------------------------------------------------------------------------------------------------------------------


def test_three_question_types_through_openai_decisions(launched):
    app, url = launched
    questions = [
        {"type": "predicate", "name": "blocked", "instructions": "The customer cannot use the product right now."},
        {
            "type": "choice",
            "name": "queue",
            "instructions": "Which team should take this?",
            "choices": [
                {"value": "billing", "description": "payments and refunds"},
                {"value": "access"},
                {"value": True, "description": "any other team"},
            ],
        },
        {
            "type": "score",
            "instructions": [{"type": "input_text", "text": "How urgent is this?"}],
            "levels": [{"label": "low", "description": "can wait"}, {"label": "medium"}, {"label": "high"}],
        },
    ]
    message = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": TICKET["message"]},
                {"type": "input_json", "data": {"plan": "team", "seats": 12}},
            ],
        }
    ]
    d = openai_client(url).decisions.create(model=app.DEPLOYMENT.default_model, input=message, questions=questions)
    assert d.model == app.DEPLOYMENT.default_model
    assert [a.type for a in d.answers] == ["predicate", "choice", "score"]
    assert [a.name for a in d.answers] == ["blocked", "queue", None]
    assert d.usage.output_tokens == 0 and d.usage.total_tokens == d.usage.input_tokens > 0
    blink_questions = {
        "0": {"type": "noul", "instructions": questions[0]["instructions"]},
        "1": {
            "type": "choice",
            "instructions": questions[1]["instructions"],
            "criteria": {"billing": "payments and refunds", "access": None, "true": "any other team"},
        },
        "2": {"type": "score", "instructions": "How urgent is this?", "criteria": ["low: can wait", "medium", "high"]},
    }
    state = [TICKET["message"], {"plan": "team", "seats": 12}]
    want = app.DEPLOYMENT.decide(state, blink_questions)["answers"]
    blocked, queue, urgency = d.answers
    assert close(blocked.probability, want["0"]["probabilities"]["yes"])
    assert [p.value for p in queue.probabilities] == ["billing", "access", True]  # a boolean value stays one
    probs = [p.probability for p in queue.probabilities]
    assert probs == pytest.approx([want["1"]["probabilities"][k] for k in ("billing", "access", "true")], abs=1e-5)
    assert queue.choice == ["billing", "access", True][probs.index(max(probs))]
    assert close(queue.confidence, choice_confidence(probs))
    levels = [p.probability for p in urgency.probabilities]
    assert [(p.value, p.label) for p in urgency.probabilities] == [(0, "low"), (1, "medium"), (2, "high")]
    assert levels == pytest.approx([want["2"]["probabilities"][str(i)] for i in range(3)], abs=1e-5)
    assert close(urgency.score, sum(i * p for i, p in enumerate(levels)))
    assert close(urgency.confidence, score_confidence(levels))
    extras = d.to_dict()["x_meta"]["answers"]  # blink's additions, keyed by each question's position
    assert all(close(extras[k]["label_mass"], want[k]["label_mass"]) for k in want) and extras.keys() == want.keys()


def test_decisions_errors_in_openai_shape(mock_app):
    import openai

    _, url = mock_app
    client = openai_client(url)
    with pytest.raises(openai.NotFoundError) as caught:
        client.decisions.create(model="gpt-6-luna", input="x", questions=[{"type": "predicate", "instructions": "?"}])
    assert caught.value.code == "model_not_found" and caught.value.param == "model"
    with pytest.raises(openai.BadRequestError) as caught:
        client.decisions.create(
            model="jev-latest",
            input="x",
            questions=[{"type": "choice", "instructions": "?", "choices": [{"value": "a"}, {"value": "a"}]}],
        )
    assert caught.value.param == "questions[0].choices[1].value" and "offered twice" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.decisions.create(
            model="jev-latest",
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/cat.png"}]}],
            questions=[{"type": "predicate", "instructions": "?"}],
        )
    assert caught.value.code == "unsupported_image_url" and "data URL" in caught.value.message


# ------------------------------------------------------------------------------------------------------------------
# Raw HTTP: every error class
# ------------------------------------------------------------------------------------------------------------------

GOOD = {"model": "jev-latest", "state": "x", "questions": {"q": {"type": "noul"}}}


def post(url: str, route: str, **kwargs) -> httpx.Response:
    """One POST to a wire route."""
    return httpx.post(url.rstrip("/") + route, timeout=60, **kwargs)


def test_the_app_serves_the_batch_route_and_the_openapi_document(mock_app):
    """app.py's Gradio app serves laya-serve's batch route and the /v1 routes' OpenAPI document at /openapi.json
    (where Gradio's FastAPI app would serve its own); tests/test_field_routes.py checks both in depth."""
    _, url = mock_app
    states = [TICKET, "Lunch at noon?"]
    r = post(url, "/v1/systemone/batch", json={"states": states, "questions": {"spam": {"type": "noul"}}})
    assert r.status_code == 200, r.text
    singles = [
        post(url, "/v1/systemone", json={**GOOD, "state": s, "questions": {"spam": {"type": "noul"}}}).json()
        for s in states
    ]
    assert [x["answers"] for x in r.json()["results"]] == [x["answers"] for x in singles]
    document = httpx.get(url.rstrip("/") + "/openapi.json", timeout=60).json()
    assert document["openapi"] == "3.1.0" and "/v1/systemone/batch" in document["paths"]


@pytest.mark.parametrize(
    "body,loc,kind",
    [
        ({"state": "x", "questions": {"q": {"type": "noul"}}}, ["body", "model"], "missing"),
        ({**GOOD, "state": 5}, ["body", "state"], "type_error"),
        ({**GOOD, "questions": {}}, ["body", "questions"], "too_short"),
        ({**GOOD, "questions": {"q": {"type": "rank"}}}, ["body", "questions", "q", "type"], "union_tag_invalid"),
        ({**GOOD, "questions": {"q": {"type": "choice"}}}, ["body", "questions", "q", "criteria"], "missing"),
        (
            {**GOOD, "questions": {"q": {"type": "score", "criteria": ["a", None]}}},
            ["body", "questions", "q", "criteria", 1],
            "type_error",
        ),
        (
            {**GOOD, "questions": {"q": {"type": "noul", "criteria": {"true": 3}}}},
            ["body", "questions", "q", "criteria", "true"],
            "type_error",
        ),
        (
            {**GOOD, "questions": {"q": {"type": "choice", "criteria": {f"o{i}": None for i in range(256)}}}},
            ["body", "questions", "q", "criteria"],
            "value_error",
        ),
        ({**GOOD, "state": "a\ud800b"}, ["body", "state"], "value_error"),
        ({**GOOD, "assets": {}}, ["body", "assets"], "too_short"),
        ([GOOD], ["body"], "type_error"),
    ],
)
def test_validation_errors_are_422_with_the_field(mock_app, body, loc, kind):
    _, url = mock_app
    r = post(url, "/v1/systemone", content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    (detail,) = r.json()["detail"]
    assert detail["loc"] == loc and detail["type"] == kind and detail["msg"], detail
    assert r.headers["x-typesafe-request-id"].startswith("req_")


@pytest.mark.parametrize(
    "content,headers,status,kind",
    [
        (b'{"model": "jev-latest", "state": "x", "questions": {"q": {"type": "noul"}}', {}, 422, "json_invalid"),
        (b'{"model": "jev-latest", "state": NaN, "questions": {"q": {"type": "noul"}}}', {}, 422, "json_invalid"),
        (b"[" * 100_000, {}, 422, "json_invalid"),
        (b'{"model": 1' + b"0" * 5000 + b"}", {}, 422, "json_invalid"),
        (b"\xff\xfe{}", {}, 422, "json_invalid"),
        (json.dumps(GOOD).encode(), {"content-type": "text/xml"}, 415, "unsupported_media_type"),
        (json.dumps(GOOD).encode(), {"content-encoding": "gzip"}, 415, "unsupported_media_type"),
        (b"\x28\xb5\x2f\xfd garbage", {"content-encoding": "zstd"}, 400, "invalid_request"),
        (
            b'--x\r\nContent-Disposition: form-data; name="other"\r\n\r\nhi\r\n--x--\r\n',
            {"content-type": "multipart/form-data; boundary=x"},
            422,
            "missing",
        ),
        (
            json.dumps({**GOOD, "questions": {"q": {"type": "box", "instructions": "the logo"}}}).encode(),
            {},
            400,
            "unsupported_question_type",
        ),
        (json.dumps({**GOOD, "model": "jev-9"}).encode(), {}, 404, "model_not_found"),
    ],
)
def test_other_errors_are_4xx_in_system_one_shape(mock_app, content, headers, status, kind):
    _, url = mock_app
    r = post(url, "/v1/systemone", content=content, headers={"content-type": "application/json", **headers})
    assert r.status_code == status, r.text
    detail = r.json()["detail"]
    got = detail[0]["type"] if isinstance(detail, list) else detail["error_type"]
    assert got == kind and (isinstance(detail, list) or detail["message"]), detail


def test_json_assets_and_multipart_parts_are_checked(mock_app):
    app, url = mock_app
    reader = blink.MockEngine(app.DEPLOYMENT.default_model, app.SETTINGS)
    reader.reads_images = True  # the mock stands in for a vision model here: what is checked is the assets
    with serving(app, reader):
        cases = [
            ({"a": {"type": "image", "data_base64": "!!"}}, ["body", "assets", "a", "data_base64"]),
            (
                {"a": {"type": "image", "data_base64": base64.b64encode(b"GIF89a....").decode()}},
                ["body", "assets", "a"],
            ),
            ({"a": {"type": "video", "data_base64": "AAAA"}}, ["body", "assets", "a", "type"]),
            ({"a": {"type": "image", "part": "asset-0"}}, ["body", "assets", "a", "part"]),
            ({"a": {"type": "image"}}, ["body", "assets", "a", "data_base64"]),
            ({"": {"type": "image", "data_base64": base64.b64encode(png()).decode()}}, ["body", "assets", ""]),
        ]
        for assets, loc in cases:
            r = post(url, "/v1/systemone", json={**GOOD, "state": "see a", "assets": assets})
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == loc, (assets, r.text)
        ok = post(
            url,
            "/v1/systemone",
            json={
                **GOOD,
                "state": "see a",
                "assets": {"a": {"type": "image", "format": "png", "data_base64": base64.b64encode(png()).decode()}},
            },
        )
        assert ok.status_code == 200, ok.text
        unclaimed = post(
            url,
            "/v1/systemone",
            files={
                "request": (
                    None,
                    json.dumps({**GOOD, "state": "see a", "assets": {"a": {"type": "image", "part": "asset-0"}}}),
                    "application/json",
                ),
                "asset-0": ("asset-0", png(), "image/png"),
                "asset-1": ("asset-1", png(), "image/png"),
            },
        )
        assert unclaimed.status_code == 422 and "claimed by no asset" in unclaimed.text


def test_placeholders_become_images_where_they_stand(mock_app):
    state, questions, listed = wire.place_assets(
        {"before": "data:image/png;base64,AAAA", "chart": "see <img:a> and <img:b>"},
        {"q": {"type": "choice", "instructions": "Compare <img:b> with <img:c>", "criteria": {"<img:a>": "<img:a>"}}},
        {
            "<img:a>": "data:image/png;base64,QQ==",
            "<img:b>": "data:image/png;base64,Qg==",
            "<img:c>": "data:image/png;base64,Qw==",
        },
    )
    assert state == {
        "before": "data:image/png;base64,AAAA",
        "chart": "see data:image/png;base64,QQ== and data:image/png;base64,Qg==",
    }
    assert questions["q"]["instructions"] == "Compare [image 3] with [image 4]"  # the state's own image is [image 1]
    assert questions["q"]["criteria"] == {"<img:a>": "[image 2]"}  # option names stay as sent
    assert listed == ["data:image/png;base64,Qw=="]


# ------------------------------------------------------------------------------------------------------------------
# A guarded deployment: API key, small body limit
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """The app in its own process with BLINK_API_KEY set and a 64 KiB body limit, on the mock engine; yields
    (url, log path)."""
    env = {"BLINK_MOCK": "1", "BLINK_API_KEY": KEY, "BLINK_MAX_BODY_BYTES": "65536"}
    with app_process(env, tmp_dir=str(tmp_path_factory.mktemp("guarded"))) as served_app:
        yield served_app


def test_api_key_is_required_when_set(guarded):
    url, log_path = guarded
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"}, {"authorization": KEY}):
        r = post(url, "/v1/systemone", json=GOOD, headers=headers)
        assert r.status_code == 401 and r.json()["detail"]["error_type"] == "authentication_error", r.text
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "v1/models").status_code == 401
    d = post(url, "/v1/decisions", json={"model": "jev-latest", "input": "x", "questions": []})
    assert d.status_code == 401 and d.json()["error"]["type"] == "authentication_error"
    with systemone_client(url, key="wrong") as ts, pytest.raises(TypeSafeAuthenticationError):
        ts.system_one(state="x", questions={"q": Noul(instructions="?")})
    with systemone_client(url, key=KEY) as ts:
        r = ts.system_one(state="x", questions={"q": Noul(instructions="?")})
        assert r.raw_http_response.json()["x_meta"]["fabricated"] is True
        assert ts.models.list().models
    d = openai_client(url, KEY).decisions.create(
        model="jev-latest", input="x", questions=[{"type": "predicate", "instructions": "?"}]
    )
    assert d.answers[0].type == "predicate"
    # the key never comes back out: not in replies, the page, /config, /info or the server log
    seen = [
        post(url, "/v1/systemone", json=GOOD).text,
        httpx.get(url).text,
        httpx.get(url + "config").text,
        httpx.get(url + "gradio_api/info").text,
    ]
    from gradio_client import Client

    keyed = Client(url, verbose=False, headers={"authorization": f"Bearer {KEY}"})  # Gradio's API needs it too
    seen.append(json.dumps(keyed.predict(api_name="/info")))
    seen.append(open(log_path).read())
    assert not any(KEY in text for text in seen)


def test_the_key_is_left_out_of_the_settings_printed_form():
    from adapters.http import ServerSettings

    settings = ServerSettings.from_env({"BLINK_API_KEY": KEY})
    assert settings.api_key == KEY and KEY not in repr(settings) and KEY not in str(settings)


def test_without_a_key_any_authorization_is_accepted(mock_app):
    _, url = mock_app
    for headers in ({}, {"authorization": "Bearer anything"}, {"authorization": "Basic xyz"}):
        assert post(url, "/v1/systemone", json=GOOD, headers=headers).status_code == 200


def test_an_oversized_body_is_refused_before_it_is_read(guarded):
    url, _ = guarded
    auth = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    big = json.dumps({**GOOD, "state": "x" * 70_000}).encode()
    declared = post(url, "/v1/systemone", content=big, headers=auth)
    assert declared.status_code == 413 and declared.json()["detail"]["error_type"] == "request_too_large"

    def chunks():  # no Content-Length: the body arrives chunked and is counted as it comes
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    chunked = post(url, "/v1/systemone", content=chunks(), headers=auth)
    assert chunked.status_code == 413
    zstd = wire.zstd_module()
    bomb = zstd.compress(json.dumps({**GOOD, "state": "x" * 5_000_000}).encode())
    assert len(bomb) < 65536
    inflated = post(url, "/v1/systemone", content=bomb, headers={**auth, "content-encoding": "zstd"})
    assert inflated.status_code == 413 and "decompressed" in inflated.json()["detail"]["message"]
    decisions = post(url, "/v1/decisions", content=big, headers=auth)
    assert decisions.status_code == 413 and decisions.json()["error"]["code"] == "request_too_large"
    small = zstd.compress(json.dumps({**GOOD, "state": "y" * 2000}).encode())
    assert post(url, "/v1/systemone", content=small, headers={**auth, "content-encoding": "zstd"}).status_code == 200


def test_a_full_queue_is_503_with_retry_after(launched, crowded_app, crowd_gates):
    """12 callers at once against a one-request Batcher whose model is held: each gets its own answer or a 503 with
    Retry-After (typesafe-sdk and openai retry those), never another status."""
    app, _ = launched
    url, _ = crowded_app
    replies: list = [None] * 12

    def call(i: int) -> None:
        replies[i] = post(
            url,
            "/v1/systemone",
            json={
                "model": "jev-latest",
                "state": f"ticket {i}: refund please",
                "questions": {"q": {"type": "noul", "instructions": "Urgent?"}},
            },
        )

    threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
    with crowd_gates.closed("forward"):
        for t in threads:
            t.start()
        # the model holds the first request and the Batcher's one place keeps a second: the rest are told 503
        held = wait_until(
            lambda: crowd_gates.arrived("forward") >= 1 and any(r is not None and r.status_code == 503 for r in replies)
        )
    for t in threads:
        t.join(300)
    assert held, ([r and r.status_code for r in replies], crowd_gates.arrived("forward"))
    statuses = sorted(r.status_code for r in replies)
    print(f"\nwire flood of 12: {statuses.count(200)} answered, {statuses.count(503)} told busy (503)")
    assert set(statuses) == {200, 503}
    for i, r in enumerate(replies):
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and r.json()["detail"]["error_type"] == "overloaded"
        else:
            want = app.DEPLOYMENT.decide(
                f"ticket {i}: refund please", {"q": {"type": "noul", "instructions": "Urgent?"}}
            )
            assert close(r.json()["answers"]["q"]["noul"], want["answers"]["q"]["probabilities"]["yes"], 1e-6)


# ------------------------------------------------------------------------------------------------------------------
# ZeroGPU: the caller's quota token reaches @spaces.GPU; its refusals become statuses clients retry
# ------------------------------------------------------------------------------------------------------------------


class Probe(blink.MockEngine):
    """A mock that runs as a live model does (through the Batcher) and records what @spaces.GPU would schedule its
    GPU call with: the request headers in the context it reads (spaces.utils.gradio_request_var(), Gradio's
    LocalContext.request), and the quota token and user spaces' own client finds in them."""

    runs_model = True

    def __init__(self, *args, fail: Exception | None = None):
        super().__init__(*args)
        self.seen: list = []
        self.fail = fail

    def run(self, jobs):
        from spaces.utils import gradio_request_var
        from spaces.zero.client import _get_headers, _get_token_and_payload

        headers = _get_headers(gradio_request_var().get(None))
        self.seen.append((dict(headers), *_get_token_and_payload(headers)))
        if self.fail is not None:
            return [self.fail] * len(jobs)
        return super().run(jobs)


def test_the_callers_zero_gpu_token_reaches_the_gpu_call(launched):
    app, url = launched
    probe = Probe(app.DEPLOYMENT.default_model, app.SETTINGS)
    with serving(app, probe):
        token = {"x-ip-token": "h.eyJ1c2VyIjoiYWxpY2UifQ.s", "authorization": "Bearer someone's-key"}  # user alice
        assert post(url, "/v1/systemone", json=GOOD, headers=token).status_code == 200
        assert (
            post(
                url,
                "/v1/decisions",
                json={"model": "jev-latest", "input": "x", "questions": [{"type": "predicate", "instructions": "?"}]},
                headers=token,
            ).status_code
            == 200
        )
        assert post(url, "/v1/systemone", json=GOOD).status_code == 200
    # only the quota header is handed on, never the caller's key; no token: an anonymous call, as spaces expects
    alice = ({"x-ip-token": token["x-ip-token"]}, token["x-ip-token"], {"user": "alice"})
    assert probe.seen == [alice, alice, ({}, None, {})]


@pytest.mark.parametrize(
    "title,status,retry_after", [("ZeroGPU quota exceeded", 429, "60"), ("ZeroGPU queue timeout", 503, "5")]
)
def test_zero_gpu_refusals_are_retryable_statuses(launched, title, status, retry_after):
    import gradio as gr

    app, url = launched
    probe = Probe(app.DEPLOYMENT.default_model, app.SETTINGS, fail=gr.Error("Try again later.", title=title))
    with serving(app, probe):
        r = post(url, "/v1/systemone", json=GOOD)
        d = post(
            url,
            "/v1/decisions",
            json={"model": "jev-latest", "input": "x", "questions": [{"type": "predicate", "instructions": "?"}]},
        )
    assert r.status_code == d.status_code == status and r.headers["retry-after"] == retry_after
    assert title in r.json()["detail"]["message"] and title in d.json()["error"]["message"]


# ------------------------------------------------------------------------------------------------------------------
# MCP
# ------------------------------------------------------------------------------------------------------------------


async def mcp_session(url: str, work):
    """Run work(session) in an MCP session with the app's streamable-HTTP MCP server."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with streamable_http_client(url.rstrip("/") + "/gradio_api/mcp/") as (read, write, _):
        async with ClientSession(read, write) as session:
            await session.initialize()
            return await work(session)


def test_mcp_client_lists_and_calls_the_decide_tool(mock_app):
    app, url = mock_app
    questions = {
        "urgent": {"type": "noul", "instructions": "Is the customer blocked?"},
        "queue": {"type": "choice", "criteria": ["billing", "access"]},
    }

    async def work(session):
        tools = {t.name: t for t in (await session.list_tools()).tools}
        result = await session.call_tool("decide", {"state": TICKET["message"], "questions": questions})
        refused = await session.call_tool("decide", {"state": "x", "questions": {"q": {"type": "score"}}})
        return tools, result, refused

    tools, result, refused = asyncio.run(mcp_session(url, work))
    assert {"decide", "decide_batch", "info"} <= set(tools)
    decide = tools["decide"]
    assert "forward pass" in decide.description and "choice" in decide.description
    props = decide.inputSchema["properties"]
    assert set(decide.inputSchema["required"]) == {"state", "questions"}
    assert "noul" in props["questions"]["description"] and props["state"]["description"]
    assert not result.isError
    got = json.loads(result.content[0].text)  # JSON an agent parses, not Python's repr of a dict
    want = app.DEPLOYMENT.decide(TICKET["message"], questions)["answers"]
    assert got["answers"] == want and got["meta"]["fabricated"] is True
    assert got["meta"]["temperature_source"] == "default"  # no temperature given: the deployment's own applies
    assert refused.isError and "field: questions.q.criteria" in refused.content[0].text


def test_zero_gpu_refusals_reach_gradio_api_callers_as_they_are(launched, client):
    import gradio as gr
    from gradio_client.exceptions import AppError

    app, _ = launched
    probe = Probe(
        app.DEPLOYMENT.default_model,
        app.SETTINGS,
        fail=gr.Error("You have exceeded your free ZeroGPU quota.", title="ZeroGPU quota exceeded"),
    )
    with serving(app, probe):
        with pytest.raises(AppError) as caught:
            client.predict("x", {"q": {"type": "noul"}}, 1.0, "", "live", None, api_name="/decide")
        batch = client.predict([{"state": "x", "questions": {"q": {"type": "noul"}}}], api_name="/decide_batch")
    assert caught.value.title == "ZeroGPU quota exceeded" and "exceeded your free ZeroGPU quota" in caught.value.message
    assert batch[0]["error"] == "ZeroGPU quota exceeded: You have exceeded your free ZeroGPU quota."


class GatedModel(blink.MockEngine):
    """A mock that runs as a live model does (through the Batcher); its first forward waits until `gate` is set,
    and each forward records the evidence of the requests it packed together."""

    runs_model = True

    def __init__(self, *args):
        super().__init__(*args)
        self.forwards: list[list] = []
        self.entered, self.gate = threading.Event(), threading.Event()

    def run(self, jobs):
        self.entered.set()
        self.gate.wait(60)
        self.forwards.append([job.request.state for job in jobs])
        return super().run(jobs)


def test_wire_and_page_requests_share_forwards(launched, client):
    app, url = launched
    model = GatedModel(app.DEPLOYMENT.default_model, app.SETTINGS)
    batcher = app.DEPLOYMENT.batcher()
    with serving(app, model):
        # page 0 holds the model; three more page requests and three wire requests queue behind it meanwhile
        first = client.submit("page 0", {"q": {"type": "noul"}}, 1.0, "", "live", None, api_name="/decide")
        assert model.entered.wait(60)
        page = [
            client.submit(f"page {i}", {"q": {"type": "noul"}}, 1.0, "", "live", None, api_name="/decide")
            for i in range(1, 4)
        ]
        replies: dict = {}
        threads = [
            threading.Thread(
                target=lambda i=i: replies.update({i: post(url, "/v1/systemone", json={**GOOD, "state": f"wire {i}"})})
            )
            for i in range(3)
        ]
        for t in threads:
            t.start()
        queued = wait_until(lambda: batcher.q.qsize() == 6)
        model.gate.set()
        for t in threads:
            t.join(60)
        results = [job.result(timeout=60) for job in [first, *page]]
    assert queued, batcher.q.qsize()
    assert all(r.status_code == 200 for r in replies.values()) and len(results) == 4
    assert model.forwards[0] == ["page 0"], model.forwards
    mixed = [states for states in model.forwards if {s.split()[0] for s in states} == {"page", "wire"}]
    assert mixed, model.forwards  # one forward packed API and page requests together
