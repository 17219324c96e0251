"""Faults at the app level: a deployment that cannot serve refuses to start with one line naming the problem; a dead
batching worker gives its caller a clear error at once and the next caller is served."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import subprocess
import sys
import threading

import pytest
import tiny_models
from gradio_client.exceptions import AppError

import blink

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_deployment_that_cannot_serve_refuses_to_start(tmp_path):
    recording = json.loads(pathlib.Path(blink.Settings().replay_path).read_text())  # the bundled replay.json
    corrupt, foreign, malformed = tmp_path / "corrupt.json", tmp_path / "foreign.json", tmp_path / "malformed.json"
    corrupt.write_text('{"model": "x", "requests": {')
    foreign.write_text(json.dumps({**recording, "model": "someone/else"}))
    key = next(iter(recording["requests"]))
    entry = {**recording["requests"][key], "logits": {"q": ["not a number"]}}
    malformed.write_text(json.dumps({**recording, "requests": {**recording["requests"], key: entry}}))
    labels = tiny_models.build_letterless_tokenizer(tmp_path / "no-letters")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLINK_")}
    default = blink.Settings.from_env(env).default_model  # the model app.py serves with no BLINK_MODEL set
    cases = [  # (environment, what the one line must say)
        ({"BLINK_ENGINE": "replay", "BLINK_REPLAY": str(corrupt)}, f"recording {corrupt} cannot be read"),
        (
            {"BLINK_ENGINE": "replay", "BLINK_REPLAY": str(foreign)},
            f"recording {foreign} was made by someone/else, not by the served model {default}",
        ),
        ({"BLINK_REPLAY": str(malformed)}, f"recording {malformed} has a malformed entry {key!r}"),
        ({"BLINK_ENGINE": "torch", "BLINK_MODEL": labels}, "verified single-token labels; A..Z must all verify"),
    ]
    for pair in (cases[:2], cases[2:]):  # two at a time, one per core, each start with its own deadline
        procs = [
            subprocess.Popen(
                [sys.executable, "app.py"],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**env, "GRADIO_ANALYTICS_ENABLED": "False", **extra},
            )
            for extra, _ in pair
        ]
        for proc, (extra, message) in zip(procs, pair):
            assert_refuses(proc, extra, message, extra.get("BLINK_MODEL", default))


def assert_refuses(proc: subprocess.Popen, extra: dict, message: str, served: str) -> None:
    """app.py stopped with status 1 and one last line naming the served model and the problem, no traceback."""
    try:
        # a refusing start ends once it has imported Gradio and read its settings; the deadline only stops a start
        # that never ends
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"app.py with {extra} did not stop: it should refuse to start")
    assert proc.returncode == 1, (extra, out[-2000:], err[-2000:])
    assert "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"blink: cannot serve {served}: ") and message in line, line


def test_a_foreign_recording_is_not_served_and_says_so(launched, tmp_path, caplog):
    """The app's deployment, given a recording another model made, has none (its presets run live) and logs why."""
    app, _ = launched
    other = tmp_path / "replay.json"
    other.write_text(
        json.dumps({**json.loads(pathlib.Path(app.SETTINGS.replay_path).read_text()), "model": "someone/else"})
    )
    dep = blink.Deployment(dataclasses.replace(app.SETTINGS, replay_path=str(other)))
    with caplog.at_level(logging.WARNING, logger="blink"):
        assert dep.recording() is None
    model = app.DEPLOYMENT.default_model
    assert f"{other} was recorded by someone/else, not by the served model {model}" in caplog.text
    assert dep.engine_kind() == "torch"  # the stand-in runs its presets live


def test_a_dead_batching_worker_is_a_clear_error_and_the_next_caller_is_served(launched, client, monkeypatch):
    app, _ = launched

    class Crash(BaseException):
        """Something that kills the worker thread outright."""

    question = {"urgent": {"type": "noul", "instructions": "Is this urgent?"}}
    batcher = app.DEPLOYMENT.batcher()  # the default model's Batcher, the one /decide queues live requests on
    real = batcher.run
    crashes = [Crash()]

    def dying(jobs):
        if crashes:
            raise crashes.pop()
        return real(jobs)

    restarts = batcher.restarts
    monkeypatch.setattr(batcher, "run", dying)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the dying thread's report is expected
    with pytest.raises(AppError) as err:
        client.submit("The server room is flooding.", question, api_name="/decide").result(timeout=120)
    assert "the model failed on this request (RuntimeError)" in err.value.message
    got = client.submit("The server room is flooding.", question, api_name="/decide").result(timeout=120)
    want = app.DEPLOYMENT.decide("The server room is flooding.", question)  # the same request, in process
    assert (
        got["meta"]["engine"] == "torch"
        and abs(got["answers"]["urgent"]["noul"] - want["answers"]["urgent"]["noul"]) < 1e-5
    )
    assert batcher.restarts == restarts + 1 and batcher.alive()
