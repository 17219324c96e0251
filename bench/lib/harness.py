"""What every benchmark shares: one Run (its flags, its header, its results file, and whether the machine held steady
while it ran) and the one clock every timing in bench/ goes through."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import blink

T = TypeVar("T")
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
# A run whose matmul probe at its end differs from the one at its start by more than this share (of the larger) ran
# on an unsteady machine: the cores' speed changed part way through (other work, or the clock); its ratios are suspect.
UNSTEADY_MATMUL_CHANGE = 0.10


# ---------------------------------------------------------------------------------------------------------------
# The clock
# ---------------------------------------------------------------------------------------------------------------


def lazy(name: str):
    """The module `name`, loaded at its first attribute read: a benchmark names the torch-bound modules it runs with
    at its top, and `python -m bench report` imports it for its tables without loading torch."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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


def settle(
    cpu_seconds: Callable[[], float], interval_s: float = 0.05, busy_share: float = 0.2, cap_s: float = 5.0
) -> float:
    """Wait until the processes whose CPU seconds `cpu_seconds()` counts go idle (less than `busy_share` of a core
    over an interval of `interval_s`), for at most `cap_s`; the seconds waited. A server that spins after answering
    (vLLM's engine core keeps a core busy for about a second) would otherwise slow whichever arm is timed next."""
    watch, last = Stopwatch(), cpu_seconds()
    while watch.seconds() < cap_s:
        time.sleep(interval_s)
        now = cpu_seconds()
        if now - last < busy_share * interval_s:
            break
        last = now
    return watch.seconds()


class Stopwatch:
    """Wall seconds since it was made: how long a part of a run took (a measurement is timed() instead)."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def seconds(self) -> float:
        """Wall seconds since the stopwatch was made."""
        return time.perf_counter() - self.t0


def kernel_seconds(x, weight, reps: int = 3) -> dict[str, float]:
    """The least wall seconds of x @ weight.T by each kernel BLINK_CPU_MATMUL chooses between, the kernels taking
    turns after a warm-up call each (blink.interleaved_seconds, as blink measures them)."""
    import torch

    with torch.inference_mode():
        rounds = blink.interleaved_seconds(blink.linear_kernels(x, weight), reps, calls=1)
    return {name: min(seconds) for name, seconds in rounds.items()}


def sync(device) -> None:
    """Wait for queued GPU work, so that a wall time is complete."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------------------------------------------


def default_probe_dtype(device) -> str:
    """The dtype of a run's matmul probe: float32 on a CPU, bfloat16 on a GPU."""
    return "float32" if device.type == "cpu" else "bfloat16"


def matmul_flops(device, n: int = 2048, reps: int = 10, dtype: str | None = None) -> float:
    """Best-of-`reps` FLOP/s of an n x n x n product on the device in `dtype` (default: float32 on a CPU, bfloat16 on a
    GPU), by the faster of torch's default kernel and, on a CPU, oneDNN's (which blink runs where it is faster,
    BLINK_CPU_MATMUL, and for every bfloat16 model): the practical ceiling at that dtype."""
    import torch

    dtype = getattr(torch, dtype or default_probe_dtype(device))
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    if device.type == "cpu":
        return 2 * n**3 / min(kernel_seconds(a, b, reps).values())  # a @ b.T: the same work as a @ b

    def product() -> None:
        a @ b
        sync(device)

    product()  # warm-up
    return 2 * n**3 / best_of(product, reps)[0]


def choose_threads(model, device) -> dict:
    """torch's intra-op threads for "auto": every core, or one when that runs the model faster (timed by two short
    prefills at each count). Returns what was tried and chosen."""
    import torch

    if device.type != "cpu":
        return {"threads": torch.get_num_threads(), "how": "gpu"}
    ids = torch.randint(10, 1000, (1, 128), device=device)
    tried = {}
    for n in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(n)
        with torch.no_grad():
            tried[n] = round(best_of(lambda: model.model(input_ids=ids, use_cache=False), 3)[0], 4)
    best = min(tried, key=tried.get)
    torch.set_num_threads(best)
    return {"threads": best, "how": "auto", "probe_s_by_threads": tried}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between samples."""
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def utilisation(flops: float, seconds: float, gflops: float) -> float | None:
    """Model FLOP utilisation: `flops` done in `seconds`, as a share of a matmul rate of `gflops` GFLOP/s (None where
    nothing was timed or no rate was probed)."""
    if seconds <= 0 or not gflops:
        return None
    return flops / seconds / (gflops * 1e9)


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


def load_average() -> list[float]:
    """The machine's 1, 5 and 15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------------------------------------------------------
# A run and its results file
# ---------------------------------------------------------------------------------------------------------------


def command(name: str, argv: list[str]) -> str:
    """The command line that runs a benchmark, as typed (each argument quoted where a shell needs it: `--leads ''`)."""
    return "python -m bench " + shlex.join([name, *argv])


