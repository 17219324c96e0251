"""Property-based bodies for the wire routes of the launched app (mock engine): whatever arrives, /v1/systemone (and
its batch route) and /v1/decisions answer 200 with a body the official clients' own response models accept, or a 4xx
in the protocol's error shape. Never a 5xx."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
from conftest import serving
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from openai.types import Decision
from test_app_fuzz import JSON, NAME, PLAUSIBLE, TEXT
from typesafe_sdk import SystemOneResponse

import blink

PNG_1PX = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def usually(plain: st.SearchStrategy, odd: st.SearchStrategy) -> st.SearchStrategy:
    """Plain values four times in five, so most cases turn on one odd field at most."""
    return st.integers(0, 4).flatmap(lambda i: odd if i == 4 else plain)


MODEL = usually(
    st.sampled_from(["jev-latest", blink.deployment().default_model]),
    st.one_of(st.sampled_from(["", "gpt-6-luna"]), TEXT, JSON),
)
STATE = usually(
    st.one_of(TEXT, JSON.filter(lambda v: isinstance(v, (dict, list)))),
    st.one_of(JSON, st.text(min_size=500, max_size=2000)),
)
SYSTEMONE_PLAUSIBLE = PLAUSIBLE.map(
    lambda q: (
        {**q, "criteria": {str(k): None for k in q["criteria"]} if isinstance(q["criteria"], list) else q["criteria"]}
        if q["type"] == "choice"
        else {**q, "criteria": [c or "level" for c in q["criteria"]]}
        if q["type"] == "score"
        else q
    )
)
ODD_QUESTION = st.fixed_dictionaries(
    {"type": st.sampled_from(["choice", "noul", "score", "box", "rank", None, 3])},
    optional={"criteria": JSON, "instructions": JSON, "permute": JSON, "multi": JSON, "abstain": JSON},
)
WIRE_QUESTION = usually(SYSTEMONE_PLAUSIBLE, st.one_of(PLAUSIBLE, JSON, ODD_QUESTION))
ASSET = st.one_of(
    JSON,
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["image", "video", None]),
            "format": st.sampled_from(["png", "gif", None]),
            "data_base64": st.sampled_from([PNG_1PX, "!!", "", None]),
            "part": st.sampled_from(["asset-0", None]),
        },
    ),
)
SYSTEMONE = usually(
    st.fixed_dictionaries(
        {"model": MODEL, "state": STATE, "questions": st.dictionaries(NAME, WIRE_QUESTION, min_size=1, max_size=4)},
        optional={"assets": st.one_of(JSON, st.dictionaries(TEXT, ASSET, max_size=2))},
    ),
    st.one_of(
        st.fixed_dictionaries({}, optional={"model": MODEL, "state": JSON, "questions": JSON, "assets": JSON}), JSON
    ),
)
BATCH = usually(
    st.fixed_dictionaries(
        {
            "states": usually(st.lists(STATE, min_size=1, max_size=4), st.one_of(JSON, st.lists(JSON, max_size=66))),
            "questions": st.dictionaries(NAME, WIRE_QUESTION, min_size=1, max_size=3),
        },
        optional={"model": MODEL, "assets": st.one_of(JSON, st.dictionaries(TEXT, ASSET, max_size=2))},
    ),
    st.one_of(st.fixed_dictionaries({}, optional={"states": JSON, "questions": JSON, "model": MODEL}), JSON),
)
PART = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["input_text", "output_text", "refusal"]), "text": TEXT, "refusal": TEXT}
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("input_image"),
            "image_url": st.sampled_from(
                [
                    f"data:image/png;base64,{PNG_1PX}",
                    "https://example.com/a.png",
                    "data:image/gif;base64,AA",
                    "file-abc",
                    "data:image/png;base64,!!",
                ]
            ),
        }
    ),
    st.fixed_dictionaries({"type": st.just("input_json"), "data": JSON}),
    JSON,
)
ITEM = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]),
            "content": usually(TEXT, st.lists(PART, max_size=3)),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function_call", "message", "reasoning"]), "name": TEXT, "arguments": TEXT}
    ),
    JSON,
)
OPTION = st.one_of(
    st.fixed_dictionaries({"value": st.one_of(TEXT, st.booleans())}, optional={"description": TEXT}), JSON
)
DECISION_QUESTION = usually(
    st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("predicate"), "instructions": st.one_of(TEXT, st.lists(PART, max_size=2))},
            optional={"name": TEXT},
        ),
        st.fixed_dictionaries(
            {"type": st.just("choice"), "instructions": TEXT, "choices": st.lists(OPTION, min_size=1, max_size=6)},
            optional={"name": TEXT},
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("score"),
                "instructions": TEXT,
                "levels": st.lists(
                    st.one_of(st.fixed_dictionaries({"label": TEXT}, optional={"description": TEXT}), JSON),
                    min_size=1,
                    max_size=11,
                ),
            },
            optional={"name": TEXT},
        ),
    ),
    JSON,
)
DECISIONS = usually(
    st.fixed_dictionaries(
        {
            "model": MODEL,
            "input": usually(TEXT, st.lists(ITEM, max_size=3)),
            "questions": st.lists(DECISION_QUESTION, min_size=1, max_size=4),
        },
        optional={"prompt_cache_key": TEXT, "safety_identifier": JSON},
    ),
    st.one_of(st.fixed_dictionaries({}, optional={"model": MODEL, "input": JSON, "questions": JSON}), JSON),
)


@pytest.fixture()
def mock_wire(launched):
    """The launched app on the mock engine, standing in for a model that reads images (so assets get past the
    text-only refusal and are parsed and placed), and an HTTP client for its root."""
    app, url = launched
    reader = blink.MockEngine(app.DEPLOYMENT.default_model, app.SETTINGS)
    reader.reads_images = True
    with serving(app, reader), httpx.Client(base_url=url, timeout=60) as http:
        yield http


def check_systemone(response: httpx.Response) -> str:
    """A 200 the SDK's own response model accepts, or a 4xx in System One's error shape; returns how it ended."""
    assert response.status_code < 500, response.text
    body = response.json()
    if response.status_code == 200:
        parsed = SystemOneResponse.model_validate_json(response.content)
        assert len(parsed.answers) == len(body["answers"]) and body["usage"]["output_tokens"] == 0
        return "answered"
    detail = body["detail"]
    if isinstance(detail, list):
        assert response.status_code == 422 and detail[0]["loc"][0] == "body" and detail[0]["msg"], detail
        return f"422 {detail[0]['type']}"
    assert detail["message"] and detail["error_type"], detail
    return f"{response.status_code} {detail['error_type']}"


def check_decisions(response: httpx.Response, body) -> str:
    """A 200 the openai client's Decision model accepts with its answers in question order, or a 4xx in OpenAI's
    error shape; returns how it ended."""
    assert response.status_code < 500, response.text
    got = response.json()
    if response.status_code == 200:
        decision = Decision.model_validate(got)
        assert [a.name for a in decision.answers] == [q.get("name") for q in body["questions"]]
        return "answered"
    error = got["error"]
    assert error["message"] and error["type"] and error["code"], error
    return f"{response.status_code} {error['code']}"


def report(route: str, counts: Counter) -> None:
    """Print how the cases ended; both answers and refusals must have happened."""
    print(f"\n{route}: {sum(counts.values())} cases: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    assert counts["answered"] and sum(counts.values()) > counts["answered"]


def test_systemone_bodies(mock_wire):
    counts: Counter = Counter()

    @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(body=SYSTEMONE)
    @example(body={"model": "jev-latest", "state": "x", "questions": {"q": {"type": "noul"}}})
    @example(body={"model": "jev-latest", "state": "x", "questions": {"q": {"type": "choice", "criteria": {}}}})
    @example(body={"model": "jev-latest", "state": "x", "questions": {"q": {"type": "noul", "multi": True}}})
    @example(body={"model": "jev-latest", "state": {"a": [[[[[[[]]]]]]] * 20}, "questions": {"q": {"type": "noul"}}})
    def case(body):
        counts[
            check_systemone(
                mock_wire.post(
                    "v1/systemone", content=json.dumps(body).encode(), headers={"content-type": "application/json"}
                )
            )
        ] += 1

    case()
    report("/v1/systemone", counts)


def test_systemone_batch_bodies(mock_wire):
    """laya-serve's batch route: a result per state, each one the SDK's response model accepts, or a 4xx."""
    counts: Counter = Counter()

    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(body=BATCH)
    @example(body={"states": ["x", {"a": 1}], "questions": {"q": {"type": "noul"}}})
    @example(body={"states": ["x"] * 65, "questions": {"q": {"type": "noul"}}})
    def case(body):
        response = mock_wire.post(
            "v1/systemone/batch", content=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        if response.status_code != 200:
            counts[check_systemone(response)] += 1
            return
        results = response.json()["results"]
        assert len(results) == len(body["states"])
        for result in results:
            SystemOneResponse.model_validate_json(json.dumps(result))  # as the SDK reads a reply
        counts["answered"] += 1

    case()
    report("/v1/systemone/batch", counts)


def test_decisions_bodies(mock_wire):
    counts: Counter = Counter()

    @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(body=DECISIONS)
    @example(body={"model": "jev-latest", "input": "x", "questions": [{"type": "predicate", "instructions": "?"}]})
    @example(body={"model": "jev-latest", "input": [], "questions": [{"type": "predicate", "instructions": "?"}]})
    @example(
        body={
            "model": "jev-latest",
            "input": "x",
            "questions": [{"type": "choice", "instructions": "?", "choices": [{"value": True}, {"value": "true"}]}],
        }
    )
    def case(body):
        response = mock_wire.post(
            "v1/decisions", content=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        counts[check_decisions(response, body)] += 1

    case()
    report("/v1/decisions", counts)


@pytest.mark.parametrize("route", ["v1/systemone", "v1/systemone/batch", "v1/decisions"])
def test_bytes_that_are_not_a_request(mock_wire, route):
    """Raw bytes, odd content types and encodings: a 4xx every time."""
    bodies = [
        b"",
        b"null",
        b"\x00\xff" * 50,
        b'{"model": "jev-latest"' * 3,
        "ä".encode("latin-1"),
        b"1e999",
        b'{"a": Infinity}',
        b"[" * 5000,
        b'"' + b"x" * 10_000,
    ]
    kinds = ["application/json", "text/plain", "multipart/form-data", "multipart/form-data; boundary=zz", ""]
    for body in bodies:
        for kind in kinds:
            for encoding in ("", "zstd", "br"):
                response = mock_wire.post(
                    route, content=body, headers={"content-type": kind, "content-encoding": encoding}
                )
                assert 400 <= response.status_code < 500, (body[:40], kind, encoding, response.text)
