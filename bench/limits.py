"""The machine's side of the benchmark: thread count and measured matmul FLOP/s."""

from __future__ import annotations

import os

import clock
import torch


def matmul_flops(device: torch.device, n: int = 2048, reps: int = 10) -> float:
    """Best-of-`reps` FLOP/s of an n x n x n product on the device (float32 on a CPU, bfloat16 on a GPU), by the
    faster of torch's default kernel and, on a CPU, oneDNN's (which blink runs where it is faster, BLINK_CPU_MATMUL):
    the practical ceiling."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    if device.type == "cpu":
        best = min(clock.kernel_seconds(a, b, reps).values())  # a @ b.T: the same work as a @ b
    else:
        best = clock.best_seconds(lambda: (a @ b, torch.cuda.synchronize()), reps)
    return 2 * n**3 / best


def _probe_seconds(model, device: torch.device, tokens: int = 128) -> float:
    """Best of two short prefills: how fast the model runs at the current thread count."""
    ids = torch.randint(10, 1000, (1, tokens), device=device)
    with torch.no_grad():
        return clock.best_of(lambda: model.model(input_ids=ids, use_cache=False), 3)[0]


def choose_threads(model, device: torch.device, requested: str) -> dict:
    """Set torch's intra-op threads: a number, or "auto" (every core, or one when that runs the model faster,
    as it does when other processes share a small machine). Returns what was tried and chosen."""
    cores = os.cpu_count() or 1
    if device.type != "cpu":
        return {"threads": torch.get_num_threads(), "how": "gpu"}
    if requested != "auto":
        torch.set_num_threads(int(requested))
        return {"threads": int(requested), "how": "given"}
    tried = {}
    for n in sorted({1, cores}):
        torch.set_num_threads(n)
        tried[n] = round(_probe_seconds(model, device), 4)
    best = min(tried, key=tried.get)
    torch.set_num_threads(best)
    return {"threads": best, "how": "auto", "probe_s_by_threads": tried}
