"""The vLLM arm: blink on vLLM against blink on torch, on one model, side by side in one run, over HTTP.

    python bench/vllm_check.py [--model ID] [--requests 40] [--threads 1] [--out bench/results/vllm-cpu.json]

Runs where the vLLM environment exists (.venv-vllm, built by `bash tools/setup.sh --vllm`: vLLM pins its own torch
and transformers, so blink on vLLM runs there and blink on torch in .venv, where this script runs). Without it, it
prints why and exits 0: skipped, nothing measured.

Four `python app.py` servers on the same model, started side by side and each idle while another is measured: blink
on torch in float32 and in bfloat16 (.venv), blink on vLLM (BLINK_BACKEND=vllm) in float32 and in bfloat16
(.venv-vllm). Beside them vLLM's own server (`python -m vllm.entrypoints.openai.api_server`: vllm-cpu 0.32's `vllm`
command cannot find its own version, its distribution being named vllm-cpu) with raw log-probs.

1. Answers: the same generated System One requests (every question type, structured descriptions, unicode, JSON
   evidence, a 200-option choice that vLLM reads in two runs of label ids) through each blink server's
   /v1/systemone. Per arm against blink on torch in float32: the largest probability gap (p(yes) for a noul) and
   every pick that differs, with how far torch's own top two stood apart. This is the bfloat16 gap the dtype rule
   rests on.
2. Throughput: bench/run.py's HTTP workload (one choice over a ~120-token ticket log per request) at 1, 8 and 32
   concurrent clients (peers.http_drive): requests/s and latency per arm, and each arm's ratio to torch float32.
3. vLLM's own decision route: /v1/systemone with its own fixed prompt. Driven like the others where it answers;
   else its answer is recorded (vllm-cpu 0.32 serves the route only for the architectures of its READ_STRATEGIES:
   Qwen3ForCausalLM, Qwen3_5ForConditionalGeneration, ...; a Llama model such as the stand-in gets 501).

Writes the results as JSON and prints a summary; exits 1 when an arm could not answer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import peers  # noqa: E402
import saved  # noqa: E402
import systemone_requests  # noqa: E402
import throughput  # noqa: E402
from run import HTTP  # noqa: E402
from vllm_arm import VLLM_PYTHON, missing, vllm_args, vllm_env  # noqa: E402

import blink  # noqa: E402

REFERENCE = "blink torch float32"  # what every arm's answers and speed are compared with
# (arm, python, BLINK_BACKEND, BLINK_DTYPE); the reference first
ARMS = (
    (REFERENCE, sys.executable, "torch", "float32"),
    ("blink torch bfloat16", sys.executable, "torch", "bfloat16"),
    ("blink vLLM float32", VLLM_PYTHON, "vllm", "float32"),
    ("blink vLLM bfloat16", VLLM_PYTHON, "vllm", "bfloat16"),
)
OWN_ROUTE = "vLLM's own /v1/systemone"
START_S = 900  # three vLLM engines and two torch apps start side by side on a small machine


def workload(count: int, seed: int = 7) -> list[dict]:
    """The requests every arm answers: generated ones plus one choice with 200 options (two vLLM requests)."""
    wide = {"type": "choice", "instructions": "Which code fits?", "criteria": {f"code {i}": None for i in range(200)}}
    return systemone_requests.requests(count - 1, seed) + [{"state": "ticket 4417: refund", "questions": {"w": wide}}]


def app_env(model: str, backend: str, dtype: str, port: int, engine_args: dict) -> dict:
    """The environment of one blink server: the model, backend and dtype, the port; nothing else of blink's set."""
    env = {
        "GRADIO_SERVER_NAME": "127.0.0.1",
        "GRADIO_SERVER_PORT": str(port),
        "BLINK_MODEL": model,
        "BLINK_BACKEND": backend,
        "BLINK_DTYPE": dtype,
    }
    return {**env, "BLINK_VLLM_ARGS": json.dumps(engine_args), **vllm_env()} if backend == "vllm" else env


