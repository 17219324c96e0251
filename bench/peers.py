"""The systems a user would pick instead of blink, on the same model: transformers' `pipeline("decision")` (its own
prompt, and blink's prompt through an exported DecisionConfig once `python blink.py export` exists),
`transformers serve` `/v1/systemone` against blink's own `/v1/systemone` over HTTP (vLLM has an arm of its own,
bench/vllm_check.py). An arm whose system is missing here is skipped with the reason, never faked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import arms
import clock
import throughput
import torch
import workloads

import blink

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------------------------
# Requests as the System One API (and transformers' decision pipeline) take them
# ---------------------------------------------------------------------------------------------------------------


def system_one_question(q: dict) -> dict:
    """One blink question in System One form: list criteria become {option: null}, yes/no noul keys true/false,
    blink's opt-in fields (permute, multi, abstain) are dropped (they do not travel)."""
    out = {"type": q["type"]}
    if q.get("instructions") is not None:
        out["instructions"] = q["instructions"]
    crit = q.get("criteria")
    if q["type"] == "choice" and isinstance(crit, list):
        crit = {str(k): None for k in crit}
    elif q["type"] == "noul" and isinstance(crit, dict):
        crit = {"true": crit.get("true", crit.get("yes")), "false": crit.get("false", crit.get("no"))}
    if crit is not None:
        out["criteria"] = crit
    return out


def system_one(state, questions: dict) -> dict:
    """A whole request in System One form."""
    return {"state": state, "questions": {k: system_one_question(q) for k, q in questions.items()}}


def pick(answer: dict) -> str:
    """The option an answer chose (a noul: yes when p(yes) > 1/2), in blink's and System One's shapes alike."""
    if answer["type"] == "noul":
        return "yes" if answer["noul"] > 0.5 else "no"
    probs = answer["probabilities"]
    keys = list(probs)
    return keys[max(range(len(keys)), key=lambda i: (probs[keys[i]], -i))]


# ---------------------------------------------------------------------------------------------------------------
# pipeline("decision")
# ---------------------------------------------------------------------------------------------------------------


def decision_pipeline(engine: blink.TorchEngine, config=None, model=None):
    """transformers' decision pipeline on the engine's weights as a user loads them (arms.user_model) or on `model`,
    with a tokenizer of its own (the pipeline adds its mark/split tokens to the tokenizer it is given, which would
    change how blink tokenizes those strings).
    config: a DecisionConfig or its folder (decision.json + decision_template.jinja); None: its built-in prompt."""
    from transformers import AutoTokenizer, pipeline

    tok = AutoTokenizer.from_pretrained(engine.source)
    kwargs = {"decision_config": config} if config else {}
    model = model if model is not None else arms.user_model(engine)
    return pipeline("decision", model=model, tokenizer=tok, device=model.device, **kwargs)


def same_dtype_pipelines(engine: blink.TorchEngine) -> dict:
    """Where blink computes in another dtype than a user's load (bfloat16 on a CPU that computes it natively), the
    pipeline with its own prompt on blink's own model as well ("pipeline_bfloat16"): the same dtype and kernels on
    both sides, so its ratio is what batching and shared prefixes alone are worth. Else none."""
    if engine.model.dtype == arms.user_model(engine).dtype:
        return {}
    return {f"pipeline_{arms.dtype_name(engine.model.dtype)}": decision_pipeline(engine, model=engine.model)}


def export_config(model: str, folder: str) -> str | None:
    """blink's prompt as a transformers DecisionConfig, written by `python blink.py export FOLDER --model MODEL`;
    None (and why) when this blink has no export command or it failed."""
    cmd = [sys.executable, os.path.join(ROOT, "blink.py"), "export", folder, "--model", model]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`python blink.py export` did not finish: {exc}"
    if done.returncode or not os.path.exists(os.path.join(folder, "decision.json")):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"`python blink.py export` is not available here ({last[:160]})"
    return None


# ---------------------------------------------------------------------------------------------------------------
# The three cases a user meets first: many questions over a document, the same document again, one short question
# ---------------------------------------------------------------------------------------------------------------


