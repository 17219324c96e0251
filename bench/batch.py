"""Bulk decisions: rows per second of `python blink.py batch`, serially and on `--ray N` workers, beside a loop by hand.

On one model, in one run; the loop is the one a user writes by hand (decide() one row at a time).

    python -m bench batch                         # 128 rows on the stand-in (5-10 minutes on a 2-core CPU)
    python -m bench batch --quick                 # 16 rows (4 for the loop), one run each, 2,000 no-model rows
    python -m bench batch --rows 256 --workers 4  # more rows, more Ray workers
    python -m bench batch --pipeline-rows 0       # skip the no-model runs

Every arm (the registry's "batch" arms, bench/lib/arms.py) is a fresh process, as a user runs it, over the same rows (a
support ticket and one four-way choice each):

- loop: `deployment.decide(state, questions)` per row, appending each answer to OUT (no packing across rows); it
  runs the first --loop-rows rows only (one row at a time, its rate does not depend on how many);
- batch: `python blink.py batch IN --out OUT` (rows packed BLINK_BATCH_MAX_REQUESTS at a time into shared forwards);
- ray: the same command with `--ray N` (a local Ray cluster started by the command; N workers, one engine each).

Each engine runs on --threads CPU threads (default 1, as each Ray worker gets one). The three model arms run
--repeats times (default 2), interleaved, and each arm's fastest run counts (a slow run costs one run, not the
comparison). Reported per arm: the whole
process's wall time (Python start, model load, Ray start included), the answering time
and rows/s that the command's summary line prints, when the first rows landed, and the steady rate after them (the
rows after the first chunk of each worker, over the time after the first chunk landed). The
pipeline runs (the mock engine, many rows, no model) measure what the reading, packing, Ray transport and writing
can feed at most. The answers of every arm are compared with the loop's. Writes bench/results/batch.json; the last
line printed is a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import blink
from bench.lib import arms, harness, report, servers

SUMMARY = re.compile(
    r"batch: (\d+) rows, (\d+) errors in ([\d.]+) s \(([\d.]+) rows/s\)"
    r"(?:; first rows after ([\d.]+) s)?"
)
QUESTIONS = {
    "team": {
        "type": "choice",
        "instructions": "Which team should handle this ticket?",
        "criteria": {
            "billing": "charges, refunds, invoices",
            "technical": "bugs, crashes, errors",
            "account": "logins, passwords, access",
            "shipping": "deliveries and returns",
        },
    }
}
PROBLEMS = [
    "was charged twice for the March invoice",
    "cannot log in since the password reset",
    "sees the app crash when opening settings",
    "got a parcel that arrived crushed",
    "wants a refund for an unused seat",
    "gets error 500 when exporting a report",
]


def write_rows(path: str, n: int) -> None:
    """n support tickets with one four-way routing question each, one JSON line a row."""
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            state = f"Ticket #{i}: the customer {PROBLEMS[i % len(PROBLEMS)]} (plan {('free', 'pro', 'team')[i % 3]})."
            fh.write(json.dumps({"id": f"t{i}", "state": state, "questions": QUESTIONS}) + "\n")


def loop_main(in_path: str, out_path: str) -> None:
    """The hand-written loop: one decide() per row, each answer appended to OUT; prints its timings as JSON."""
    served = blink.deployment()
    served.engine()  # load before the clock starts, as the batch command does

    def answer_all() -> int:
        rows = 0
        with open(in_path, encoding="utf-8") as src, open(out_path, "w", encoding="utf-8") as out:
            for line in src:
                row = json.loads(line)
                out.write(json.dumps({"id": row["id"], **served.decide(row["state"], row["questions"])}) + "\n")
                out.flush()
                rows += 1
        return rows

    answer_s, _, rows = harness.timed(answer_all)
    print(json.dumps({"rows": rows, "answer_s": answer_s}))


def run_arm(name: str, cmd: list[str], env: dict, out_path: str, first_rows: int) -> dict:
    """One arm in a fresh process: its wall time and the timings it printed; `first_rows` is what the first chunk of
    every worker holds (the steady rate counts the rows after them)."""
    load0 = os.getloadavg()[0]
    wall, _, done = harness.timed(
        lambda: subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, **env}, cwd=servers.ROOT, timeout=3600
        )
    )
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    if name == "loop":
        timing = json.loads(done.stdout.strip().splitlines()[-1])
        rows, answer_s, first_s = timing["rows"], timing["answer_s"], None
    else:
        match = SUMMARY.search(done.stderr.strip().splitlines()[-1])
        rows, answer_s = int(match.group(1)), float(match.group(3))
        first_s = float(match.group(5)) if match.group(5) else None
    steady = (
        (rows - first_rows) / (answer_s - first_s)
        if first_s is not None and answer_s > first_s and rows > first_rows
        else None
    )
    return {
        "arm": name,
        "rows": rows,
        "wall_s": round(wall, 2),
        "answer_s": round(answer_s, 2),
        "rows_per_s": round(rows / answer_s, 2),
        "rows_per_s_wall": round(rows / wall, 2),
        "first_rows_s": first_s,
        "steady_rows_per_s": round(steady, 2) if steady else None,
        "load_avg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "out": out_path,
    }


def answers(path: str) -> dict:
    """id -> answers of an OUT file."""
    with open(path, encoding="utf-8") as fh:
        return {r["id"]: r["answers"] for r in map(json.loads, fh)}


def max_gap(a: dict, b: dict) -> float:
    """The largest difference of any probability or label mass between two runs' answers of the rows both have."""
    gap = 0.0
    for rid in a.keys() & b.keys():
        for qkey, ans in a[rid].items():
            other = b[rid][qkey]
            gap = max(
                [gap, abs(ans["label_mass"] - other["label_mass"])]
                + [abs(p - other["probabilities"][k]) for k, p in ans["probabilities"].items()]
            )
    return gap


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b to two decimals, None when either is unknown."""
    return round(a / b, 2) if a and b else None


def flags(ap) -> None:
    """batch's own flags."""
    ap.add_argument("--rows", type=int, default=None, help="rows the batch and ray arms answer (default 128, quick 16)")
    ap.add_argument("--loop-rows", type=int, default=None, help="rows the hand-written loop answers (16, quick 4)")
    ap.add_argument("--workers", type=int, default=2, help="Ray workers of the ray arm")
    ap.add_argument("--repeats", type=int, default=None, help="runs of each model arm, interleaved (2, quick 1)")
    ap.add_argument(
        "--pipeline-rows", type=int, default=None, help="rows of the no-model runs (20,000, quick 2,000; 0: none)"
    )
    ap.add_argument("--loop", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)  # the loop arm's process


