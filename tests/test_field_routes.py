"""What the field's servers offer, on blink's HTTP layer served by a real uvicorn server: laya-serve's
POST /v1/systemone/batch (one question set over 1-64 states), called with httpx (laya's own client, `laya.client`, has
no batch call and typesafe-sdk 0.7.5 none either; httpx is what laya's client is written with), and avrik-server's
GET /openapi.json, checked with openapi-spec-validator, with every /v1 route's real replies and refusals validated
against it by openapi-core.

The batch test runs a tiny Qwen3.5 model in float32 through the real torch engine and compares each state's answers
with the same state asked alone; the rest run on the mock engine (fabricated numbers)."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from dataclasses import replace
from urllib.parse import parse_qs

import httpx
import pytest
import uvicorn
from conftest import DEFAULTS, free_port, serving_without_answer_cache, wait_until
from fastapi import FastAPI
from openapi_core import OpenAPI
from openapi_core.datatypes import RequestParameters
from openapi_spec_validator import validate
from werkzeug.datastructures import Headers, ImmutableMultiDict

import blink
from adapters import wire
from adapters.http import HttpLayer, ServerSettings

KEY = "field-routes-key-5c2e"
AUTH = {"authorization": f"Bearer {KEY}"}
QS = {
    "late": {"type": "noul", "instructions": "Was the invoice paid late?", "criteria": {"true": "after the due date"}},
    "queue": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "payments", "access": None}},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["can wait", "this week", "today"]},
}
STATES = [
    "The invoice was due on 1 May and paid on 30 June, after two reminders.",
    {"message": "Payment arrived a week early.", "plan": "team", "seats": 12},
    "The March invoice is still open and the customer has stopped answering emails; the account is locked and "
    "nobody on the team can log in to pay it, so they asked us to extend the deadline by a month.",
    ["first note: paid", "second note: the bank reversed it"],
    "ok",
]


@contextmanager
def served(deployment: blink.Deployment, **settings):
    """blink's HTTP layer on a FastAPI app of its own, served by uvicorn on loopback; yields the base URL."""
    api = FastAPI(docs_url=None, redoc_url=None)
    HttpLayer(deployment, ServerSettings(**settings)).install(api)
    server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started, 60), "uvicorn did not start"
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(60)


@pytest.fixture(scope="module")
def mock_url():
    """The layer over the mock engine, without a key."""
    with served(blink.Deployment.serving(blink.MockEngine("org/mock"))) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_url():
    """The layer over the mock engine, with BLINK_API_KEY set and a 4 KiB body limit."""
    with served(blink.Deployment.serving(blink.MockEngine("org/mock")), api_key=KEY, max_body_bytes=4096) as url:
        yield url


def batch(url: str, body, headers: dict | None = None) -> httpx.Response:
    """POST a batch body (an object sent as JSON, bytes as they are)."""
    if isinstance(body, bytes):
        headers = {"content-type": "application/json", **(headers or {})}
        return httpx.post(url + "/v1/systemone/batch", content=body, headers=headers, timeout=300)
    return httpx.post(url + "/v1/systemone/batch", json=body, headers=headers, timeout=300)


# ------------------------------------------------------------------------------------------------------------------
# POST /v1/systemone/batch
# ------------------------------------------------------------------------------------------------------------------


def numbers(answer: dict) -> dict[str, float]:
    """The numbers of one System One answer: p(yes) of a noul; each option's probability, the confidence and a
    score's expected level otherwise."""
    out = {f"p[{k}]": p for k, p in answer.get("probabilities", {}).items()}
    out.update({k: answer[k] for k in ("noul", "score", "confidence") if k in answer})
    return out


def test_each_state_of_a_batch_is_answered_as_it_would_be_alone(tiny_qwen_dir):
    engine = blink.TorchEngine(tiny_qwen_dir, settings=replace(DEFAULTS, dtype="float32"))
    with served(serving_without_answer_cache(engine)) as url:
        reply = batch(url, {"model": "jev-latest", "states": STATES, "questions": QS})
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        alone = []
        for state in STATES:
            one = httpx.post(
                url + "/v1/systemone", json={"model": "jev-latest", "state": state, "questions": QS}, timeout=300
            )
            assert one.status_code == 200, one.text
            alone.append(one.json())
    assert len(results) == len(STATES)
    for got, want in zip(results, alone):
        assert set(got["answers"]) == set(QS) and got["model"] == want["model"] == engine.model_id
        for key in QS:
            assert numbers(got["answers"][key]) == pytest.approx(numbers(want["answers"][key]), abs=1e-5), key
        assert got["usage"] == want["usage"]  # the same prompt tokens: nothing of another state in it
        assert got["x_meta"]["batched_requests"] == len(STATES)  # every state in one forward of the Batcher
        assert want["x_meta"]["batched_requests"] == 1
    # the states differ, and so do their answers: no state was answered with another's
    assert len({json.dumps(r["answers"], sort_keys=True) for r in results}) == len(STATES)


