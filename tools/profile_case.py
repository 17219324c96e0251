"""Profile one of `python -m bench shape4b`'s cases on blink's arm at its defaults: where a request's time goes, by
torch operator and input shape (torch.profiler, CPU). The arm is loaded as the benchmark loads it, the case asked
twice to warm up, then once under the profiler; prints the case's wall seconds and computed tokens, then the
operators that took the most time.

    .venv/bin/python tools/profile_case.py --shape 4b-8l --case short --threads 2
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import blink  # noqa: E402
from bench import shape4b  # noqa: E402
from bench.lib import qwen_gguf  # noqa: E402


def main() -> int:
    """Load, warm up, profile one case, print the top operators."""
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="4b-8l", choices=sorted(qwen_gguf.SHAPES))
    parser.add_argument("--case", default="short", choices=shape4b.CASES)
    parser.add_argument("--doc-tokens", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    folder = qwen_gguf.qwen_folder(args.shape, blink.Settings.from_env({}).cache_dir)
    arm = shape4b.BlinkArm(folder, {}, args.threads, args.doc_tokens)
    for _ in range(2):
        arm.start()
        arm.ask(args.case)
    arm.start()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        got = arm.ask(args.case)
    print(f"{args.shape} {args.case}: {got['wall_s']:.2f} s, {got['computed_tokens']} tokens computed")
    events = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"{'ms':>9} {'share':>6} {'calls':>5}  operator, input shapes")
    for e in events[: args.top]:
        share = 100 * e.self_cpu_time_total / total
        print(f"{e.self_cpu_time_total / 1e3:9.1f} {share:5.1f}% {e.count:5d}  {e.key} {e.input_shapes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
