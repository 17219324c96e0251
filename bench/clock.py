"""The bench's one stopwatch: every timing in bench/ goes through timed() or best_of()."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[float, float, T]:
    """(wall s, this process's CPU s, result) of one call."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def best_of(fn: Callable[[], T], reps: int, cost: Callable[[float, float, T], float] = lambda wall, cpu, out: wall,
            stop_above: float | None = None) -> tuple[float, float, T]:
    """timed(fn) of the call whose cost (wall seconds unless told) was least among up to `reps` calls; a call whose
    cost is `stop_above` or more ends the repeats (a long run is measured once)."""
    best = timed(fn)
    for _ in range(reps - 1):
        if stop_above is not None and cost(*best) >= stop_above:
            break
        again = timed(fn)
        best = again if cost(*again) < cost(*best) else best
    return best