CONFIGS = {
    "full": {"rows": 128, "loop_rows": 16, "repeats": 2, "pipeline_rows": 20000},
    "quick": {"rows": 16, "loop_rows": 4, "repeats": 1, "pipeline_rows": 2000},
}


def main(argv: list[str] | None = None) -> int:
    """Run the arms, print the table, write bench/results/batch.json."""
    run = harness.Run("batch", argv, __doc__, flags)
    args = run.args
    if args.loop:
        loop_main(*args.loop)
        return 0
    cfg = {
        k: v if getattr(args, k) is None else getattr(args, k)
        for k, v in CONFIGS["quick" if run.quick else "full"].items()
    }
    settings = blink.env_settings()
    chunk = settings.batch_max_requests
    blink_py = os.path.join(servers.ROOT, "blink.py")
    work = run.files()
    rows_path, loop_path = os.path.join(work, "rows.jsonl"), os.path.join(work, "loop-rows.jsonl")
    write_rows(rows_path, cfg["rows"])
    write_rows(loop_path, min(cfg["loop_rows"], cfg["rows"]))
    model_arms = [name for name, arm in arms.of("batch").items() if not arm.settings]
    runs: dict[str, list[dict]] = {name: [] for name in model_arms}
    threads = {"OMP_NUM_THREADS": str(run.threads)} if run.threads else {}
    commands = {
        "loop": lambda out: [sys.executable, "-m", "bench", "batch", "--loop", loop_path, out],
        "batch": lambda out: [sys.executable, blink_py, "batch", rows_path, "--out", out],
        "ray": lambda out: [sys.executable, blink_py, "batch", rows_path, "--out", out, "--ray", str(args.workers)],
    }
    first_rows = {"loop": 1, "batch": chunk, "ray": chunk * args.workers}
    # the --ray arms start a local Ray of their own: its files go to a temp folder of the run (ray_temp), not /tmp/ray
    with servers.ray_temp():
        run.probe()
        for rep in range(cfg["repeats"]):  # interleaved, so a slow spell hits one run of an arm
            for name in model_arms:
                out = os.path.join(work, f"{name}-{rep}.jsonl")
                runs[name].append(run_arm(name, commands[name](out), threads, out, first_rows[name]))
        measured = [max(r, key=lambda a: a["rows_per_s"]) for r in runs.values()]  # each arm's fastest run
        reference = answers(measured[0]["out"])
        for arm in measured:
            arm["max_gap_to_loop"] = max_gap(answers(arm["out"]), reference)
            arm["runs_rows_per_s"] = [a["rows_per_s"] for a in runs[arm["arm"]]]
        pipeline: list[dict] = []
        if cfg["pipeline_rows"]:
            many = os.path.join(work, "many.jsonl")
            write_rows(many, cfg["pipeline_rows"])
            for name, arm in arms.of("batch").items():
                if not arm.settings:
                    continue
                workers = args.workers if "ray" in name else 0
                path = os.path.join(work, f"{name.replace(' ', '-')}.jsonl")
                extra = ["--ray", str(workers)] if workers else []
                cmd = [sys.executable, blink_py, "batch", many, "--out", path, *extra]
                pipeline.append(run_arm(name, cmd, arm.env(), path, chunk * max(workers, 1)))
    for arm in measured + pipeline:  # where this run kept its files says nothing about the result
        del arm["out"]
    by = {a["arm"]: a for a in measured}
    result = {
        "model": settings.default_model,
        "rows": cfg["rows"],
        "loop_rows": min(cfg["loop_rows"], cfg["rows"]),
        "workers": args.workers,
        "repeats": cfg["repeats"],
        "threads_per_engine": run.threads or "default",
        "rows_per_call": chunk,
        "token_budget": settings.token_budget,
        "arms": measured,
        "pipeline": pipeline,
        "speedup_batch_over_loop": ratio(by["batch"]["rows_per_s"], by["loop"]["rows_per_s"]),
        "speedup_ray_over_batch": ratio(by["ray"]["rows_per_s"], by["batch"]["rows_per_s"]),
        "speedup_ray_over_batch_steady": ratio(by["ray"]["steady_rows_per_s"], by["batch"]["steady_rows_per_s"]),
    }
    path = run.write(result)
    print("\n".join(batch_report(run.written)))
    times = {
        k: "—" if result[k] is None else f"{result[k]}x"
        for k in ("speedup_batch_over_loop", "speedup_ray_over_batch", "speedup_ray_over_batch_steady")
    }  # None: too few rows to tell
    print(
        f"batch {times['speedup_batch_over_loop']} the hand loop's rows/s; --ray {args.workers} "
        f"{times['speedup_ray_over_batch']} batch's end to end, {times['speedup_ray_over_batch_steady']} steady; "
        f"wrote {path}"
    )
    return 0


