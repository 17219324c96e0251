"""Bulk decisions: rows per second of `python blink.py batch` on one model, serially and on `--ray N` workers,
beside the loop a user writes by hand (decide() one row at a time), in one run.

    python bench/batch.py                         # 128 rows on the stand-in (5-10 minutes on a 2-core CPU)
    python bench/batch.py --rows 256 --workers 4  # more rows, more Ray workers
    python bench/batch.py --pipeline-rows 0       # skip the no-model runs

Every arm is a fresh process, as a user runs it, over the same rows (a support ticket and one four-way choice each):

- loop: `deployment.decide(state, questions)` per row, appending each answer to OUT (no packing across rows); it
  runs the first --loop-rows rows only (one row at a time, its rate does not depend on how many);
- batch: `python blink.py batch IN --out OUT` (rows packed BLINK_BATCH_MAX_REQUESTS at a time into shared forwards);
- ray: the same command with `--ray N` (a local Ray cluster started by the command; N workers, one engine each).

Each engine runs on --threads CPU threads (default 1, as each Ray worker gets one). The three model arms run
--repeats times (default 2), interleaved, and each arm's fastest run counts (a burst of load from other processes
should cost one run, not the comparison). Reported per arm: the whole
process's wall time (Python start, model load, Ray start included), the answering time
and rows/s that the command's summary line prints, when the first rows landed, and the steady rate after them (the
rows after the first chunk of each worker, over the time after the first chunk landed). The
pipeline runs (`BLINK_MOCK=1`, many rows, no model) measure what the reading, packing, Ray transport and writing
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
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import clock  # noqa: E402
import report  # noqa: E402
import saved  # noqa: E402

import blink  # noqa: E402

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
    t0, rows = time.perf_counter(), 0
    with open(in_path, encoding="utf-8") as src, open(out_path, "w", encoding="utf-8") as out:
        for line in src:
            row = json.loads(line)
            out.write(json.dumps({"id": row["id"], **served.decide(row["state"], row["questions"])}) + "\n")
            out.flush()
            rows += 1
    print(json.dumps({"rows": rows, "answer_s": time.perf_counter() - t0}))


def run_arm(name: str, cmd: list[str], env: dict, out_path: str, first_rows: int) -> dict:
    """One arm in a fresh process: its wall time and the timings it printed; `first_rows` is what the first chunk of
    every worker holds (the steady rate counts the rows after them)."""
    load0 = os.getloadavg()[0]
    wall, _, done = clock.timed(
        lambda: subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT, timeout=3600)
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


def main(argv: list[str] | None = None) -> int:
    """Run the arms, print the table, write bench/results/batch.json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128, help="rows the batch and ray arms answer")
    parser.add_argument("--loop-rows", type=int, default=16, help="rows the hand-written loop answers")
    parser.add_argument("--workers", type=int, default=2, help="Ray workers of the ray arm")
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of each model arm, interleaved; the fastest counts"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads per engine (OMP_NUM_THREADS; 0: torch's default). Ray gives each worker one",
    )
    parser.add_argument("--pipeline-rows", type=int, default=20000, help="rows of the no-model runs (0: skip them)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "batch.json"))
    parser.add_argument("--loop", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)  # the loop arm's process
    args = parser.parse_args(argv)
    if args.loop:
        loop_main(*args.loop)
        return 0
    settings = blink.env_settings()
    chunk = settings.batch_max_requests
    blink_py = os.path.join(ROOT, "blink.py")
    work = tempfile.mkdtemp(prefix="blink-bench-batch-")
    rows_path, loop_path = os.path.join(work, "rows.jsonl"), os.path.join(work, "loop-rows.jsonl")
    write_rows(rows_path, args.rows)
    write_rows(loop_path, min(args.loop_rows, args.rows))
    runs: dict[str, list[dict]] = {"loop": [], "batch": [], "ray": []}
    threads = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    for rep in range(args.repeats):  # interleaved, so a burst of load from elsewhere hits one run of an arm
        out = {name: os.path.join(work, f"{name}-{rep}.jsonl") for name in runs}
        runs["loop"].append(
            run_arm(
                "loop",
                [sys.executable, os.path.abspath(__file__), "--loop", loop_path, out["loop"]],
                threads,
                out["loop"],
                1,
            )
        )
        runs["batch"].append(
            run_arm(
                "batch",
                [sys.executable, blink_py, "batch", rows_path, "--out", out["batch"]],
                threads,
                out["batch"],
                chunk,
            )
        )
        runs["ray"].append(
            run_arm(
                "ray",
                [sys.executable, blink_py, "batch", rows_path, "--out", out["ray"], "--ray", str(args.workers)],
                threads,
                out["ray"],
                chunk * args.workers,
            )
        )
    arms = [max(r, key=lambda a: a["rows_per_s"]) for r in runs.values()]  # each arm's fastest run
    reference = answers(arms[0]["out"])
    for arm in arms:
        arm["max_gap_to_loop"] = max_gap(answers(arm["out"]), reference)
        arm["runs_rows_per_s"] = [a["rows_per_s"] for a in runs[arm["arm"]]]
    pipeline: list[dict] = []
    if args.pipeline_rows:
        many = os.path.join(work, "many.jsonl")
        write_rows(many, args.pipeline_rows)
        for name, workers in (("pipeline", 0), ("pipeline ray", args.workers)):
            path = os.path.join(work, f"{name.replace(' ', '-')}.jsonl")
            extra = ["--ray", str(workers)] if workers else []
            pipeline.append(
                run_arm(
                    name,
                    [sys.executable, blink_py, "batch", many, "--out", path, *extra],
                    {"BLINK_MOCK": "1"},
                    path,
                    chunk * max(workers, 1),
                )
            )
    for arm in arms + pipeline:  # where this run kept its files says nothing about the result
        del arm["out"]
    by = {a["arm"]: a for a in arms}
    result = {
        "command": saved.command("batch.py", argv),
        "model": settings.default_model,
        "hardware": blink.hardware(),
        "rows": args.rows,
        "loop_rows": min(args.loop_rows, args.rows),
        "workers": args.workers,
        "repeats": args.repeats,
        "threads_per_engine": args.threads or "default",
        "rows_per_call": chunk,
        "token_budget": settings.token_budget,
        "arms": arms,
        "pipeline": pipeline,
        "speedup_batch_over_loop": ratio(by["batch"]["rows_per_s"], by["loop"]["rows_per_s"]),
        "speedup_ray_over_batch": ratio(by["ray"]["rows_per_s"], by["batch"]["rows_per_s"]),
        "speedup_ray_over_batch_steady": ratio(by["ray"]["steady_rows_per_s"], by["batch"]["steady_rows_per_s"]),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    saved.write_json(args.out, result)
    print(
        f"{result['model']} on {result['hardware']}; {args.rows} rows ({result['loop_rows']} for the loop), "
        f"{chunk} rows per decide_many call, {result['threads_per_engine']} thread(s) per engine"
    )
    print("\n".join(report.batch_table(result)))
    times = {
        k: "—" if result[k] is None else f"{result[k]}x"
        for k in ("speedup_batch_over_loop", "speedup_ray_over_batch", "speedup_ray_over_batch_steady")
    }  # None: too few rows to tell
    print(
        f"batch {times['speedup_batch_over_loop']} the hand loop's rows/s; --ray {args.workers} "
        f"{times['speedup_ray_over_batch']} batch's end to end, {times['speedup_ray_over_batch_steady']} steady; "
        f"wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
