"""The vLLM backend against blink's torch engine, on one GPU and the same model, side by side in one run.

    python bench/vllm_check.py [--model ID] [--requests N] [--out bench/results/vllm.json]

Needs CUDA and vllm >= 0.33 (pip install 'vllm>=0.33' in its own environment: vLLM pins its own CUDA torch). Without
them it prints why and exits 0: skipped, nothing measured.

1. Parity. Generated System One requests (tests/systemone_requests.py: every question type, structured descriptions,
   generic and named keys, unicode, up to 200 options, which vLLM reads in two requests of at most 128 label ids) run
   through both engines. Per prompt it compares the label log-probs (torch: label logits minus the full-vocabulary
   log-sum-exp, in FP32 from a bfloat16 hidden state; vLLM: its raw log-softmax), and per question the answers.
   Tolerance: both run the model in bfloat16 (8 mantissa bits, relative rounding 2^-8 = 0.4%), with different kernels
   (vLLM's fused attention and norms, transformers' sdpa) that round in a different order, and vLLM also rounds the
   logits to bfloat16 before its FP32 log-softmax where blink reads the label rows in FP32. Logits of size 10-30 then
   differ by up to a few tenths, and a probability moves by at most p(1-p) = 1/4 times that: |dp| <= 0.05 is the
   bound (the same one tests/test_torch.py holds bfloat16 to). Answers must be equal, except where the torch engine's
   own top two are within that bound of each other (a near tie that rounding may flip); those are counted.
2. Throughput. The same requests served through a Deployment (its Batcher, as the app and the API use it) by each
   backend, at 1, 8 and 64 concurrent callers: requests/s and the ratio vLLM / torch.

Writes the results as JSON and prints a summary; exits 1 when parity fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import blink  # noqa: E402
import saved  # noqa: E402
import systemone_requests  # noqa: E402

TOLERANCE = 0.05  # |dp| between the two bfloat16 engines (see the module docstring)
CONCURRENCY = (1, 8, 64)


def missing() -> str | None:
    """Why this check cannot run here (None when it can)."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    if not blink.cuda_available():
        return "no CUDA device"
    return None


def workload(count: int, seed: int = 7) -> list[dict]:
    """The requests both engines answer: generated ones plus one choice with 200 options (two vLLM requests)."""
    wide = {"type": "choice", "instructions": "Which code fits?", "criteria": {f"code {i}": None for i in range(200)}}
    return systemone_requests.requests(count - 1, seed) + [{"state": "ticket 4417: refund", "questions": {"w": wide}}]


def readout_logprobs(readout: blink.Readout) -> list[list[float]]:
    """A readout's label scores as full-vocabulary log-probs, per prompt."""
    return [[z - lse for z in row] for row, lse in zip(readout.logits, readout.lse)]


def top_gap(answer: dict) -> float:
    """How far the best option stands above the second (1 for a single option)."""
    p = sorted(answer["probabilities"].values(), reverse=True)
    return p[0] - p[1] if len(p) > 1 else 1.0


def compare(torch_engine: blink.Engine, vllm_engine: blink.Engine, requests: list[dict]) -> dict:
    """Label log-probs and answers of both engines on the same requests: the largest gaps and the answers that
    differ (near ties apart)."""
    settings = torch_engine.settings
    worst_lp = worst_p = 0.0
    differ, near_ties, questions = [], 0, 0
    for i, req in enumerate(requests):
        request = blink.parse_request(req["state"], req["questions"], settings=settings)
        ours, theirs = torch_engine.forward(request), vllm_engine.forward(request)
        answers = {}
        for name, forward in (("torch", ours), ("vllm", theirs)):
            temps = {q.key: settings.temperature for q in request.questions}
            answers[name] = blink.assemble(request, forward.readouts, temps)
        for q in request.questions:
            questions += 1
            for a, b in zip(readout_logprobs(ours.readouts[q.key]), readout_logprobs(theirs.readouts[q.key])):
                worst_lp = max(worst_lp, *(abs(x - y) for x, y in zip(a, b)))
            a, b = answers["torch"][q.key], answers["vllm"][q.key]
            worst_p = max(worst_p, *(abs(a["probabilities"][k] - b["probabilities"][k]) for k in a["probabilities"]))
            pick = {"choice": "choice", "noul": None, "score": "choice"}[q.type]
            if pick and a[pick] != b[pick]:
                if top_gap(a) < TOLERANCE:
                    near_ties += 1
                else:
                    differ.append({"request": i, "question": q.key, "torch": a[pick], "vllm": b[pick]})
    return {"requests": len(requests), "questions": questions, "max_abs_logprob_gap": worst_lp,
            "max_abs_probability_gap": worst_p, "tolerance": TOLERANCE, "answers_differ": differ,
            "near_ties_flipped": near_ties, "ok": not differ and worst_p <= TOLERANCE}


