"""What every bench script keeps of a run: the command line that ran it, its results as a JSON file with the kernel
verdicts blink's engines ran by in that process (BLINK_CPU_MATMUL=auto's, see blink.kernel_verdict), and whether the
machine held steady while it ran."""

from __future__ import annotations

import json
import os
import sys

import blink


def command(script: str, argv: list[str] | None) -> str:
    """The command line as typed: `python bench/SCRIPT ARGS` (the process's own arguments when argv is None)."""
    return " ".join([f"python bench/{script}", *(sys.argv[1:] if argv is None else argv)])


def write_json(path: str, res: dict) -> str:
    """res as indented JSON at `path` (its folder made; the file replaced whole, never left half-written), with
    every BLINK_CPU_MATMUL=auto verdict this process measured or read under "cpu_matmul_verdicts" (empty: no float32
    model ran on a CPU under auto here)."""
    res = {**res, "cpu_matmul_verdicts": res.get("cpu_matmul_verdicts", blink.kernel_verdicts())}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
        fh.write("\n")
    os.replace(path + ".tmp", path)
    return path


# A run whose matmul probe at its end differs from the one at its start by more than this share (of the larger) ran
# on an unsteady machine: other work took the cores, or the clock changed, part way through; its ratios are suspect.
UNSTEADY_MATMUL_CHANGE = 0.10


def steadiness(start_gflops: float, end_gflops: float) -> dict:
    """The matmul probes of a run's start and end, their relative change, and `unsteady` when it is over
    UNSTEADY_MATMUL_CHANGE."""
    change = abs(start_gflops - end_gflops) / max(start_gflops, end_gflops)
    return {
        "matmul_gflops_start_end": [round(start_gflops, 2), round(end_gflops, 2)],
        "matmul_change": round(change, 3),
        "unsteady_threshold": UNSTEADY_MATMUL_CHANGE,
        "unsteady": change > UNSTEADY_MATMUL_CHANGE,
    }