def test_a_batch_keeps_the_order_and_shape_of_its_states(mock_url):
    reply = batch(mock_url, {"states": STATES, "questions": QS})  # no model: the SDKs' default alias
    assert reply.status_code == 200 and reply.headers["x-typesafe-request-id"].startswith("req_")
    results = reply.json()["results"]
    singles = [
        httpx.post(mock_url + "/v1/systemone", json={"model": "jev-latest", "state": s, "questions": QS}).json()
        for s in STATES
    ]
    assert [r["answers"] for r in results] == [s["answers"] for s in singles]  # the mock answers by content
    assert results[0]["answers"]["urgency"]["legend"] == {"0": "can wait", "1": "this week", "2": "today"}


@pytest.mark.parametrize(
    ("body", "status", "loc", "names"),
    [
        ({"questions": QS}, 422, ["body", "states"], "states is required"),
        ({"states": "one", "questions": QS}, 422, ["body", "states"], "states must be"),
        ({"states": [], "questions": QS}, 422, ["body", "states"], "1 to 64 states (got 0)"),
        ({"states": ["x"] * 65, "questions": QS}, 422, ["body", "states"], "1 to 64 states (got 65)"),
        ({"states": ["a", "b", None], "questions": QS}, 422, ["body", "states", 2], "states[2]"),
        ({"states": ["a", 5], "questions": QS}, 422, ["body", "states", 1], "states[1]"),
        (
            json.dumps({"states": ["a", "b", "c", {"note": "a\ud800b"}], "questions": QS}).encode(),
            422,
            ["body", "states", 3, "note"],
            "states[3]",
        ),
        ({"states": ["a", "data:image/png;base64,iVBORw0KGgo="], "questions": QS}, 422, ["body", "states", 1], None),
        ({"states": ["a"]}, 422, ["body", "questions"], "questions is required"),
        ({"states": ["a"], "questions": {}}, 422, ["body", "questions"], "at least one question"),
        (
            {"states": ["a"], "questions": {"x": {"type": "choice", "criteria": ["a", "b"]}}},
            422,
            ["body", "questions", "x", "criteria"],
            "questions.x.criteria",
        ),
        (
            {"states": ["a", "b"], "questions": {"x": {"type": "score", "criteria": ["only one"]}}},
            422,
            None,
            "2 to 10 levels",
        ),
        ({"states": ["a"], "questions": {"x": {"type": "box"}}}, 400, None, "box questions"),
        ({"model": "no/such-model", "states": ["a"], "questions": QS}, 404, None, "not served"),
        ({"model": 7, "states": ["a"], "questions": QS}, 422, ["body", "model"], "model must be"),
        ([1, 2], 422, ["body"], None),
        (b'{"states": ["a"], "questions": ', 422, None, "not valid JSON"),
    ],
)
def test_batch_refusals_name_the_field(mock_url, body, status, loc, names):
    reply = batch(mock_url, body)
    assert reply.status_code == status, reply.text
    detail = reply.json()["detail"]
    if status == 422:
        (item,) = detail
        message = item["msg"]
        if loc is not None:
            assert item["loc"] == loc
    else:
        message = detail["message"]
    assert names is None or names in message, message


def test_a_refusal_after_parsing_names_its_state():
    """A state refused once it is prepared or run (here: a request a recording-only host lacks) refuses the batch
    naming that state, in the status its own refusal has; a refusal of the batch as a whole passes as it is."""
    missing = blink.ReplayMiss("no recorded output for this request", ["body"])
    assert wire.in_state(missing, 3).loc == ["body", "states", 3]
    assert isinstance(wire.in_state(missing, 3), blink.ReplayMiss)
    status, body = wire.systemone_error(wire.in_state(missing, 3))
    assert status == 400 and body["detail"]["message"].startswith("states[3]: ")
    busy = blink.BlinkBusy("busy")
    assert wire.in_state(busy, 1) is busy  # the batch as a whole: 503, retried by the clients


def test_batch_has_the_key_and_the_body_limit_of_systemone(keyed_url):
    body = {"states": ["a", "b"], "questions": QS}
    for headers in (None, {"authorization": "Bearer wrong"}):
        refused = batch(keyed_url, body, headers)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert refused.json()["detail"]["error_type"] == "authentication_error"
    assert batch(keyed_url, body, AUTH).status_code == 200
    large = batch(keyed_url, {"states": ["x" * 5000], "questions": QS}, AUTH)
    assert large.status_code == 413 and large.json()["detail"]["error_type"] == "request_too_large"


# ------------------------------------------------------------------------------------------------------------------
# GET /openapi.json
# ------------------------------------------------------------------------------------------------------------------


class SeenRequest:
    """An httpx request as openapi-core reads one."""

    def __init__(self, request: httpx.Request):
        self.method = request.method.lower()
        self.host_url = f"{request.url.scheme}://{request.url.netloc.decode()}"
        self.path = request.url.path
        self.body = request.content or None
        self.content_type = request.headers.get("content-type", "")
        self.parameters = RequestParameters(
            query=ImmutableMultiDict(parse_qs(request.url.query.decode())),
            header=Headers(dict(request.headers)),
            cookie=ImmutableMultiDict(),
        )