def throughput(dep: blink.Deployment, requests: list[dict], callers: int) -> dict:
    """Requests/s with `callers` threads submitting the requests through the deployment's Batcher."""
    parsed = [dep.request(r["state"], r["questions"]) for r in requests]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(callers) as pool:
        results = list(pool.map(dep.submit, parsed))
    wall = time.perf_counter() - t0
    return {"callers": callers, "requests": len(parsed), "seconds": round(wall, 3),
            "requests_per_s": round(len(parsed) / wall, 2),
            "mean_batched": round(sum(r["meta"]["batched_requests"] for r in results) / len(results), 2)}


def serving(engines: dict[str, blink.Engine], requests: list[dict]) -> list[dict]:
    """Requests/s of each engine at each concurrency, one after the other on the same GPU, with a warm-up first."""
    rows = []
    for callers in CONCURRENCY:
        batch = (requests * (1 + 4 * callers // len(requests)))[: max(16, 4 * callers)]
        row = {"callers": callers}
        for name, engine in engines.items():
            dep = blink.Deployment.serving(engine)
            throughput(dep, batch[:callers], callers)  # warm-up: first use of the batcher, kernels, caches
            row[name] = throughput(dep, batch, callers)
        row["vllm_over_torch"] = round(row["vllm"]["requests_per_s"] / row["torch"]["requests_per_s"], 2)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run both parts, print the figures, write the results file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=blink.STANDIN_MODEL, help="a model both engines load (hub id or folder)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45,
                        help="vLLM's share of the GPU: the torch engine runs beside it")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "vllm.json"))
    args = parser.parse_args(argv)
    why = missing()
    if why:
        print(f"skipped: the vLLM check needs CUDA and vllm>=0.33 ({why}); nothing was measured")
        return 0
    settings = blink.Settings(gpu=True, models=((args.model, None),),
                              vllm_args=json.dumps({"gpu_memory_utilization": args.gpu_memory_utilization}))
    torch_engine = blink.TorchEngine(args.model, settings=settings)
    vllm_engine = blink.VllmEngine(args.model, settings=dataclasses.replace(settings, backend="vllm"))
    requests = workload(args.requests)
    parity = compare(torch_engine, vllm_engine, requests)
    rows = serving({"torch": torch_engine, "vllm": vllm_engine}, requests)
    import torch
    import vllm

    result = {"model": args.model, "hardware": blink.hardware(), "torch": torch.__version__,
              "vllm": vllm.__version__, "dtype": "bfloat16", "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                        time.gmtime()),
              "command": saved.command("vllm_check.py", argv),
              "parity": parity, "serving": rows}
    saved.write_json(args.out, result)
    print(f"parity on {parity['questions']} questions: max |d logprob| {parity['max_abs_logprob_gap']:.4f}, "
          f"max |dp| {parity['max_abs_probability_gap']:.4f} (bound {TOLERANCE}), "
          f"{len(parity['answers_differ'])} answers differ, {parity['near_ties_flipped']} near ties flipped")
    for row in rows:
        print(f"{row['callers']:>3} callers: torch {row['torch']['requests_per_s']:.2f} req/s, vllm "
              f"{row['vllm']['requests_per_s']:.2f} req/s ({row['vllm_over_torch']:.2f}x)")
    print(f"wrote {args.out}")
    return 0 if parity["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
