"""What an engine change did, and where a short question's time goes: blink.py at a git revision (the reference)
against the working tree's, each serving the stand-in at the dtype blink answers in, in one process, call by call.

    python bench/engine_ab.py --base 8e926fc            # the three decision cases, one thread
    python bench/engine_ab.py --base 8e926fc --profile  # and the short question's time by operator and function

Each case alternates the two engines request by request (the order flipped every pair) and times each call in this
process's CPU seconds, so load from other processes inflates both sides of a pair alike; it prints each side's median
and the median (and quartiles) of the per-pair ratios. Answers: the largest probability gap and pick changes of both
sides against the working tree's float32 path (the exact one). The answer cache is off on both sides: every request
runs the model. Prints only (the benchmark harness writes results files).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import fields, replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import workloads  # noqa: E402

import blink  # noqa: E402

SHORT = {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}


def blink_at(revision: str):
    """blink.py as it was at a git revision, imported as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{revision}:blink.py"], cwd=os.path.dirname(HERE), check=True, capture_output=True, text=True
    ).stdout
    path = os.path.join(tempfile.mkdtemp(), "blink_reference.py")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(source)
    spec = importlib.util.spec_from_file_location("blink_reference", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["blink_reference"] = module
    spec.loader.exec_module(module)
    return module


def deployment(module, dtype: str):
    """A deployment of `module` serving the stand-in at `dtype`, its answer cache off where it has one."""
    settings = module.Settings(dtype=dtype)
    if "answer_cache_mb" in {f.name for f in fields(settings)}:
        settings = replace(settings, answer_cache_mb=0)
    dep = module.Deployment.serving(module.TorchEngine(module.STANDIN_MODEL, settings=settings))
    dep.decide("warm-up", {"w": {"type": "noul"}})
    return dep


def cases(tok, pairs: int) -> dict[str, list[tuple]]:
    """Each case's requests, one per pair: a new ~1,000-token log with 8 questions, the same log with 8 new
    questions, one yes/no question over a new short text."""
    docs = [workloads.document(tok, 1000, seed=1000 + i) for i in range(pairs)]
    first = workloads.questions(8, 4, workloads.ticket_count(docs[0]))
    again = {
        f"r{k}": {**q, "instructions": q["instructions"].replace("Which team", "What team, in your view,")}
        for k, q in first.items()
    }
    short = [
        (f"Order {4100 + i}: I was charged twice for the same order and want my money back.", SHORT)
        for i in range(5 * pairs)
    ]
    return {"document": [(d, first) for d in docs], "again": [(d, again) for d in docs], "short": short}


def gaps(got: dict, exact: dict) -> tuple[float, int]:
    """The largest probability gap and the picks changed between two answer maps."""
    gap, flips = 0.0, 0
    for key, answer in exact.items():
        p, q = got[key]["probabilities"], answer["probabilities"]
        gap = max(gap, max(abs(p[k] - q[k]) for k in q))
        flips += max(p, key=p.get) != max(q, key=q.get)
    return gap, flips


def compare(deps: dict, exact, requests: list[tuple]) -> dict:
    """Per-call CPU seconds of each side, alternating, and both sides' answers against the exact path."""
    names = list(deps)
    seconds = {name: [] for name in names}
    answer_gaps = {name: (0.0, 0) for name in names}
    for i, (state, questions) in enumerate(requests):
        for name in names if i % 2 == 0 else names[::-1]:
            t0 = time.process_time()
            got = deps[name].decide(state, questions)["answers"]
            seconds[name].append(time.process_time() - t0)
            if i < 3:
                gap, flips = gaps(got, exact.decide(state, questions)["answers"])
                answer_gaps[name] = (max(gap, answer_gaps[name][0]), answer_gaps[name][1] + flips)
    ratios = sorted(a / b for a, b in zip(*seconds.values()))
    return {"seconds": seconds, "ratios": ratios, "gaps": answer_gaps}


def profile_short(dep, requests: list[tuple]) -> str:
    """The short question's CPU time by torch operator and by Python function."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for state, questions in requests:
            dep.decide(state, questions)
    by_function = cProfile.Profile(time.process_time)
    by_function.runcall(lambda: [dep.decide(s, q) for s, q in requests])
    out = io.StringIO()
    pstats.Stats(by_function, stream=out).sort_stats("cumulative").print_stats(25)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return f"{table}\n{out.getvalue()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the git revision whose blink.py is the reference")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=4, help="requests per case for each side (short: 5x)")
    parser.add_argument("--cases", default="short,document,again")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = blink.Settings.from_env({}).compute_dtype
    deps = {args.base: deployment(blink_at(args.base), dtype), "working tree": deployment(blink, dtype)}
    exact = deployment(blink, "float32")
    print(f"{blink.hardware()}, torch {torch.__version__}, {args.threads} thread(s), {dtype}; CPU ms per request")
    requests = cases(deps["working tree"].engine().tok, args.pairs)
    for case in args.cases.split(","):
        found = compare(deps, exact, requests[case])
        (ref, new), r = (statistics.median(v) * 1000 for v in found["seconds"].values()), found["ratios"]
        print(
            f"{case}: {args.base} {ref:.1f}, working tree {new:.1f}; per pair {args.base}/working tree median "
            f"{statistics.median(r):.3f} (quartiles {r[len(r) // 4]:.3f}-{r[3 * len(r) // 4]:.3f}, n={len(r)}); "
            + "; ".join(f"{n} vs float32: |dp| <= {g:.4f}, {f} picks changed" for n, (g, f) in found["gaps"].items())
        )
    if args.profile:
        print(profile_short(deps["working tree"], requests["short"][:10]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
