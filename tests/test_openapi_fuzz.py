"""schemathesis (pinned in .venv-schemathesis by tools/setup.sh --tests) fuzzes every /v1 route of the app on the
stand-in against the app's own /openapi.json with every check: no server error, no request the document allows is
refused, none it forbids is answered, every reply as the document says, each within MAX_RESPONSE_S. Requests the
document allows are drawn from a copy with its counts capped, so the stand-in answers each in seconds (the copy allows
a subset of what the document does); requests it forbids are drawn from the document as served. Bodies that break a
rule the document states in words (tests/openapi_fuzz_hooks.py) are not sent. The app's /metrics show the Decisions
route answered, not only refused: the document names the served models."""

from __future__ import annotations

import copy
import json
import os
import subprocess

import httpx
import pytest
from conftest import ROOT, app_process
from prometheus_client.parser import text_string_to_metric_families

ST = os.path.join(ROOT, ".venv-schemathesis", "bin", "st")
CAP = 3  # the most questions, options, states or permute rotations a fuzzed request holds
MAX_TEXT = 40  # the longest text in a request the document allows, as fuzzed
SEED = 20261206
EXAMPLES = {"positive": 4, "negative": 20}  # per route and phase: the stand-in answers an allowed request in seconds
MAX_RESPONSE_S = 240  # schemathesis' own limit is 10 s; the stand-in on a loaded 2-core machine can need far more
ROUTES = ("/v1/systemone", "/v1/systemone/batch", "/v1/decisions", "/v1/models")


@pytest.fixture(scope="module")
def st() -> str:
    """schemathesis' command, as tools/setup.sh --tests installs it; skipped where it is missing, failed under
    CI=true."""
    if not os.path.exists(ST):
        why = "schemathesis is not installed: run bash tools/setup.sh --tests (or --harnesses)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {why}")
        pytest.skip(why)
    return ST


def capped(node, name: str = ""):
    """A copy of a request schema with every count above CAP (maxItems, maxProperties, permute's maximum) at CAP,
    every minimum count kept at or below it, an object or an array without a count at most CAP long and text at most
    MAX_TEXT characters."""
    if isinstance(node, list):
        return [capped(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: capped(value, key) for key, value in node.items()}
    kinds = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    limits = {"maxItems": "array", "maxProperties": "object", "maxLength": "string"}
    for key, kind in limits.items():
        if kind in kinds:
            out.setdefault(key, MAX_TEXT if kind == "string" else CAP)
    for key in ("maxItems", "maxProperties", "minItems", "minProperties"):
        if isinstance(out.get(key), int):
            out[key] = min(out[key], CAP)
    if name == "permute" and isinstance(out.get("maximum"), int):
        out["maximum"] = min(out["maximum"], CAP)
    return out


def fuzzed_document(document: dict) -> dict:
    """The served document with its request schemas capped (replies are checked against them as served)."""
    out = copy.deepcopy(document)
    schemas = out["components"]["schemas"]
    for name in schemas:
        if "Request" in name or "Question" in name:
            schemas[name] = capped(schemas[name])
    return out


def route_counts(url: str) -> dict[tuple[str, str], float]:
    """blink_http_requests_total from the app's /metrics, by (route, status)."""
    text = httpx.get(url + "metrics", timeout=60).text
    return {
        (s.labels["route"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "blink_http_requests_total"
    }


def test_capping_keeps_a_subset_of_the_document():
    schema = {"maxProperties": 512, "minProperties": 1, "properties": {"permute": {"maximum": 255, "minimum": 1}}}
    assert capped(schema) == {
        "maxProperties": CAP,
        "minProperties": 1,
        "properties": {"permute": {"maximum": CAP, "minimum": 1}},
    }
    assert capped({"type": ["string", "object"]}) == {"type": ["string", "object"], "maxLength": 40, "maxProperties": 3}


def fuzz(st: str, location: str, url: str, mode: str, folder) -> subprocess.CompletedProcess:
    """One schemathesis run of every check over the document at `location` against the app at `url`, drawing
    requests the document allows (mode positive: examples and fuzzing, the phases that keep the hooks' rules) or
    forbids (negative: every phase)."""
    phases = "examples,fuzzing" if mode == "positive" else "examples,coverage,fuzzing"
    cmd = [
        st, "run", location, "--url", url.rstrip("/"), "--checks", "all", "--mode", mode, "--phases", phases,
        "--max-examples", str(EXAMPLES[mode]), "--seed", str(SEED), "--workers", "1", "--request-timeout", "300",
        "--max-response-time", str(MAX_RESPONSE_S), "--generation-database", "none", "--no-color",
    ]  # fmt: skip
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "openapi_fuzz_hooks", "PYTHONPATH": os.path.dirname(__file__)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=folder, env=env)


def test_schemathesis_finds_the_routes_as_the_document_says(st, tmp_path):
    with app_process({}, str(tmp_path)) as (url, _log):
        document = httpx.get(url + "openapi.json", timeout=60).json()
        assert set(document["paths"]) == set(ROUTES)
        path = tmp_path / "openapi.json"
        path.write_text(json.dumps(fuzzed_document(document)))
        runs = [
            fuzz(st, str(path), url, "positive", tmp_path),
            fuzz(st, url + "openapi.json", url, "negative", tmp_path),
        ]
        counts = route_counts(url)
    for done in runs:
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    answered = {route for (route, status), n in counts.items() if status == "200" and n > 0}
    assert set(ROUTES) <= answered, counts  # each route's logic reached, the Decisions route's included
    assert counts.get(("/v1/decisions", "400"), 0) > 0, counts  # and its refusals of what the document forbids