def write_json(path: str, res: dict) -> str:
    """res as indented JSON at `path` (its folder made; the file replaced whole, never left half-written)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1, ensure_ascii=False)
        fh.write("\n")
    os.replace(path + ".tmp", path)
    return path


def versions() -> dict:
    """The versions a run's figures depend on (a package that is not installed is left out)."""
    out = {"python": platform.python_version()}
    for package in ("torch", "transformers"):
        try:
            out[package] = __import__(package).__version__
        except ImportError:
            pass
    return out


class Run:
    """One run of a benchmark: its flags (--quick, --threads, --out and its own), its header (command, hardware, when,
    for how long, the load and the matmul probes of its start and end), and its results file
    (bench/results/NAME.json, NAME-quick.json for --quick)."""

    def __init__(
        self,
        name: str,
        argv: list[str] | None,
        description: str,
        flags: Callable[[argparse.ArgumentParser], None] | None = None,
        threads: str = "1",
    ):
        parser = argparse.ArgumentParser(
            prog=f"python -m bench {name}",
            description=description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.add_argument("--quick", action="store_true", help="a small version (results in NAME-quick.json)")
        parser.add_argument("--threads", default=threads, help=f"CPU threads (default {threads}; 0: every core)")
        parser.add_argument("--out", default=RESULTS, help="folder for the results file (default bench/results)")
        if flags is not None:
            flags(parser)
        self.argv = list(argv or [])
        self.args = parser.parse_args(self.argv)
        self.name = name
        self.quick: bool = self.args.quick
        self.threads: int | str | dict = int(self.args.threads) if self.args.threads.isdigit() else self.args.threads
        if isinstance(self.threads, int) and self.threads > 0:
            import torch

            torch.set_num_threads(self.threads)
        self.started, self.stopwatch, self.load0 = time.time(), Stopwatch(), load_average()
        self.probes: list[float] = []
        self.device = None  # where the probes run: the first probe's device
        self.probe_dtypes: list[str] = []  # dtypes probed beside the default one at every probe (set before probing)
        self.dtype_probes: dict[str, list[float]] = {}
        self.written: dict = {}  # the header and results write() wrote

    def probe(self, device=None) -> float:
        """The machine's matmul GFLOP/s now (matmul_flops; on a CPU unless told), and at each of `probe_dtypes`: the
        first call is the run's start, the last its end (write() takes the end when only the start was taken)."""
        import torch

        self.device = self.device or device or torch.device("cpu")
        self.probes.append(matmul_flops(self.device) / 1e9)
        for dtype in (d for d in self.probe_dtypes if d != default_probe_dtype(self.device)):
            self.dtype_probes.setdefault(dtype, []).append(matmul_flops(self.device, dtype=dtype) / 1e9)
        return self.probes[-1]

    @property
    def matmul_gflops(self) -> float:
        """The best of the matmul probes so far: the closer to the machine's ceiling."""
        return max(self.probes)

    def matmul_probe(self, dtype: str | None) -> tuple[str, float]:
        """(the dtype probed, its best GFLOP/s so far) for work in `dtype`: its own probe where `probe_dtypes` has
        it, else the default probe (float32 on a CPU: also what a dtype with no probe of its own, e.g. a GGUF file's
        Q4_1, is held against)."""
        if dtype in self.dtype_probes:
            return dtype, max(self.dtype_probes[dtype])
        return default_probe_dtype(self.device), self.matmul_gflops

    def header(self) -> dict:
        """How the run ran: the command, the hardware and versions, when and for how long, the load average at its
        start and end, its threads, and (where it probed) the matmul probes and whether the machine held steady."""
        out = {
            "command": command(self.name, self.argv),
            "quick": self.quick,
            "hardware": blink.hardware(),
            **versions(),
            "threads": self.threads,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "duration_s": round(self.stopwatch.seconds(), 1),
            "load_average": {"start": self.load0, "end": load_average()},
        }
        if self.probes:
            out["matmul_gflops"] = round(self.matmul_gflops, 2)
            out.update(steadiness(self.probes[0], self.probes[-1]))
        if self.dtype_probes:
            out["matmul_gflops_by_dtype"] = {k: [round(g, 2) for g in v] for k, v in self.dtype_probes.items()}
        return {**out, "cpu_matmul_verdicts": blink.kernel_verdicts()}

    def files(self) -> str:
        """The folder this run keeps its side files in (servers' logs, rows it wrote and read, a base revision's
        blink.py): bench/results/files/NAME (NAME-quick for --quick) under --out, made anew by each run and ignored by
        git, so a run leaves nothing of its own in /tmp and its logs are where its results are."""
        folder = os.path.join(self.args.out, "files", f"{self.name}{'-quick' if self.quick else ''}")
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        return folder

    def write(self, results: dict, stem: str | None = None) -> str:
        """The header and `results` as bench/results/STEM.json (STEM-quick.json for --quick; STEM: the benchmark's
        name unless told); its path. What it wrote stays in `written`, for the run's last line. A run that probed its
        start probes its end here, unless it already has."""
        if len(self.probes) == 1:
            self.probe()
        path = os.path.join(self.args.out, f"{stem or self.name}{'-quick' if self.quick else ''}.json")
        self.written = {**self.header(), **results}
        return write_json(path, self.written)