def own_route_cmd(folder: str, port: int, max_model_len: int) -> list[str]:
    """vLLM's own OpenAI-compatible server on the model folder, with raw log-probs (its decision route needs them)."""
    eager = [] if blink.cuda_available() else ["--enforce-eager"]
    return [
        VLLM_PYTHON,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        folder,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--logprobs-mode",
        "raw_logprobs",
        "--max-model-len",
        str(max_model_len),
        *eager,
        *(["--gpu-memory-utilization", "0.3"] if blink.cuda_available() else []),
    ]


def probabilities(answer: dict) -> dict[str, float]:
    """A System One answer's distribution: its probabilities, or p(yes) and p(no) for a noul."""
    if answer["type"] == "noul":
        return {"yes": answer["noul"], "no": 1.0 - answer["noul"]}
    return answer["probabilities"]


def top_gap(probs: dict[str, float]) -> float:
    """How far the best option stands above the second (1 for a single option)."""
    p = sorted(probs.values(), reverse=True)
    return p[0] - p[1] if len(p) > 1 else 1.0


def answers_of(url: str, model: str, requests: list[dict]) -> list[dict]:
    """Each request's System One answers from one server, one request at a time."""
    import httpx

    with httpx.Client(timeout=600) as http:
        out = []
        for req in requests:
            got = http.post(url, json={"model": model, **req})
            got.raise_for_status()
            out.append(got.json()["answers"])
        return out


def compare(reference: list[dict], other: list[dict]) -> dict:
    """Another arm's answers against the reference's: the largest probability gap, and each pick that differs with
    how far the reference's own top two stood apart."""
    gap, questions, differ = 0.0, 0, []
    for i, (ours, theirs) in enumerate(zip(reference, other)):
        for key, answer in ours.items():
            questions += 1
            a, b = probabilities(answer), probabilities(theirs[key])
            gap = max(gap, *(abs(a[k] - b[k]) for k in a))
            if peers.pick(answer) != peers.pick(theirs[key]):
                differ.append(
                    {
                        "request": i,
                        "question": key,
                        "reference": peers.pick(answer),
                        "arm": peers.pick(theirs[key]),
                        "reference_top_gap": round(top_gap(a), 6),
                    }
                )
    return {"questions": questions, "max_abs_probability_gap": gap, "picks_differ": differ}


