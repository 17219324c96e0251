"""The command line: decide from files or inline JSON, clear errors, record a real recording."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import blink
from adapters import record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """python blink.py ARGS, as a user runs it."""
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "blink.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_cli_decides_from_a_file_and_inline_json(tmp_path, standin, served):
    evidence = {"ticket": "My card was charged twice", "plan": "pro"}
    state = tmp_path / "state.json"
    state.write_text(json.dumps(evidence))
    qs = '{"billing": {"type": "noul", "instructions": "Is this a billing problem?"}}'
    done = run("--state", str(state), "--questions", qs)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["meta"]["model"] == blink.STANDIN_MODEL and out["meta"]["engine"] == "torch"  # a live model answers
    # the file was read as the JSON object it holds, and the answer is the one the engine gives in process
    want = served(standin).decide(evidence, json.loads(qs))
    assert out["meta"]["input_tokens"] == want["meta"]["input_tokens"]
    assert abs(out["answers"]["billing"]["noul"] - want["answers"]["billing"]["noul"]) < 1e-5


def test_cli_errors_are_one_clear_line(tmp_path):
    done = run("--state", "x", "--questions", '{"q": {"type": "score", "criteria": [1]}}', env={"BLINK_MOCK": "1"})
    assert done.returncode == 2
    assert done.stderr.strip() == "error: question 'q': a score takes a list of 2 to 10 levels"
    done = run("--state", "x", "--questions", "{broken", env={"BLINK_MOCK": "1"})
    assert done.returncode == 2 and done.stderr.startswith("error: questions is not valid JSON")
    assert "Traceback" not in done.stderr


def test_cli_on_off_variables_take_exactly_the_documented_words():
    qs = '{"q": {"type": "noul"}}'
    done = run("--state", "x", "--questions", qs, env={"BLINK_MOCK": "YES"})  # any case
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["meta"]["engine"] == "mock"
    done = run("--state", "x", "--questions", qs, env={"BLINK_MOCK": "maybe"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "error: BLINK_MOCK must be 1/0, true/false, yes/no or on/off (got 'maybe')"


def test_record_writes_a_stamped_recording_that_replays(tmp_path, monkeypatch):
    examples = tmp_path / "examples"
    examples.mkdir()
    example = {
        "name": "t",
        "state": "The parcel arrived crushed.",
        "questions": {"ok": {"type": "noul", "instructions": "Did the parcel arrive intact?"}},
    }
    (examples / "t.json").write_text(json.dumps(example))
    out = tmp_path / "replay.json"
    monkeypatch.setattr(blink, "EXAMPLES_DIR", str(examples))  # a module constant, not a setting: no other way in
    settings = blink.Settings()
    data = record.record(blink.STANDIN_MODEL, str(out), settings=settings)
    assert data["model"] == blink.STANDIN_MODEL and "CPU" in data["hardware"]
    rec = blink.ReplayEngine(str(out), model_id=blink.STANDIN_MODEL, settings=settings)
    result = rec.forward(blink.parse_request(example["state"], example["questions"], settings=settings))
    raw, n_tokens = result.readouts, result.input_tokens
    assert result.source == "recording" and result.engine == "replay"
    assert n_tokens > 50 and len(raw["ok"].logits) == 1 and len(raw["ok"].logits[0]) == 2
    entry = next(iter(data["requests"].values()))
    assert entry["example"] == "t.json" and entry["latency_ms"] > 0
