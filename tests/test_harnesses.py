"""The field's own harnesses against the launched app, each run from its pinned environment (tools/setup.sh --tests
makes .venv-krite and .venv-jevbench): krite-bench's client validates blink's System One replies against krite's
response schema in its `jev` dialect (the schema file its package ships), and `jevbench check` and `jevbench eval
--suite examples` run unmodified against app.py started as a user starts it."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from urllib.parse import urlparse

import pytest
import tiny_models
from conftest import app_process
from image_samples import png_uri
from PIL import Image

from bench.lib import servers

ROOT = servers.ROOT
KRITE = os.path.join(ROOT, ".venv-krite", "bin", "python")
JEVBENCH = os.path.join(ROOT, ".venv-jevbench", "bin", "jevbench")
JEVCOMPAT = os.path.join(os.path.dirname(sys.executable), "jevcompat")  # requirements-ci.txt: it shares typesafe-sdk
HARNESS_S = 600  # the examples suite's 43 requests took about 1 min on the loaded 2-core CI machine

# krite's own client (krite_bench.client.Engine in its jev dialect: from_jev, then its response schema and its
# answer checks) asks each request; and, to show the check can fail, the same reply with a per-answer x_ field put
# back into its first choice or score answer is validated by krite's schema too (from_jev strips a noul's extras).
KRITE_ASK = r"""
import copy, json, sys
from krite_bench import client
port, requests = json.load(sys.stdin)
engine = client.Engine("blink", port, request_model="jev-latest", dialect="jev")
out = []
for request in requests:
    r = engine.call(request)
    row = {"status": r.status, "error": r.error, "response": r.response}
    bad = copy.deepcopy(r.response or {})
    picked = [a for a in (bad.get("answers") or {}).values() if a.get("type") != "noul"]
    if r.ok and picked:
        picked[0]["x_label_mass"] = 0.5
        row["with_x_field_valid"] = client._validator().is_valid(client.from_jev(bad))
    out.append(row)
print(json.dumps({"schema": str(client.SCHEMA_DIR / "response.schema.json"), "rows": out}))
"""

TICKET = "I was charged twice for March and nobody on the team can log in. Please fix this today."
TEXT_REQUESTS = {
    "noul": {"questions": {"blocked": {"type": "noul", "instructions": "Is the customer blocked?"}}},
    "choice": {
        "questions": {
            "team": {
                "type": "choice",
                "instructions": "Which team should take this?",
                "criteria": {"billing": "payments and refunds", "access": "logins", "other": None},
            }
        }
    },
    "score": {
        "questions": {
            "urgency": {"type": "score", "instructions": "How urgent is this?", "criteria": ["low", "medium", "high"]}
        }
    },
    "multi": {
        "questions": {
            "topics": {
                "type": "choice",
                "instructions": "Which topics does the ticket raise?",
                "criteria": {"billing": None, "access": None, "shipping": None},
                "multi": True,
            }
        }
    },
    "permute": {
        "questions": {
            "team": {
                "type": "choice",
                "instructions": "Which team should take this?",
                "criteria": {"billing": None, "access": None, "other": None},
                "permute": 3,
            }
        }
    },
    "abstained": {
        "questions": {
            "sure": {"type": "noul", "instructions": "Is it spam?", "abstain": {"min_confidence": 1.0}},
            "level": {"type": "score", "criteria": ["low", "high"], "abstain": {"min_label_mass": 1.0}},
            "pick": {"type": "choice", "criteria": {"yes": None, "no": None}, "abstain": {"min_confidence": 1.0}},
        }
    },
}


@pytest.fixture(scope="module")
def krite_python() -> str:
    """krite-bench's environment, as tools/setup.sh --tests makes it."""
    assert os.path.exists(KRITE), "krite-bench is not installed: run bash tools/setup.sh --tests (or --harnesses)"
    return KRITE