def vllm_version() -> str:
    """The vLLM version installed in the vLLM environment."""
    done = subprocess.run(
        [VLLM_PYTHON, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return done.stdout.strip() or done.stderr.strip()[-200:]


def start_all(stack: contextlib.ExitStack, model: str, threads: int, max_model_len: int, logs: str) -> dict:
    """Every server up side by side: {target: (url, model name) or a reason it is not up}."""
    folder = blink.model_source(model, blink.Settings().cache_dir)
    waiting = {}
    for name, python, backend, dtype in ARMS:
        port = throughput.free_port()
        cmd = [python, os.path.join(ROOT, "app.py")]
        env = app_env(model, backend, dtype, port, vllm_args(max_model_len))
        log = os.path.join(logs, name.replace(" ", "-") + ".log")
        waiting[name] = (f"http://127.0.0.1:{port}", model, cmd, env, log)
    port = throughput.free_port()
    waiting[OWN_ROUTE] = (
        f"http://127.0.0.1:{port}",
        folder,
        own_route_cmd(folder, port, max_model_len),
        vllm_env(),
        os.path.join(logs, "vllm-serve.log"),
    )
    # every process is started before the first is waited for: the engines start side by side
    procs = {
        name: stack.enter_context(peers.process(cmd, threads, log, env))
        for name, (_, _, cmd, env, log) in waiting.items()
    }
    starting = {
        name: peers.wait_up(waiting[name][0] + ("/health" if name == OWN_ROUTE else "/"), proc, START_S)
        for name, proc in procs.items()
    }
    up = {}
    for name, why in starting.items():
        base, served, *_ = waiting[name]
        url = base + "/v1/systemone"
        up[name] = why or peers.systemone_probe(url, served, workload(2)[0]) or (url, served)
    return up


def main(argv: list[str] | None = None) -> int:
    """Start every server, measure answers then throughput, write the results file, print a summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=blink.STANDIN_MODEL, help="a model both backends load (hub id or folder)")
    parser.add_argument("--requests", type=int, default=40, help="generated requests for the answers part")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of every server (vLLM binds one core)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--out", default=None, help="default: bench/results/vllm-<cpu|cuda>.json")
    args = parser.parse_args(argv)
    why = missing()
    if why:
        print(f"skipped: the vLLM arm needs the vLLM environment ({why}); nothing was measured")
        return 0
    out = args.out or os.path.join(HERE, "results", f"vllm-{'cuda' if blink.cuda_available() else 'cpu'}.json")
    started = time.perf_counter()
    load0 = os.getloadavg()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(blink.model_source(args.model, blink.Settings().cache_dir))
    http_requests = peers.http_requests(SimpleNamespace(tok=tokenizer), HTTP["requests"], HTTP["doc"])
    parity_requests = workload(args.requests)
    logs = tempfile.mkdtemp(prefix="blink-bench-vllm-")
    print(f"server logs in {logs}", flush=True)
    with contextlib.ExitStack() as stack:
        up = start_all(stack, args.model, args.threads, args.max_model_len, logs)
        print(
            f"servers up after {time.perf_counter() - started:.0f} s: "
            + "; ".join(f"{k}: {'up' if isinstance(v, tuple) else v}" for k, v in up.items()),
            flush=True,
        )
        blink_arms = {name: up[name] for name, *_ in ARMS if isinstance(up[name], tuple)}
        answers = {name: answers_of(url, served, parity_requests) for name, (url, served) in blink_arms.items()}
        parity = {name: compare(answers[REFERENCE], got) for name, got in answers.items() if name != REFERENCE}
        for name, row in parity.items():
            print(
                f"answers {name}: max |dp| {row['max_abs_probability_gap']:.2e} vs {REFERENCE} on "
                f"{row['questions']} questions, {len(row['picks_differ'])} picks differ",
                flush=True,
            )
        driven = {name: target for name, target in up.items() if isinstance(target, tuple)}
        serving = []
        for clients in HTTP["clients"]:
            per_client = max(1, HTTP["per_level"] // clients)
            for name, (url, served) in driven.items():
                row = peers.http_drive(url, served, http_requests, clients, per_client)
                serving.append({"target": name, **row})
                print(
                    f"{clients:>3} clients {name}: {row['requests_per_s']} req/s, p50 {row['p50_ms']} ms, "
                    f"p99 {row['p99_ms']} ms",
                    flush=True,
                )
    base = {r["clients"]: r["requests_per_s"] for r in serving if r["target"] == REFERENCE}
    for row in serving:
        row[f"vs_{REFERENCE.replace(' ', '_')}"] = (
            round(row["requests_per_s"] / base[row["clients"]], 2) if base.get(row["clients"]) else None
        )
    import torch

    result = {
        "model": args.model,
        "hardware": blink.hardware(),
        "threads": args.threads,
        "torch": torch.__version__,
        "vllm": vllm_version(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": saved.command("vllm_check.py", argv),
        "duration_s": round(time.perf_counter() - started, 1),
        "load_avg_start_end": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
        "vllm_args": vllm_args(args.max_model_len),
        "vllm_env": vllm_env(),
        "arms": {
            name: {"backend": backend, "dtype": dtype, "python": os.path.relpath(python, ROOT)}
            for name, python, backend, dtype in ARMS
        },
        "not_up": {name: reason for name, *_ in ARMS if not isinstance(reason := up[name], tuple)},
        "vllm_own_route": ("answered: driven in the http rows" if isinstance(up[OWN_ROUTE], tuple) else up[OWN_ROUTE]),
        "answers": {"requests": len(parity_requests), "reference": REFERENCE, "arms": parity},
        "http": {**HTTP, "rows": serving},
    }
    saved.write_json(out, result)
    print(f"wrote {out}")
    down = [name for name, *_ in ARMS if name in result["not_up"]]
    return 1 if down else 0


if __name__ == "__main__":
    sys.exit(main())
