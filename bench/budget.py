"""How many rows blink runs per forward on this machine: BLINK_TOKEN_BUDGET and BLINK_PREFIX_KV_TOKENS, timed.

Padded tokens per forward (BLINK_TOKEN_BUDGET) and prefix copies x length held at once (BLINK_PREFIX_KV_TOKENS), the
same work at each value, interleaved.

    python -m bench budget           # the workloads below at their full sizes, 3 repetitions
    python -m bench budget --quick   # smaller, one repetition

Workloads: the plain path over many whole prompts and many short requests packed into one call (their tails after
the shared template header), where the token budget splits work; new questions over a kept 1,000-token document,
where the prefix copies bound how many tails run against it at once. CPU time is reported beside wall time (waiting
for a core inflates the wall clock, not this process's CPU time). Writes bench/results/budget.json; the last line
printed is a summary.
"""

from __future__ import annotations

import os
from dataclasses import replace

import blink
from bench.lib import harness, report, workloads

CONFIGS = {
    "full": {"doc": 300, "questions": 16, "short_requests": 64, "kept_doc": 1000, "reps": 3},
    "quick": {"doc": 100, "questions": 4, "short_requests": 16, "kept_doc": 300, "reps": 1},
}
VALUES = {"token_budget": [4096, 32768], "prefix_kv_tokens": [8192, 131072]}


def main(argv: list[str] | None = None) -> int:
    """Measure each budget on both workloads, interleaved; write JSON; print one summary line last."""
    run = harness.Run("budget", argv, __doc__)
    cfg = CONFIGS["quick" if run.quick else "full"]
    base = blink.Settings.from_env({})
    engine = blink.TorchEngine(blink.STANDIN_MODEL, settings=base)
    run.probe()
    doc = workloads.document(engine.tok, cfg["doc"])
    many = blink.parse_request(
        doc, workloads.questions(cfg["questions"], 4, workloads.ticket_count(doc)), settings=base
    )
    shorts = [
        blink.parse_request(
            f"Order {i}: charged twice for one order, the customer wants a refund.",
            {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}},
            settings=base,
        )
        for i in range(cfg["short_requests"])
    ]
    kept = workloads.document(engine.tok, cfg["kept_doc"], seed=3)
    first, again = (
        blink.parse_request(kept, workloads.questions(8, 4, workloads.ticket_count(kept)), settings=base),
        blink.parse_request(
            kept,
            {
                f"new{k}": {**q, "instructions": "Now: " + q["instructions"]}
                for k, q in workloads.questions(8, 4, workloads.ticket_count(kept)).items()
            },
            settings=base,
        ),
    )
    # (setting it varies, shared prefixes on, the work, what runs before it untimed)
    work = {
        f"plain path, {cfg['questions']} questions over {cfg['doc']} tokens": (
            "token_budget",
            False,
            lambda: engine.forward(many),
            lambda: None,
        ),
        f"{cfg['short_requests']} short requests packed": (
            "token_budget",
            True,
            lambda: engine.run([engine.prepare(r) for r in shorts]),
            lambda: None,
        ),
        f"8 new questions over a kept {cfg['kept_doc']}-token document": (
            "prefix_kv_tokens",
            True,
            lambda: engine.forward(again),
            lambda: engine.forward(first),
        ),
    }
    times: dict = {(name, v): [] for name, (field, *_) in work.items() for v in VALUES[field]}
    for _ in range(cfg["reps"] + 1):  # the first round warms up and is not counted
        for name, (field, prefix, fn, before) in work.items():
            for value in VALUES[field]:
                engine.settings = replace(base, prefix_cache=prefix, **{field: value})
                engine.prefixes.clear()
                before()
                wall, cpu, _ = harness.timed(fn)
                times[(name, value)].append((wall, cpu))
    rows = [
        {
            "workload": name,
            "setting": work[name][0],
            "value": value,
            "wall_s": [round(w, 3) for w, _ in runs[1:]],
            "cpu_s": [round(c, 3) for _, c in runs[1:]],
            "total_cpu_s": round(sum(c for _, c in runs[1:]), 3),
        }
        for (name, value), runs in times.items()
    ]
    for r in rows:
        print(f"{r['workload']:>50} {r['setting']} {r['value']:>6}: CPU {r['total_cpu_s']:.2f} s, wall {r['wall_s']}")
    path = run.write({"rows": rows})
    ratios = []
    for name, (field, *_) in work.items():
        small, large = (
            next(r["total_cpu_s"] for r in rows if r["workload"] == name and r["value"] == v)
            for v in (VALUES[field][0], VALUES[field][-1])
        )
        ratios.append(
            f"{name}: {field} {VALUES[field][-1]} takes {large / small:.2f}x the CPU time of {VALUES[field][0]}"
        )
    print(
        f"blink budget ({blink.hardware()}, {run.threads} thread(s), {run.stopwatch.seconds():.0f} s): "
        + "; ".join(ratios)
        + f"; results {os.path.relpath(path)}"
    )
    return 0


def budget_table(res: dict) -> list[str]:
    """CPU and wall time of each workload at each value of the setting it varies."""
    rows = [
        [r["workload"], f"`{r['setting']}`", f"{r['value']:,}", f"{r['total_cpu_s']:.2f}"]
        + [", ".join(f"{w:.1f}" for w in r["wall_s"])]
        for r in res["rows"]
    ]
    return report.table(["workload", "setting", "value", "CPU s (sum of runs)", "wall s per run"], rows)


REPORT = (budget_table, ("rows",))