def krite_ask(python: str, url: str, requests: list[dict]) -> dict:
    """Each request asked through krite-bench's own client in its environment: {schema path, rows}."""
    port = urlparse(url).port
    done = subprocess.run(
        [python, "-c", KRITE_ASK], input=json.dumps([port, requests]), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def assert_valid(asked: dict, raw: list[dict]) -> None:
    """Every reply passed krite's client and schema, the schema is the installed package's own file, and blink's
    additions are in each raw reply's x_meta.answers (and would fail the schema inside an answer)."""
    own = os.path.realpath(os.path.join(ROOT, ".venv-krite"))  # krite resolves its package's path (a linked venv too)
    assert asked["schema"].startswith(own) and os.path.exists(asked["schema"])
    for row, reply in zip(asked["rows"], raw):
        assert row["status"] == 200 and row["error"] is None, row
        assert row.get("with_x_field_valid") in (None, False)  # the schema forbids a per-answer extra
        assert reply["x_meta"]["answers"].keys() == reply["answers"].keys()
        assert all(0 < extra["label_mass"] <= 1 for extra in reply["x_meta"]["answers"].values())
    assert any(row.get("with_x_field_valid") is False for row in asked["rows"])  # so the check can fail


def test_every_answer_kind_passes_krites_response_schema(launched, krite_python):
    import httpx

    _, url = launched
    requests = [{"state": TICKET, **r} for r in TEXT_REQUESTS.values()]
    asked = krite_ask(krite_python, url, requests)
    raw = [httpx.post(url + "v1/systemone", json={"model": "jev-latest", **r}, timeout=300).json() for r in requests]
    assert_valid(asked, raw)
    kinds = dict(zip(TEXT_REQUESTS, raw))
    assert kinds["multi"]["x_meta"]["answers"]["topics"]["multi"] is True
    assert kinds["permute"]["x_meta"]["answers"]["team"]["rotations"] == 3
    abstained = kinds["abstained"]["x_meta"]["answers"]
    assert all(abstained[k]["abstained"] is True for k in ("sure", "level", "pick"))
    by_type = {a["type"] for r in raw for a in r["answers"].values()}
    assert by_type == {"noul", "choice", "score"}


@pytest.fixture(scope="module")
def vision_url(tmp_path_factory):
    """app.py over a tiny native vision model (BLINK_VISION=1) in its own process: its url."""
    folder = tiny_models.build_qwen35_vision(tmp_path_factory.mktemp("harness-vision") / "Qwen3.5-4B")
    env = {"BLINK_MODEL": folder, "BLINK_VISION": "1"}
    with app_process(env, tmp_dir=str(tmp_path_factory.mktemp("harness-vision-log"))) as (url, _):
        yield url


def test_a_reply_with_images_passes_krites_response_schema(vision_url, krite_python):
    import httpx

    chart = png_uri(Image.new("RGB", (96, 64), (230, 20, 20))).split(",", 1)[1]
    request = {
        "state": {"note": "the chart", "chart": "<chart>"},
        "assets": {"<chart>": {"type": "image", "data_base64": chart}},
        "questions": {
            "color": {"type": "choice", "instructions": "Main color?", "criteria": {"red": None, "blue": None}},
            "dark": {"type": "noul", "instructions": "Is the chart dark?"},
            "fill": {"type": "score", "instructions": "How full is it?", "criteria": ["empty", "half", "full"]},
        },
    }
    assert base64.b64decode(chart)[:4] == b"\x89PNG"
    asked = krite_ask(krite_python, vision_url, [request])
    reply = httpx.post(vision_url + "v1/systemone", json={"model": "jev-latest", **request}, timeout=300).json()
    assert reply["x_meta"]["image_pixels"] > 0  # the image reached the model
    assert_valid(asked, [reply])


@pytest.fixture(scope="module")
def default_app(tmp_path_factory):
    """app.py as a user starts it: `python app.py`, no BLINK_* variable (blink at its defaults), on loopback."""
    with servers.app({}, str(tmp_path_factory.mktemp("harness-app"))) as server:
        assert server.down is None, f"{server.down}\n{servers.log_tail(server.log)}"
        yield server.url


def jevbench(*args: str, cwd: str) -> subprocess.CompletedProcess:
    """The jevbench command line, unmodified, from its own environment."""
    assert os.path.exists(JEVBENCH), "jevbench is not installed: run bash tools/setup.sh --tests (or --harnesses)"
    env = {k: v for k, v in os.environ.items() if k != "JEVBENCH_API_KEY"}
    return subprocess.run([JEVBENCH, *args], capture_output=True, text=True, timeout=HARNESS_S, cwd=cwd, env=env)


def test_jevbench_check_and_the_examples_suite_pass_against_the_app(default_app, tmp_path):
    endpoint = default_app + "v1/systemone"
    check = jevbench("check", "--url", endpoint, "--model", "jev-latest", cwd=str(tmp_path))
    assert check.returncode == 0 and "jevbench check: OK" in check.stdout, check.stdout + check.stderr
    report = tmp_path / "examples.json"
    run = jevbench(
        "eval", "--suite", "examples", "--url", endpoint, "--model", "jev-latest", "--concurrency", "1",
        "--cache-dir", str(tmp_path / "cache"), "--out", str(report), cwd=str(tmp_path),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr  # jevbench exits 1 on any refused or invalid answer
    scores = json.loads(report.read_text())["scores"]
    assert set(scores["pillars"]) == {"REP", "BAT", "MEA", "LOG", "CHO"}
    assert all(0 <= v <= 1 for v in scores["pillars"].values()) and 0 < scores["overall"] <= 1
    assert scores["pillars"]["BAT"] == 1.0  # an answer stays the same when the request's other questions change
    printed = re.search(r"^\s+BAT\s+([0-9.]+)\s", run.stdout, re.M)  # the table jevbench printed is the report's
    assert printed and float(printed.group(1)) == round(100 * scores["pillars"]["BAT"], 1)


def test_jevcompat_finds_the_app_conformant_with_its_key_required(tmp_path_factory):
    # jevcompat's conformance suite (its 48 requirements of the System One API, the official SDK's drop-in check
    # included), unmodified, against app.py with an API key, so its authentication checks run too (the one it then
    # skips, auth.ignored-when-off, is covered by the keyless apps above). A 255-option question can take minutes on
    # a loaded 2-core machine, past jevcompat's default 120 s.
    key = "jevcompat-test-key"
    with servers.app({"BLINK_API_KEY": key}, str(tmp_path_factory.mktemp("jevcompat-app"))) as server:
        assert server.down is None, f"{server.down}\n{servers.log_tail(server.log)}"
        report = tmp_path_factory.mktemp("jevcompat") / "report.json"
        done = subprocess.run(
            [JEVCOMPAT, "test", server.url.rstrip("/"), "--key", key, "--json", str(report), "--timeout", "600"],
            capture_output=True, text=True, timeout=HARNESS_S,
        )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]  # 0: conformant
    summary = json.loads(report.read_text())["summary"]
    assert summary["verdict"] == "conformant" and summary["untested_musts"] == []
    assert summary["MUST"]["failed"] == 0 and summary["SHOULD"]["failed"] == 0 and summary["SHOULD"]["skipped"] == 0
    status = {r["id"]: r["status"] for r in json.loads(report.read_text())["results"]}
    assert status["auth.bearer"] == status["auth.missing"] == status["auth.invalid"] == "pass"  # the key was required
    assert status["semantics.batching"] == "pass"  # other questions in the request do not change an answer


# krite's own loader and checks over the suites bench/krite.py writes: every case loads by its id, its request is a
# valid Protocol v1 request (the permute suites add blink's `permute` and nothing else), its bucket is krite's, and
# its gold is an index krite's runners can score
KRITE_SUITES = r"""
import json, sys
from pathlib import Path
import jsonschema
from krite_bench import data, runners
root, ids = Path(sys.argv[1]), sys.argv[2:]
request = jsonschema.Draft202012Validator(json.loads((data.SCHEMA_DIR / "request.schema.json").read_text()))
out = {}
for sid in ids:
    cases = data.load_suite(sid, root / "benchmarks" / "data")
    bad = []
    for c in cases:
        req = json.loads(json.dumps(c["request"]))
        permute = req["questions"]["q"].pop("permute", None)
        q = req["questions"]["q"]
        k = len(q.get("criteria") or []) or 2
        if not request.is_valid(req) or data.bucket(c["type"], k) != c["bucket"] or c["suite"] != sid:
            bad.append(c["case_id"])
        if (permute is not None) != sid.endswith("-permute") or permute not in (None, k):
            bad.append(c["case_id"])
        runners.gold_index(q, c["gold"]["q"])  # raises where the gold is not one of the options
    ks = sorted({len(c["request"]["questions"]["q"].get("criteria") or []) for c in cases})
    out[sid] = {"cases": len(cases), "bad": bad, "ks": ks}
print(json.dumps(out))
"""


def test_the_krite_suites_load_and_validate_with_krites_own_code(krite_python, tmp_path):
    from bench import krite

    written = krite.suites()
    assert not any(
        sid.split("-")[0] in {"agnews", "banking77", "massive", "boolq", "xnli", "sst5", "amazon"} for sid in written
    )
    krite.write_root(str(tmp_path), written)
    done = subprocess.run(
        [krite_python, "-c", KRITE_SUITES, str(tmp_path), *written], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert {sid: row["bad"] for sid, row in got.items()} == {sid: [] for sid in written}
    assert got["blink-clearcut-choice4"]["ks"] == [4] and got["blink-clearcut-choice8"]["ks"] == [8]
    assert got["blink-clearcut-choice8-permute"]["cases"] == got["blink-clearcut-choice8"]["cases"] == 48
