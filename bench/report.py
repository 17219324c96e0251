"""Markdown tables from a results file: `python bench/report.py bench/results/decision.json` (or full.json,
budget.json, overhead.json), for README.md and bench/README.md."""

from __future__ import annotations

import json
import sys

ARM_NAMES = {"blink_plain": "blink", "blink_prefix": "blink prefix", "unbatched": "forward/question",
             "per_option": "per-option LL", "generate": "generate+parse"}


def _s(row: dict) -> str:
    """Seconds of one arm, starred when scaled from a subsample."""
    return f"{row['wall_s']:.2f}{'*' if row['extrapolated'] else ''}"


def cells_table(res: dict) -> list[str]:
    """One row per cell: time per request of every arm and the speed-ups."""
    head = ("| doc tokens | questions | options | " + " | ".join(f"{n} (s)" for n in ARM_NAMES.values())
            + " | blink vs per-option | blink vs forward/question | prefix vs blink | differ (unbatched/per-option/generate) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in res["cells"]:
        a, s, g = c["arms"], c["speedup"], c["agreement"]
        differ = "/".join(f"{len(g[p]['differ'])} of {g[p]['compared']}" for p in ("unbatched", "per_option", "generate"))
        lines.append(f"| {c['doc_tokens']} | {c['questions']} | {c['options']} | "
                     + " | ".join(_s(a[k]) for k in ARM_NAMES)
                     + f" | {s['blink_plain']['per_option']:.1f}x | {s['blink_plain']['unbatched']:.2f}x"
                     f" | {s['blink_prefix']['blink_plain']:.1f}x | {differ} |")
    return lines


def flops_table(res: dict) -> list[str]:
    """Achieved prefill FLOP/s of blink's arms against the measured matmul."""
    lines = ["| doc tokens | questions | options | arm | prefill tokens | GFLOP/s (2PT) | of matmul | "
             "GFLOP/s (body+attention) | of matmul | peak MB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in res["cells"]:
        for arm in ("blink_plain", "blink_prefix"):
            r = c["arms"][arm]
            lines.append(f"| {c['doc_tokens']} | {c['questions']} | {c['options']} | {ARM_NAMES[arm]} | "
                         f"{r['prefill_tokens']} | {r['gflops_2pt']:.0f} | {r['fraction_of_matmul_2pt']:.0%} | "
                         f"{r['gflops_body_attention']:.0f} | {r['fraction_of_matmul_body_attention']:.0%} | "
                         f"{r['peak_mb']:.0f} |")
    return lines


def throughput_table(res: dict) -> list[str]:
    """Requests per second and latency percentiles per batch window."""
    lines = ["| target | workload | window (ms) | shared prefix | clients | requests/s | p50 (ms) | p99 (ms) | "
             "mean requests per forward |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("throughput", []):
        if "skipped" in r:
            lines.append(f"| {r['target']} | skipped: {r['skipped']} | | | | | | | |")
            continue
        window = "-" if r["window_ms"] is None else f"{r['window_ms']:g}"
        lines.append(f"| {r['target']} | {r.get('workload', '')} | {window} | {'on' if r['prefix_cache'] else 'off'} "
                     f"| {r['clients']} | {r['requests_per_s']:.2f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
                     f"{r['mean_batched_requests']} |")
    return lines


CASE_NAMES = {"document": "questions over a new document", "again": "the same document, new questions",
              "short": "one short yes/no question"}


def decision_table(res: dict) -> list[str]:
    """blink at its defaults against pipeline("decision") per case: time per request, ratios, tokens."""
    peers_ = [k[3:] for k in next(iter(res["decision"].values())) if k.startswith("vs_") and k != "vs_unbatched"]
    head = ("| case | questions | prompt tokens | computed by blink | read from the cache | blink (s) | "
            + " | ".join(f"{p} (s) | blink vs {p} (wall / CPU)" for p in peers_) + " | differ from unbatched |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for case, row in res["decision"].items():
        a, reps = row["arms"], len(row["arms"]["blink"]["wall_s"])
        cells = " | ".join(f"{a[p]['total_wall_s'] / reps:.2f} | {row['vs_' + p]['wall']:.2f}x / "
                           f"{row['vs_' + p]['cpu']:.2f}x" for p in peers_)
        lines.append(f"| {CASE_NAMES[case]} | {row['questions']} | {row['prompt_tokens']} | {row['prefill_tokens']} "
                     f"| {row['cached_tokens']} | {a['blink']['total_wall_s'] / reps:.2f} | {cells} | "
                     f"{len(row['vs_unbatched']['differ'])} of {row['vs_unbatched']['compared']} |")
    return lines


def http_table(res: dict) -> list[str]:
    """Requests per second and latency over HTTP, per server and concurrency; skipped servers with the reason."""
    lines = ["| server | clients | requests | requests/s | p50 (ms) | p99 (ms) |", "|---|---|---|---|---|---|"]
    for r in [*res.get("http", []), *res.get("peers_skipped", [])]:
        if "requests_per_s" in r:
            lines.append(f"| {r['target']} | {r['clients']} | {r['completed']} | {r['requests_per_s']:.2f} | "
                         f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} |")
        elif "skipped" in r:
            lines.append(f"| {r['target']} | skipped: {r['skipped']} | | | | |")
    return lines


def targets_list(res: dict) -> list[str]:
    """The speed targets with the measured values."""
    verdict = {True: "met", False: "**missed**",
               None: "the target's own cell is measured by --decision and the full run"}
    out = []
    for t in res["targets"]:
        value = f"{t['value']}" if t["threshold"] == 0 else f"{t['value']:.2f}x ({t['value_cpu_time']:.2f}x on CPU time)"
        extra = f" of {t['compared']} compared" if t["threshold"] == 0 else f" ({t['cell']})"
        out.append(f"- {t['target']}: {value}{extra} — {verdict[t['met']]}")
    return out


def budget_table(res: dict) -> list[str]:
    """bench/budget.py: CPU and wall time of each workload at each value of the setting it varies."""
    lines = ["| workload | setting | value | CPU s (sum of runs) | wall s per run |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['workload']} | `{r['setting']}` | {r['value']:,} | {r['total_cpu_s']:.2f} | "
                     + ", ".join(f"{w:.1f}" for w in r["wall_s"]) + " |")
    return lines


OVERHEAD_STEPS = {"parse_ms": "parse", "render_tokenize_ms": "render + tokenize", "forward_ms": "forward",
                  "answer_meta_ms": "answer + meta", "decide_ms": "whole decide()"}


def overhead_table(res: dict) -> list[str]:
    """bench/overhead.py: CPU ms of each step of one short question, per configuration."""
    lines = ["| configuration | linear layers | " + " | ".join(f"{v} (ms)" for v in OVERHEAD_STEPS.values())
             + " | prompt tokens | computed | from the cache |", "|---|---|" + "---|" * (len(OVERHEAD_STEPS) + 3)]
    for name, r in res["rows"].items():
        lines.append(f"| {name} | {r.get('linear_layers', 'torch')} | "
                     + " | ".join(f"{r[k]:.2f}" for k in OVERHEAD_STEPS)
                     + f" | {r['prompt_tokens']} | {r['computed_tokens']} | {r['cached_tokens']} |")
    return lines


def report(res: dict) -> str:
    """The whole markdown block."""
    if res["command"].startswith("python bench/budget.py"):
        return "\n".join(budget_table(res))
    if res["command"].startswith("python bench/overhead.py"):
        return "\n".join(overhead_table(res))
    head = (f"Measured {res['started_at']} by `{res['command']}` in {res['duration_s'] / 60:.1f} min: {res['model']} "
            f"({res['parameters'] / 1e6:.1f}M parameters, {res['dtype']}, {res['device']}), {res['hardware']}, "
            f"torch {res['torch']} with {res['threads']['threads']} thread(s) ({res['threads']['how']}), "
            f"measured matmul {res['matmul_gflops']:.0f} GFLOP/s (best of the start and the end of the run), blink's "
            f"linear layers by {res['settings'].get('linear_layers', 'torch')}.")
    parts = [head, "", *targets_list(res), "", "Against transformers' pipeline(\"decision\"), time per request "
             "(mean of the repetitions; ratios > 1: blink faster):", "", *decision_table(res), "",
             "Over HTTP (`/v1/systemone`):", "", *http_table(res)]
    if res["cells"]:
        parts += ["", "Time per request (* = scaled from a subsample of the questions, see the JSON):", "",
                  *cells_table(res), "", "Prefill against the machine:", "", *flops_table(res)]
    if res["throughput"]:
        parts += ["", "Serving:", "", *throughput_table(res)]
    return "\n".join(parts)


if __name__ == "__main__":
    with open(sys.argv[1] if len(sys.argv) > 1 else "bench/results/decision.json", encoding="utf-8") as fh:
        print(report(json.load(fh)))