def case_requests(engine: blink.TorchEngine, cfg: dict, rep: int) -> dict[str, tuple]:
    """The requests of one repetition: a document not seen before with `questions` questions ("document"), the same
    document with as many new questions ("again"), and one short yes/no question over a short new text ("short")."""
    doc = workloads.document(engine.tok, cfg["doc"], seed=1000 + rep)
    n = workloads.ticket_count(doc)
    first = workloads.questions(cfg["questions"], cfg["options"], n)
    again = {
        f"r{k}": {**q, "instructions": q["instructions"].replace("Which team", "What team, in your view,")}
        for k, q in workloads.questions(cfg["questions"], cfg["options"], n).items()
    }
    short = (
        f"Order {4100 + rep}: I was charged twice for the same order and want my money back.",
        {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}},
    )
    return {"document": (doc, first), "again": (doc, again), "short": short}


CASES = ("document", "again", "short")


def decision_cases(engine: blink.TorchEngine, cfg: dict, pipes: dict) -> dict:
    """blink at its defaults (a Deployment serving the engine) against each pipeline arm on the three cases,
    interleaved per repetition so both sides see the same machine; plus every blink answer of the first repetition
    against the cold, unbatched path (each question alone, by hand)."""
    dep = blink.Deployment.serving(engine)
    dep.decide("warm-up", {"w": {"type": "noul"}})
    for pipe in pipes.values():
        pipe(system_one("warm-up", {"w": {"type": "noul"}}))
    times: dict = {case: {arm: [] for arm in ("blink", *pipes)} for case in CASES}
    answers: dict = {}
    first: dict = {}  # the first repetition's requests, checked against the unbatched path below
    for rep in range(cfg["reps"]):
        requests = case_requests(engine, cfg, rep)
        first = first or requests
        for case in CASES:  # "again" follows "document": its document is the one blink has just seen
            state, questions = requests[case]
            for name, pipe in pipes.items():
                elsewhere = getattr(pipe, "elsewhere_cpu", lambda: 0.0)  # an HTTP peer's server processes
                before = elsewhere()
                wall, cpu, out = clock.timed(lambda: pipe(system_one(state, questions)))  # noqa: B023 (called at once)
                times[case][name].append((wall, cpu + elsewhere() - before))
                answers.setdefault((rep, case, name), out)
            wall, cpu, out = clock.timed(lambda: dep.decide(state, questions))  # noqa: B023 (called at once)
            times[case]["blink"].append((wall, cpu))
            answers[(rep, case, "blink")] = out
    rows = {}
    for case in CASES:
        state, questions = first[case]
        meta = answers[(0, case, "blink")]["meta"]
        row = {
            "questions": len(questions),
            "prompt_tokens": meta["input_tokens"],
            "prefill_tokens": meta["prefill_tokens"],
            "cached_tokens": meta["cached_tokens"],
            "arms": {},
        }
        for arm, runs in times[case].items():
            row["arms"][arm] = {
                "wall_s": [round(w, 4) for w, _ in runs],
                "cpu_s": [round(c, 4) for _, c in runs],
                "total_wall_s": round(sum(w for w, _ in runs), 4),
                "total_cpu_s": round(sum(c for _, c in runs), 4),
            }
        for name in pipes:
            row[f"vs_{name}"] = {
                "wall": ratio(row["arms"], name, "total_wall_s"),
                "cpu": ratio(row["arms"], name, "total_cpu_s"),
                "per_rep_wall": [round(p[0] / b[0], 2) for p, b in zip(times[case][name], times[case]["blink"])],
                "picks_differ_from_blink": sorted(
                    k
                    for k, a in answers[(0, case, name)].items()
                    if pick(a) != pick(answers[(0, case, "blink")]["answers"][k])
                ),
            }
        row["vs_unbatched"] = against_unbatched(engine, state, questions, answers[(0, case, "blink")]["answers"])
        rows[case] = row
    return rows


def ratio(arms_: dict, peer: str, clock: str) -> float:
    """How many times faster blink answered than the peer over all repetitions (> 1: blink faster)."""
    return round(arms_[peer][clock] / arms_["blink"][clock], 2) if arms_["blink"][clock] > 0 else float("nan")


