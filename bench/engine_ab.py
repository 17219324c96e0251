"""What an engine change did: blink.py at a git revision against the working tree's, call by call.

Each serves the stand-in (or, with --shape, a random-weight Qwen3.5 of bench/lib/qwen_gguf.py's shapes) at the dtype
blink answers in, in one process; --profile shows where a short question's time goes.

    python -m bench engine_ab --base 1f50df1            # the three decision cases, one thread (engine_ab-1f50df1.json)
    python -m bench engine_ab --base 1f50df1 --profile  # and the short question's time by operator, both sides
    python -m bench engine_ab --base 1f50df1 --dtype float32  # both in float32 (engine_ab-1f50df1-float32.json)
    python -m bench engine_ab --base 7947525 --shape 4b-8l --threads 2   # the 4b's first 8 layers (-4b-8l.json)
    python -m bench engine_ab --base HEAD --quantize w8a8-prefix --dtype float32 --shape 4b-8l --threads 2
                                            # what a setting does: the working tree's side with BLINK_QUANTIZE set

Each case alternates the two engines request by request (the order flipped every pair) and times each call in this
process's CPU seconds, so load from other processes inflates both sides of a pair alike; it records each side's
median and the median (and quartiles) of the per-pair ratios, and the same in wall seconds (a change in how much of
the time both cores are busy shows there alone). Answers: the largest probability gap and pick changes
of both sides against the working tree's float32 path (the exact one: with --shape, the working tree's own side where
it runs in float32, so that two copies of the model are held, not three; with --quantize, the base side's, which then
runs in float32). The answer cache is off on both sides: every request runs the model.
"""

from __future__ import annotations

import cProfile
import importlib.util
import io
import os
import pstats
import statistics
import subprocess
import sys
import time
from dataclasses import fields, replace

import blink
from bench.lib import answers, harness, qwen_gguf, report, workloads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}
CASES = "short,document,again"  # asked by default


def blink_at(revision: str, folder: str):
    """blink.py as it was at a git revision, written to `folder` and imported from there as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{revision}:blink.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    path = os.path.join(folder, "blink_reference.py")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(source)
    spec = importlib.util.spec_from_file_location("blink_reference", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["blink_reference"] = module
    spec.loader.exec_module(module)
    return module


def deployment(module, dtype: str, model: str | None = None, quantize: str | None = None):
    """A deployment of `module` serving `model` (default: the stand-in) at `dtype` (and BLINK_QUANTIZE `quantize`),
    its answer cache off where it has one."""
    settings = module.Settings(dtype=dtype, **({"quantize": quantize} if quantize else {}))
    if "answer_cache_mb" in {f.name for f in fields(settings)}:
        settings = replace(settings, answer_cache_mb=0)
    dep = module.Deployment.serving(module.TorchEngine(model or module.STANDIN_MODEL, settings=settings))
    dep.decide("warm-up", {"w": {"type": "noul"}})
    return dep


def routing(options: int, seed: int) -> dict:
    """One choice among `options` queues: a long question over a short text, so its prompt runs past the kept header
    as one long tail."""
    queues = {f"Queue {i:03d}": f"Tickets about topic {(i * 7919 + seed) % 1000}" for i in range(options)}
    return {"queue": {"type": "choice", "instructions": "Which queue should this ticket go to?", "criteria": queues}}


def cases(tok, pairs: int) -> dict[str, list[tuple]]:
    """Each case's requests, one per pair: a new ~1,000-token log with 8 questions, the same log with 8 new
    questions, one yes/no question over a new short text, and (asked for by name) a choice among 128 queues."""
    docs = [workloads.document(tok, 1000, seed=1000 + i) for i in range(pairs)]
    first = workloads.questions(8, 4, workloads.ticket_count(docs[0]))
    again = workloads.reworded(first)
    short = [
        (f"Order {4100 + i}: I was charged twice for the same order and want my money back.", SHORT)
        for i in range(5 * pairs)
    ]
    options = [
        (f"Order {4200 + i}: I was charged twice and want my money back.", routing(128, i)) for i in range(pairs)
    ]
    return {
        "document": [(d, first) for d in docs],
        "again": [(d, again) for d in docs],
        "short": short,
        "options": options,
    }


def pair_ratios(sides: dict[str, list[float]]) -> tuple[float, list[float]]:
    """The median and quartiles of the first side's time over the second's, pair by pair."""
    ratios = sorted(a / b for a, b in zip(*sides.values()))
    quartiles = [round(ratios[len(ratios) // 4], 3), round(ratios[3 * len(ratios) // 4], 3)]
    return round(statistics.median(ratios), 3), quartiles


def compare(deps: dict, exact, requests: list[tuple]) -> dict:
    """Per-call CPU seconds of each side, alternating, and both sides' answers against the exact path."""
    names = list(deps)
    seconds = {name: [] for name in names}
    walls = {name: [] for name in names}
    got: dict = {name: [] for name in names}
    want = []
    for i, (state, questions) in enumerate(requests):
        for name in names if i % 2 == 0 else names[::-1]:
            wall, cpu, out = harness.timed(lambda d=deps[name], s=state, q=questions: d.decide(s, q))
            seconds[name].append(cpu)
            walls[name].append(wall)
            if i < 3:
                got[name].append(out["answers"])
        if i < 3:
            want.append(exact.decide(state, questions)["answers"])
    ratio_median, ratio_quartiles = pair_ratios(seconds)
    wall_median, wall_quartiles = pair_ratios(walls)  # what a change to how busy both cores are shows
    return {
        "cpu_ms": {name: round(statistics.median(v) * 1000, 1) for name, v in seconds.items()},
        "pairs": len(requests),
        "ratio_median": ratio_median,
        "ratio_quartiles": ratio_quartiles,
        "wall_ms": {name: round(statistics.median(v) * 1000, 1) for name, v in walls.items()},
        "wall_ratio_median": wall_median,
        "wall_ratio_quartiles": wall_quartiles,
        "vs_float32": {name: answers.compare(answers.flat(want), answers.flat(g)) for name, g in got.items()},
    }


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


