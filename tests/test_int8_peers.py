"""The int8 decision peers of `python -m bench run` on the stand-in: llama.cpp at Q8_0 and ONNX Runtime INT8, each fed
blink's prompt ids, answer as blink does on the float32 weights, within int8 rounding."""

from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest

import blink
from bench.lib import answers, workloads
from bench.peers import decision as peers
from bench.peers import llamacpp, onnxrt

STATE = "Ticket #1: the customer's router stopped working after an update and they asked for a replacement."
QUESTIONS = {
    "team": {
        "type": "choice",
        "instructions": "Which team should handle ticket #1?",
        "criteria": ["billing", "shipping", "technical support", "account security"],
    },
    "broken": {"type": "noul", "instructions": "Is the router broken?"},
}


def required(missing: bool, why: str) -> None:
    """A skip where the peer's package or environment is absent, a failure where CI says it must be there."""
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {why}")
        pytest.skip(why)


def peer_answers(standin: blink.TorchEngine, name: str) -> tuple[dict, dict, dict]:
    """(blink's answers, the arm's answers, what the arm says of its work) on one request, the arm started as the
    benchmark starts it."""
    want = blink.Deployment.serving(standin).decide(STATE, QUESTIONS)["answers"]
    with contextlib.ExitStack() as stack:  # the arm's process ends with it
        pipes, skipped = peers.start_peers(peers.PeerContext(standin, 1, "", stack), [name])
        assert skipped == [] and list(pipes) == [name]
        arm = pipes[name]
        got = arm(workloads.system_one(STATE, QUESTIONS))
        return want, got, {"dtype": arm.dtype, "evaluated": arm.evaluated, "cpu_s": arm.elsewhere_cpu()}


def test_llama_cpp_q8_0_answers_as_blink_does(standin):
    required(importlib.util.find_spec("llama_cpp") is None, llamacpp.SKIP_NO_PACKAGE)
    want, got, arm = peer_answers(standin, "llama.cpp_q8_0")
    compared = answers.compare(want, got)
    # Q8_0 rounds the activations as well as the weights, by kernels that differ between CPUs: 0.067 from blink's
    # float32 measured on an AVX2 CPU, 0.078 from its bfloat16 in decision-int8-2threads.json; a wrong prompt, label
    # or model moves far more
    assert compared["picks_differ"] == [] and compared["max_prob_diff"] < 0.12
    assert arm["dtype"] == "q8_0" and arm["evaluated"] > 0 and arm["cpu_s"] > 0


def test_onnxruntime_int8_answers_as_blink_does(standin):
    required(not os.path.exists(onnxrt.ONNX_PYTHON), onnxrt.SKIP_NO_ENV)
    want, got, arm = peer_answers(standin, "onnxruntime_int8")
    compared = answers.compare(want, got)
    # per-tensor int8 weights and activations, by kernels that differ between CPUs: 0.155 measured on AVX-512 VNNI,
    # 0.267 on an AVX2 CPU, up to 0.38 over decision-int8-2threads.json's requests; the picks must agree
    assert compared["picks_differ"] == [] and compared["max_prob_diff"] < 0.45
    assert arm["dtype"] == "int8" and arm["evaluated"] > 0 and arm["cpu_s"] > 0  # computed in its worker process
