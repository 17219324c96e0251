"""The bench's one stopwatch: every timing in bench/ goes through timed() or best_of()."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import blink

T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[float, float, T]:
    """(wall s, this process's CPU s, result) of one call."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def best_of(
    fn: Callable[[], T],
    reps: int,
    cost: Callable[[float, float, T], float] = lambda wall, cpu, out: wall,
    stop_above: float | None = None,
) -> tuple[float, float, T]:
    """timed(fn) of the call whose cost (wall seconds unless told) was least among up to `reps` calls; a call whose
    cost is `stop_above` or more ends the repeats (a long run is measured once)."""
    best = timed(fn)
    for _ in range(reps - 1):
        if stop_above is not None and cost(*best) >= stop_above:
            break
        again = timed(fn)
        best = again if cost(*again) < cost(*best) else best
    return best


def kernel_seconds(x, weight, reps: int = 3) -> dict[str, float]:
    """The least wall seconds of x @ weight.T by each kernel BLINK_CPU_MATMUL chooses between (blink.linear_kernels),
    after one warm-up call each."""
    import torch

    with torch.inference_mode():
        return {name: best_seconds(kernel, reps) for name, kernel in blink.linear_kernels(x, weight).items()}


def best_seconds(fn: Callable[[], object], reps: int = 3) -> float:
    """The least wall time of `reps` calls after one warm-up call, in seconds."""
    fn()
    return best_of(fn, reps)[0]