def flags(parser) -> None:
    """engine_ab's own flags."""
    parser.add_argument("--base", required=True, help="the git revision whose blink.py is the reference")
    parser.add_argument("--pairs", type=int, default=4, help="requests per case for each side (short: 5x)")
    parser.add_argument("--cases", default=CASES, help="of short, document, again, options")
    parser.add_argument("--dtype", choices=blink.DTYPES, help="both sides' dtype (default: the one blink answers in)")
    parser.add_argument("--shape", choices=sorted(qwen_gguf.SHAPES), help="a random-weight Qwen3.5 of this shape")
    parser.add_argument("--quantize", choices=blink.QUANTIZE, help="the working tree's side with BLINK_QUANTIZE set")
    parser.add_argument(
        "--profile", action="store_true", help="print the short question's time by operator, both sides"
    )


def main(argv: list[str] | None = None) -> int:
    """Both engines on each case; write JSON (engine_ab.json); print one line per case."""
    run = harness.Run("engine_ab", argv, __doc__, flags)
    args = run.args
    pairs = 2 if run.quick else args.pairs
    defaults = blink.Settings.from_env({})
    dtype = args.dtype or defaults.compute_dtype
    model = qwen_gguf.qwen_folder(args.shape, defaults.cache_dir) if args.shape else None
    deps = {
        args.base: deployment(blink_at(args.base, run.files()), dtype, model),
        "working tree": deployment(blink, dtype, model, args.quantize),
    }
    plain = deps[args.base] if args.quantize else deps["working tree"]  # the side without the setting
    exact = plain if model and dtype == "float32" else deployment(blink, "float32", model)
    run.probe()
    requests = cases(deps["working tree"].engine().tok, pairs)
    rows = {}
    for case in args.cases.split(","):
        rows[case] = compare(deps, exact, requests[case])
        print(f"{case}: {rows[case]}", flush=True)
    if args.profile:  # where the short question's time goes, before the change and after
        for side, dep in deps.items():
            print(f"short question, {side}:\n{profile_short(dep, requests['short'][:10])}", flush=True)
    base = subprocess.run(["git", "rev-parse", "--short=7", args.base], cwd=ROOT, capture_output=True, text=True)
    name = base.stdout.strip() or args.base  # HEAD named by its commit
    named = args.cases.replace(",", "-") if args.cases != CASES else None  # a run of other cases: its own file
    stem = f"engine_ab-{name}" + "".join(f"-{v}" for v in (args.dtype, args.shape, args.quantize, named) if v)
    run.write(
        {
            "base": args.base,
            "dtype": dtype,
            "model": args.shape or blink.STANDIN_MODEL,
            "quantize": args.quantize,
            "rows": rows,
        },
        stem,
    )
    return 0


def engine_ab_table(res: dict) -> list[str]:
    """CPU ms per request of blink.py at a base revision against the working tree's, the per-pair ratio, and both
    sides' answers against the float32 path."""
    base = res["base"]
    head = ["case", f"{base} (ms)", "working tree (ms)", f"{base} / working tree (quartiles)", "pairs"]
    rows = [
        [case, row["cpu_ms"][base], row["cpu_ms"]["working tree"]]
        + [f"{row['ratio_median']} ({row['ratio_quartiles'][0]}-{row['ratio_quartiles'][1]})", row["pairs"]]
        + ["; ".join(f"{n} {c['max_prob_diff']:.4f}, {len(c['picks_differ'])}" for n, c in row["vs_float32"].items())]
        for case, row in res["rows"].items()
    ]
    return report.table([*head, "vs float32: largest gap, picks changed"], rows)


REPORT = (engine_ab_table, ("rows", "base", "dtype", "model"))


if __name__ == "__main__":
    sys.exit(main())