def against_unbatched(engine: blink.TorchEngine, state, questions: dict, got: dict) -> dict:
    """blink's answers against each question's prompt run alone through the plain model: the picks that differ and
    the largest probability difference."""
    differ, gap = [], 0.0
    for key, q in questions.items():
        ref = arms.unbatched_one(engine, state, key, q)
        probs = blink.softmax(ref.rows[key], 1.0)
        keys = [o.key for o in blink.parse_question(key, q).rows[0].shown]
        mine = got[key]["probabilities"]
        gap = max(gap, max(abs(mine[k] - p) for k, p in zip(keys, probs)))
        if ref.choices[key] != pick(got[key]):
            differ.append(key)
    return {"compared": len(questions), "differ": differ, "max_prob_diff": gap}


# ---------------------------------------------------------------------------------------------------------------
# Over HTTP: transformers serve /v1/systemone against blink's /v1/systemone
# ---------------------------------------------------------------------------------------------------------------


def _child_env(threads: int) -> dict:
    """The environment of a server the bench starts: no BLINK_* variables (defaults), the bench's thread count,
    no hub access."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLINK_")}
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_UPDATE_CHECK="1",
        GRADIO_ANALYTICS_ENABLED="False",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def wait_up(url: str, proc: subprocess.Popen, timeout_s: float) -> str | None:
    """None once GET url answers; else why not (the process ended, or it took too long)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"the server exited with status {proc.returncode}"
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return f"the server did not answer within {timeout_s:.0f} s"


@contextlib.contextmanager
def process(cmd: list[str], threads: int, log: str, env: dict | None = None) -> Iterator[subprocess.Popen]:
    """A process the bench starts (its output to `log`), in a process group of its own, for the duration; then
    stopped with whatever it started."""
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**_child_env(threads), **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        stop_group(proc)


@contextlib.contextmanager
def server(
    cmd: list[str], health: str, threads: int, log: str, env: dict | None = None, timeout_s: float = 300
) -> Iterator[str | None]:
    """A server process for the duration: yields None when it is up, else why it is not; then stopped with its group."""
    with process(cmd, threads, log, env) as proc:
        yield wait_up(health, proc, timeout_s)


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a process started with start_new_session=True and everything in its process group (vLLM's engine core
    and worker outlive a server stopped alone)."""
    for sig, wait_s in ((signal.SIGINT, 30), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the group is gone already
            return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone; what it started may not be
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return


def transformers_serve_cmd(folder: str, port: int, config_json: str | None) -> list[str] | str:
    """The `transformers serve` command for the model folder (bfloat16 on a GPU, as blink), or why it cannot run
    here."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        return "transformers serve needs its serving extras (pip install 'transformers[serving]': openai)"
    cli = os.path.join(os.path.dirname(sys.executable), "transformers")
    device = ["--device", "cuda", "--dtype", "bfloat16"] if torch.cuda.is_available() else ["--device", "cpu"]
    cmd = [cli, "serve", folder, *device, "--host", "127.0.0.1", "--port", str(port)]
    return cmd + (["--decision-config", config_json] if config_json else [])


def serve_config(export_dir: str) -> str:
    """transformers serve reads --decision-config as JSON only: the export's decision_serve.json (decision.json with
    the template embedded), which `python blink.py export` always writes."""
    return os.path.join(export_dir, "decision_serve.json")


def http_requests(engine: blink.TorchEngine, n: int, doc_tokens: int) -> list[dict]:
    """n System One requests, each one choice question over its own short ticket log."""
    out = []
    for i in range(n):
        doc = workloads.document(engine.tok, doc_tokens, seed=500 + i)
        out.append(system_one(doc, workloads.questions(1, 4, workloads.ticket_count(doc))))
    return out