class SeenResponse:
    """An httpx response as openapi-core reads one."""

    def __init__(self, response: httpx.Response):
        self.status_code = response.status_code
        self.content_type = response.headers.get("content-type", "")
        self.headers = Headers(dict(response.headers))
        self.data = response.content


def exchanges(url: str, headers: dict) -> list[tuple[str, httpx.Response]]:
    """A real request to every /v1 route, answered and refused: (what it is, the reply)."""
    text_only = {"model": "jev-latest", "state": "a", "questions": QS, "assets": {"img": {"data_base64": "iVBO"}}}
    decisions = {
        "model": "jev-latest",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "I was charged twice."}]}],
        "questions": [
            {"type": "predicate", "name": "spam", "instructions": "The message is spam."},
            {"type": "choice", "instructions": "Team?", "choices": [{"value": "billing"}, {"value": True}]},
            {"type": "score", "instructions": "Urgency?", "levels": [{"label": "low"}, {"label": "high"}]},
        ],
    }
    asked = {"model": "jev-latest", "state": STATES[1], "questions": QS}
    box = {"b": {"type": "box"}}
    with httpx.Client(base_url=url, headers=headers, timeout=300) as client:
        return [
            ("systemone", client.post("/v1/systemone", json=asked)),
            ("systemone 422", client.post("/v1/systemone", json={**asked, "questions": {}})),
            ("systemone asset 422", client.post("/v1/systemone", json=text_only)),
            ("systemone 404", client.post("/v1/systemone", json={**asked, "model": "none/such"})),
            ("systemone 400", client.post("/v1/systemone", json={**asked, "questions": box})),
            ("batch", client.post("/v1/systemone/batch", json={"states": STATES, "questions": QS})),
            ("batch 422", client.post("/v1/systemone/batch", json={"states": ["a", 1], "questions": QS})),
            ("decisions", client.post("/v1/decisions", json=decisions)),
            ("decisions 400", client.post("/v1/decisions", json={**decisions, "questions": []})),
            ("models", client.get("/v1/models")),
        ]


def test_openapi_document_is_valid_and_every_route_replies_as_it_says(mock_url):
    reply = httpx.get(mock_url + "/openapi.json")
    assert reply.status_code == 200
    document = reply.json()
    validate(document)  # openapi-spec-validator: a valid OpenAPI 3.1 document
    assert document["openapi"].startswith("3.1")
    assert set(document["paths"]) == {"/v1/systemone", "/v1/systemone/batch", "/v1/decisions", "/v1/models"}
    batch_states = document["components"]["schemas"]["SystemOneBatchRequest"]["properties"]["states"]
    assert batch_states["maxItems"] == wire.MAX_BATCH_STATES == 64
    spec = OpenAPI.from_dict(document)
    seen = exchanges(mock_url, {})
    assert [r.status_code for _, r in seen] == [200, 422, 422, 404, 400, 200, 422, 200, 400, 200]
    for what, response in seen:
        try:
            spec.validate_response(SeenRequest(response.request), SeenResponse(response))
            if response.status_code == 200:
                spec.validate_request(SeenRequest(response.request))
        except Exception as exc:  # noqa: BLE001 - said with the exchange it was
            pytest.fail(f"{what}: {exc!r:.2000}")
    # a body the document refuses is one the route refuses, and the other way round
    for body in ({"states": ["a"] * 65, "questions": QS}, {"states": ["a"], "questions": {}}):
        request = httpx.Request("POST", mock_url + "/v1/systemone/batch", json=body)
        with pytest.raises(Exception):  # noqa: B017 - openapi-core's own validation error, whichever it is
            spec.validate_request(SeenRequest(request))
        assert batch(mock_url, body).status_code == 422


def test_openapi_document_needs_the_key_where_the_routes_do(keyed_url):
    assert httpx.get(keyed_url + "/openapi.json").status_code == 401
    document = httpx.get(keyed_url + "/openapi.json", headers=AUTH).json()
    validate(document)
    assert document["paths"]["/v1/systemone/batch"]["post"]["security"] == [{"bearer": []}]
    spec = OpenAPI.from_dict(document)
    for _, response in exchanges(keyed_url, AUTH)[:1] + [("401", httpx.post(keyed_url + "/v1/systemone", json={}))]:
        spec.validate_response(SeenRequest(response.request), SeenResponse(response))


def test_openapi_json_is_the_layers_document_on_a_fastapi_app_that_serves_its_own():
    """FastAPI (and Gradio's app, a FastAPI app) serve a document of their own at /openapi.json: the layer's comes
    first."""
    from fastapi.testclient import TestClient

    api = FastAPI()  # openapi_url at its default, /openapi.json
    HttpLayer(blink.Deployment.serving(blink.MockEngine("org/mock")), ServerSettings()).install(api)
    with TestClient(api) as client:
        document = client.get("/openapi.json").json()
    assert "SystemOneBatchRequest" in document["components"]["schemas"]
    assert json.dumps(document).count("/v1/systemone/batch") == 1