def batch_table(res: dict) -> list[str]:
    """rows/s of each arm, when its first rows landed, and how far its answers are from the loop's."""
    head = ["arm", "rows", "wall s", "answer s", "rows/s", "first rows after s", "steady rows/s", "max gap to loop"]
    rows = []
    for a in [*res["arms"], *res["pipeline"]]:
        rate = f"{a['rows_per_s']:,.0f}" if a["rows_per_s"] >= 1000 else f"{a['rows_per_s']:.2f}"
        steady = a["steady_rows_per_s"]
        steady = "—" if not steady else f"{steady:,.0f}" if steady >= 1000 else f"{steady:.2f}"
        first = "—" if a["first_rows_s"] is None else f"{a['first_rows_s']:.1f}"
        gap = "—" if "max_gap_to_loop" not in a else "0" if a["max_gap_to_loop"] == 0 else f"{a['max_gap_to_loop']:.1e}"
        rows.append(
            [arms.title("batch", a["arm"]).format(workers=res["workers"]), f"{a['rows']:,}", f"{a['wall_s']:.1f}"]
            + [f"{a['answer_s']:.1f}", rate, first, steady, gap]
            + [f"{a['load_avg_1min'][0]:.1f}-{a['load_avg_1min'][1]:.1f}"]
        )
    return report.table([*head, "1-min load"], rows)


def batch_report(res: dict) -> list[str]:
    """batch: what ran, then the per-arm table."""
    return [
        f"{res['model']}, {res['rows']} rows ({res['loop_rows']} for the loop), {res['rows_per_call']} rows per "
        f"decide_many call, {res['threads_per_engine']} thread(s) per engine, each model arm's fastest of "
        f"{res['repeats']} runs.",
        "",
        *batch_table(res),
    ]


REPORT = (
    batch_report,
    ("model", "rows", "loop_rows", "rows_per_call", "threads_per_engine", "repeats", "workers", "arms", "pipeline"),
)