def http_drive(url: str, model: str, requests: list[dict], clients: int, per_client: int) -> dict:
    """`clients` threads, each with its own HTTP connection, posting System One requests back to back."""
    import httpx

    conns = [httpx.Client(timeout=600) for _ in range(clients)]

    def call(c: int, r: int) -> dict:
        body = {"model": model, **requests[(c * per_client + r) % len(requests)]}
        got = conns[c].post(url, json=body)
        got.raise_for_status()
        return got.json()

    try:
        call(0, 0)  # answers at all, and warm, before the clock starts
        row = throughput.drive(call, clients, per_client)
        row.pop("mean_batched_requests")  # a System One answer has no meta to read it from
        return row
    finally:
        for conn in conns:
            conn.close()


def http_rows(engine: blink.TorchEngine, cfg: dict, threads: int, export_dir: str | None, log_dir: str) -> list[dict]:
    """Both servers up side by side (idle while the other is measured), each concurrency level measured on one then
    the other; a server that cannot run here is one row saying why."""
    requests = http_requests(engine, cfg["requests"], cfg["doc"])
    t_port, b_port = throughput.free_port(), throughput.free_port()
    t_cmd = transformers_serve_cmd(engine.source, t_port, serve_config(export_dir) if export_dir else None)
    b_cmd = [sys.executable, os.path.join(ROOT, "app.py")]
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        targets = {}
        if isinstance(t_cmd, str):
            rows.append({"target": "transformers serve /v1/systemone", "skipped": t_cmd})
        else:
            why = stack.enter_context(
                server(
                    t_cmd, f"http://127.0.0.1:{t_port}/health", threads, os.path.join(log_dir, "transformers-serve.log")
                )
            )
            if why:
                rows.append({"target": "transformers serve /v1/systemone", "skipped": why})
            else:
                targets["transformers serve /v1/systemone"] = (f"http://127.0.0.1:{t_port}/v1/systemone", engine.source)
        why = stack.enter_context(
            server(
                b_cmd,
                f"http://127.0.0.1:{b_port}/",
                threads,
                os.path.join(log_dir, "blink-app.log"),
                {"GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(b_port), "BLINK_MODEL": engine.model_id},
            )
        )  # the same model; nothing else set
        if why is None:
            why = systemone_probe(f"http://127.0.0.1:{b_port}/v1/systemone", engine.model_id, requests[0])
        if why:
            rows.append({"target": "blink /v1/systemone", "skipped": why})
        else:
            targets["blink /v1/systemone"] = (f"http://127.0.0.1:{b_port}/v1/systemone", engine.model_id)
        for clients in cfg["clients"]:
            per_client = max(1, cfg["per_level"] // clients)
            for name, (url, model) in targets.items():
                try:
                    row = http_drive(url, model, requests, clients, per_client)
                except Exception as exc:  # noqa: BLE001 - the server's failure, reported in its row
                    row = {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
                rows.append({"target": name, "clients": clients, **row})
    return rows


def systemone_probe(url: str, model: str, body: dict) -> str | None:
    """None when the server answers a System One request; else why not (no such route in this blink yet)."""
    import httpx

    try:
        got = httpx.post(url, json={"model": model, **body}, timeout=600)
    except httpx.HTTPError as exc:
        return f"{url} did not answer: {exc}"
    if got.status_code in (404, 405):
        return "this blink's app has no /v1/systemone route"
    if got.status_code != 200:
        return f"{url} answered {got.status_code}: {got.text[:200]}"
    return None


# ---------------------------------------------------------------------------------------------------------------
# vLLM: an arm of its own (bench/vllm_check.py), as vLLM runs in an environment of its own
# ---------------------------------------------------------------------------------------------------------------


def vllm_row() -> dict:
    """Where vLLM's throughput lives: vLLM pins a transformers blink's torch engine does not run on, so it cannot
    share this process; bench/vllm_check.py runs both backends as servers side by side (the decision cases run it
    as the arm blink_vllm, bench/vllm_arm.py)."""
    return {
        "target": "vLLM",
        "skipped": "throughput in an arm of its own: python bench/vllm_check.py (blink on vLLM "
        "against blink on torch, bench/results/vllm-cpu.json)",
    }


def with_export(model: str, fn: Callable[[str | None, str | None], object]):
    """fn(export folder or None, why there is none) inside a temporary folder holding blink's exported config."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "export")
        why = export_config(model, folder)
        return fn(None if why else folder, why)
