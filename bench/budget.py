"""blink's padded tokens per forward (BLINK_TOKEN_BUDGET) on this machine: the same work at each budget, interleaved.

    python bench/budget.py           # 16 questions over a 300-token log (plain path), 64 short requests packed
    python bench/budget.py --quick   # smaller, under a minute

The two workloads are where the budget splits work: the plain path over many whole prompts, and many short requests
packed into one call (their tails after the shared template header). CPU time is reported beside wall time: on a
shared machine waiting for a core inflates the wall clock, not this process's CPU time. Writes
bench/results/budget.json; the last line printed is a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import blink  # noqa: E402
import workloads  # noqa: E402

CONFIGS = {"full": {"doc": 300, "questions": 16, "short_requests": 64, "reps": 3, "budgets": [4096, 32768]},
           "quick": {"doc": 100, "questions": 4, "short_requests": 16, "reps": 1, "budgets": [4096, 32768]}}


def main(argv: list[str] | None = None) -> int:
    """Measure each budget on both workloads, interleaved; write JSON; print one summary line last."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller workloads, one repetition")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for the JSON")
    args = ap.parse_args(argv)
    cfg = CONFIGS["quick" if args.quick else "full"]
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    base = blink.Settings.from_env({})
    engine = blink.TorchEngine(blink.STANDIN_MODEL, settings=base)
    doc = workloads.document(engine.tok, cfg["doc"])
    many = blink.parse_request(doc, workloads.questions(cfg["questions"], 4, workloads.ticket_count(doc)),
                               settings=base)
    shorts = [blink.parse_request(f"Order {i}: charged twice for one order, the customer wants a refund.",
                                  {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}},
                                  settings=base) for i in range(cfg["short_requests"])]
    work = {f"plain path, {cfg['questions']} questions over {cfg['doc']} tokens":
            (False, lambda: engine.forward(many)),
            f"{cfg['short_requests']} short requests packed": (True, lambda: engine.run([engine.prepare(r)
                                                                                        for r in shorts]))}
    times: dict = {(name, b): [] for name in work for b in cfg["budgets"]}
    for _ in range(cfg["reps"] + 1):  # the first round warms up and is not counted
        for name, (prefix, fn) in work.items():
            for budget in cfg["budgets"]:
                engine.settings = replace(base, prefix_cache=prefix, token_budget=budget)
                engine.prefixes.clear()
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                times[(name, budget)].append((time.perf_counter() - t0, time.process_time() - c0))
    rows = [{"workload": name, "token_budget": budget, "wall_s": [round(w, 3) for w, _ in runs[1:]],
             "cpu_s": [round(c, 3) for _, c in runs[1:]], "total_cpu_s": round(sum(c for _, c in runs[1:]), 3)}
            for (name, budget), runs in times.items()]
    for r in rows:
        print(f"{r['workload']:>48} budget {r['token_budget']:>6}: CPU {r['total_cpu_s']:.2f} s, wall {r['wall_s']}")
    res = {"command": " ".join(["python bench/budget.py", *(sys.argv[1:] if argv is None else argv)]),
           "hardware": blink.hardware(), "threads": args.threads, "rows": rows,
           "duration_s": round(time.perf_counter() - started, 1)}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"budget{'-quick' if args.quick else ''}.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
        fh.write("\n")
    small, large = cfg["budgets"][0], cfg["budgets"][-1]
    ratios = [next(r["total_cpu_s"] for r in rows if r["workload"] == name and r["token_budget"] == large)
              / next(r["total_cpu_s"] for r in rows if r["workload"] == name and r["token_budget"] == small)
              for name in work]
    print(f"blink budget ({res['hardware']}, {args.threads} thread(s), {res['duration_s']:.0f} s): CPU time at "
          f"{large} / at {small}: " + ", ".join(f"{name} {r:.2f}x" for name, r in zip(work, ratios))
          + f"; results {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
