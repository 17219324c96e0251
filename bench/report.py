"""Every results file printed whole, as the markdown tables README.md and bench/README.md quote.

    python bench/report.py                                 # every committed file in bench/results
    python bench/report.py bench/results/decision.json     # one file (also: python -m bench report FILE...)
    git show 543d9f8:bench/results/full.json | python bench/report.py -    # a committed earlier run, from stdin

Each file prints its header (the command, the hardware, when and for how long, whether the machine held steady), the
tables of its kind (run's full/decision/quick, budget, overhead, drift, gpu, memory, batch, models, order,
vllm_check, serve, route_sim), then every field those left out; a results file of any other kind prints as generic
tables of its fields, so every file prints, whole."""

from __future__ import annotations

import glob
import json
import os
import sys

if not __package__:  # run as `python bench/report.py`: the package is imported from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import arms, harness  # noqa: E402

GRID = arms.of("grid")


def _s(row: dict) -> str:
    """Seconds of one arm, starred when scaled from a subsample."""
    return f"{row['wall_s']:.2f}{'*' if row['extrapolated'] else ''}"


def _ratio(cell: dict, arm: str, peer: str, digits: int) -> str:
    """How many times faster blink arm `arm` answered than `peer` in one cell, starred when either side was scaled
    from a subsample."""
    scaled = cell["arms"][arm]["extrapolated"] or cell["arms"][peer]["extrapolated"]
    return f"{cell['speedup'][arm][peer]:.{digits}f}x{'*' if scaled else ''}"


def cells_table(res: dict) -> list[str]:
    """One row per cell: time per request of every arm and the speed-ups (* where a side was scaled)."""
    head = (
        "| doc tokens | questions | options | "
        + " | ".join(f"{arm.title} (s)" for arm in GRID.values())
        + " | blink vs per-option | blink vs forward/question | prefix vs blink"
        + " | differ (unbatched/per-option/generate) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in res["cells"]:
        a, g = c["arms"], c["agreement"]
        differ = "/".join(f"{len(g[p]['differ'])} of {g[p]['compared']}" for p in GRID if p in g)
        lines.append(
            f"| {c['doc_tokens']} | {c['questions']} | {c['options']} | "
            + " | ".join(_s(a[k]) for k in GRID)
            + f" | {_ratio(c, 'blink_plain', 'per_option', 1)} | {_ratio(c, 'blink_plain', 'unbatched', 2)}"
            f" | {_ratio(c, 'blink_prefix', 'blink_plain', 1)} | {differ} |"
        )
    return lines


def flops_table(res: dict) -> list[str]:
    """Achieved prefill FLOP/s of blink's arms against the measured matmul."""
    lines = [
        "| doc tokens | questions | options | arm | prefill tokens | GFLOP/s (2PT) | of matmul | "
        "GFLOP/s (body+attention) | of matmul | peak MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in res["cells"]:
        for arm in ("blink_plain", "blink_prefix"):
            r = c["arms"][arm]
            lines.append(
                f"| {c['doc_tokens']} | {c['questions']} | {c['options']} | {GRID[arm].title} | "
                f"{r['prefill_tokens']} | {r['gflops_2pt']:.0f} | {r['fraction_of_matmul_2pt']:.0%} | "
                f"{r['gflops_body_attention']:.0f} | {r['fraction_of_matmul_body_attention']:.0%} | "
                f"{r['peak_mb']:.0f} |"
            )
    return lines


def throughput_table(res: dict) -> list[str]:
    """Requests per second and latency percentiles per batch window."""
    lines = [
        "| target | workload | window (ms) | shared prefix | clients | requests/s | p50 (ms) | p99 (ms) | "
        "mean requests per forward |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res.get("throughput", []):
        if "skipped" in r:
            lines.append(f"| {r['target']} | skipped: {r['skipped']} | | | | | | | |")
            continue
        window = "-" if r["window_ms"] is None else f"{r['window_ms']:g}"
        lines.append(
            f"| {r['target']} | {r.get('workload', '')} | {window} | {'on' if r['prefix_cache'] else 'off'} "
            f"| {r['clients']} | {r['requests_per_s']:.2f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
            f"{r['mean_batched_requests']} |"
        )
    return lines


CASE_NAMES = {
    "document": "questions over a new document",
    "again": "the same document, new questions",
    "short": "one short yes/no question",
}


def decision_table(res: dict) -> list[str]:
    """blink at its defaults against pipeline("decision") per case: time per request, ratios, tokens, and the
    questions where a peer picked another option than blink."""
    peers_ = [k[3:] for k in next(iter(res["decision"].values())) if k.startswith("vs_") and k != "vs_unbatched"]
    head = (
        "| case | questions | prompt tokens | computed by blink | read from the cache | blink (s) | "
        + " | ".join(f"{p} (s) | blink vs {p} (wall / CPU) | {p} picks unlike blink" for p in peers_)
        + " | differ from unbatched |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for case, row in res["decision"].items():
        a, reps = row["arms"], len(row["arms"]["blink"]["wall_s"])
        compared = row["questions"] * row.get("requests_per_rep", 1)  # the first repetition's questions
        cells = " | ".join(
            f"{a[p]['total_wall_s'] / reps:.2f} | {row['vs_' + p]['wall']:.2f}x / "
            f"{row['vs_' + p]['cpu']:.2f}x | {len(row['vs_' + p]['picks_differ_from_blink'])} of {compared}"
            for p in peers_
        )
        lines.append(
            f"| {CASE_NAMES[case]} | {row['questions']} | {row['prompt_tokens']} | {row['prefill_tokens']} "
            f"| {row['cached_tokens']} | {a['blink']['total_wall_s'] / reps:.2f} | {cells} | "
            f"{unbatched(row)} |"
        )
    return lines


def glance_peers(res: dict) -> list[tuple[str, str]]:
    """The peers of the at-a-glance table, in its order, with their column titles: the pipeline at blink's own dtype
    and blink on vLLM first (the same dtype on both sides), then the pipeline as from_pretrained loads the checkpoint,
    then llama.cpp with its prefix reuse (its own 4-bit file); only those the run has."""
    ran = next(iter(res["decision"].values()))
    same = f"pipeline_{res['dtype']}"
    titles = {
        same: f"vs pipeline, {res['dtype']} (same dtype)",
        "blink_vllm": "vs blink on vLLM (same dtype)",
        "pipeline": "vs pipeline as loaded (checkpoint dtype)"
        if f"vs_{same}" in ran
        else f"vs pipeline, {res['dtype']} (same dtype)",
        "llama.cpp_reuse": "vs llama.cpp, Q4_1, prefix reuse",
    }
    return [(peer, title) for peer, title in titles.items() if f"vs_{peer}" in ran]


def glance_table(res: dict) -> list[str]:
    """The decision cases at a glance: blink's time per request and how many times faster it answered than each main
    peer (wall clock; decision_table has every peer, CPU time and the picks)."""
    peers = glance_peers(res)
    head = "| case | blink (s) | " + " | ".join(title for _, title in peers) + " |"
    lines = [head, "|" + "---|" * (len(peers) + 2)]
    for case, row in res["decision"].items():
        blink_s = row["arms"]["blink"]["total_wall_s"] / len(row["arms"]["blink"]["wall_s"])
        ratios = " | ".join(f"{row['vs_' + peer]['wall']:.2f}x" for peer, _ in peers)
        lines.append(f"| {CASE_NAMES[case]} | {blink_s:.2f} | {ratios} |")
    return lines


def unbatched(row: dict) -> str:
    """How many of a case's blink answers picked otherwise than the unbatched path, of how many (a file written
    before the one answer comparison names the two counts differ and compared)."""
    got = row["vs_unbatched"]
    return f"{len(got.get('picks_differ', got.get('differ')))} of {got.get('questions', got.get('compared'))}"


def utilisation_table(res: dict) -> list[str]:
    """Each decision arm's model FLOP utilisation per case: the prefill FLOPs of the non-embedding weights its model
    computed, over its time, against the matmul probe at the dtype it computes in (arms that do not say what they
    computed are left out)."""
    head = [
        "case",
        "arm",
        "dtype",
        "tokens computed (all requests)",
        "model GFLOP/s",
        "matmul probe GFLOP/s (dtype)",
        "model FLOP utilisation",
    ]
    rows = [
        [
            CASE_NAMES[case],
            name,
            a["dtype"],
            f"{a['computed_tokens']:,}",
            f"{a['gflops']:.0f}",
            f"{a['matmul_gflops']:.0f} ({a['probe_dtype']})",
            pct(a["utilisation"]),
        ]
        for case, row in res["decision"].items()
        for name, a in row["arms"].items()
        if a.get("utilisation") is not None
    ]
    return table(head, rows) if rows else []


def http_table(res: dict) -> list[str]:
    """Requests per second and latency over HTTP, per server and concurrency (and workload, where the file names
    one); skipped servers with the reason."""
    rows = res.get("http", [])
    named = any("workload" in r for r in rows)  # files before the two workloads name none
    lines = [
        "| server |" + (" workload |" if named else "") + " clients | requests | requests/s | p50 (ms) | p99 (ms) |",
        "|---|" + ("---|" if named else "") + "---|---|---|---|---|",
    ]
    for r in rows:
        workload = f" {r.get('workload', '')} |" if named else ""
        if "requests_per_s" in r:
            lines.append(
                f"| {r['target']} |{workload} {r['clients']} | {r['completed']} | {r['requests_per_s']:.2f} | "
                f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} |"
            )
        elif "skipped" in r:
            lines.append(f"| {r['target']} |{workload} skipped: {r['skipped']} | | | | |")
    return lines


def targets_list(res: dict) -> list[str]:
    """The speed targets with the measured values."""
    verdict = {
        True: "met",
        False: "**missed**",
        None: "the target's own cell is measured by --decision and the full run",
    }
    out = []
    for t in res["targets"]:
        value = (
            f"{t['value']}" if t["threshold"] == 0 else f"{t['value']:.2f}x ({t['value_cpu_time']:.2f}x on CPU time)"
        )
        extra = f" of {t['compared']} compared" if t["threshold"] == 0 else f" ({t['cell']})"
        if "max_prob_diff_threshold" in t:
            extra += f", largest |dp| {t['max_prob_diff']:.4f}"
        out.append(f"- {t['target']}: {value}{extra} — {verdict[t['met']]}")
    return out


def steadiness_line(res: dict) -> str:
    """Whether the machine held steady over a run, from the matmul probes of its start and end (recomputed for
    a file written before runs recorded the flag)."""
    s = harness.steadiness(*res["matmul_gflops_start_end"])
    start, end = s["matmul_gflops_start_end"]
    probes = (
        f"matmul probe {start:.0f} GFLOP/s at the start of the run and {end:.0f} at its end "
        f"({s['matmul_change']:.0%} apart)"
    )
    if s["unsteady"]:
        return (
            f"**Unsteady machine:** {probes}, more than the {s['unsteady_threshold']:.0%} a steady run stays "
            "within: the machine's speed changed during the run, so read its ratios with care."
        )
    return f"Steady machine: {probes}, within {s['unsteady_threshold']:.0%}."


def run_report(res: dict) -> list[str]:
    """run (full, --decision, --quick): the targets, the decision peers, HTTP, the grid and serving."""
    head = (
        f"Measured {res.get('measured_at') or res['started_at']} by `{res['command']}` in "
        f"{res['duration_s'] / 60:.1f} min: {res['model']} "
        f"({res['parameters'] / 1e6:.1f}M parameters, {res['dtype']}, {res['device']}), {res['hardware']}, "
        f"torch {res['torch']} with {res['threads']['threads']} thread(s) ({res['threads']['how']}), "
        f"measured matmul {res['matmul_gflops']:.0f} GFLOP/s (best of the start and the end of the run)"
        + "".join(f", {d} {max(g):.0f}" for d, g in res.get("matmul_gflops_by_dtype", {}).items())
        + f", blink's linear layers by {res['settings'].get('linear_layers', 'torch')}."
    )
    parts = [head, "", steadiness_line(res), "", *targets_list(res)]
    if res.get("decision"):  # runs before the decision peers existed have none
        utilisation = utilisation_table(res)
        parts += [
            "",
            "At a glance (blink's time per request, the mean of the repetitions, and how many times faster it "
            "answered than each peer, wall clock; the peers at blink's own dtype first):",
            "",
            *glance_table(res),
            "",
            'Against transformers\' pipeline("decision"), time per request (mean of the repetitions; '
            "ratios > 1: blink faster; `pipeline` runs its own built-in prompt, `pipeline_export` blink's "
            "exported one, both on the model as from_pretrained loads it; `pipeline_bfloat16` its own prompt in "
            "blink's dtype (on which model: the file's notes); `llama.cpp` the GGUF file, fed blink's prompt ids; "
            "`blink_vllm` blink on vLLM, over HTTP):",
            "",
            *decision_table(res),
            *(
                [
                    "",
                    "Model FLOP utilisation: the prefill FLOPs of the non-embedding weights each arm's model computed "
                    "(2 x those weights per token; attention and the LM head left out), over its time, against the "
                    "matmul probe at the dtype it computes in:",
                    "",
                    *utilisation,
                ]
                if utilisation
                else []
            ),
            *(
                [""] + [f"- {r['target']}: skipped, {r['skipped']}" for r in res.get("peers_skipped", [])]
                if res.get("peers_skipped")
                else []
            ),
            "",
            "Over HTTP (`/v1/systemone`):",
            "",
            *http_table(res),
        ]
    if res["cells"]:
        parts += [
            "",
            "Time per request (* = scaled from a subsample of the questions, see the JSON; a ratio is "
            "starred when either of its sides is):",
            "",
            *cells_table(res),
            "",
            "Prefill against the machine:",
            "",
            *flops_table(res),
        ]
    if res["throughput"]:
        parts += ["", "Serving:", "", *throughput_table(res)]
    return parts


def budget_table(res: dict) -> list[str]:
    """bench/budget.py: CPU and wall time of each workload at each value of the setting it varies."""
    lines = ["| workload | setting | value | CPU s (sum of runs) | wall s per run |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(
            f"| {r['workload']} | `{r['setting']}` | {r['value']:,} | {r['total_cpu_s']:.2f} | "
            + ", ".join(f"{w:.1f}" for w in r["wall_s"])
            + " |"
        )
    return lines


OVERHEAD_STEPS = {
    "parse_ms": "parse",
    "render_tokenize_ms": "render + tokenize",
    "forward_ms": "forward",
    "answer_meta_ms": "answer + meta",
    "decide_ms": "whole decide()",
}


def overhead_table(res: dict) -> list[str]:
    """bench/overhead.py: CPU ms of each step of one short question, per configuration."""
    lines = [
        "| configuration | linear layers | "
        + " | ".join(f"{v} (ms)" for v in OVERHEAD_STEPS.values())
        + " | prompt tokens | computed | from the cache |",
        "|---|---|" + "---|" * (len(OVERHEAD_STEPS) + 3),
    ]
    for name, r in res["rows"].items():
        lines.append(
            f"| {name} | {r.get('linear_layers', 'torch')} | "
            + " | ".join(f"{r[k]:.2f}" for k in OVERHEAD_STEPS)
            + f" | {r['prompt_tokens']} | {r['computed_tokens']} | {r['cached_tokens']} |"
        )
    return lines


def shape4b_table(res: dict) -> list[str]:
    """bench/shape4b.py: each arm's seconds per case and its resident memory (GB of 2^30 bytes, VmRSS and VmHWM)."""
    cases = next(iter(res["arms"].values()))["cases"]
    head = ["arm", "load s", *(f"{c} s ({got['prompt_tokens']} tokens)" for c, got in cases.items())]
    head += ["resident after load", "resident after the runs", "peak resident (load included)", "weights"]
    gb = lambda mb: f"{mb / 1024:.1f} GB"  # noqa: E731
    rows = [
        [name, r["load_s"], *(", ".join(f"{w:.2f}" for w in r["cases"][c]["wall_s"]) for c in cases)]
        + [gb(r["loaded"]["rss_mb"]), gb(r["after"]["rss_mb"]), gb(r["after"]["peak_rss_mb"]), gb(r["weights_mb"])]
        for name, r in res["arms"].items()
    ]
    ratios = ", ".join(f"{c} {v}x" for c, v in res["int8_time_ratio"].items())
    return table(head, rows) + ["", f"int8 over bfloat16, median time: {ratios}"]


def quantfloor_table(res: dict) -> list[str]:
    """bench/quantfloor.py: each arm's largest probability difference from float32 and its picks that differ, per
    log, and its worst against the bound."""
    arms = list(res["rows"][0]["arms"])
    head = ["arm", *(f"{r['doc_tokens']}-token log" for r in res["rows"]), f"largest (bound {res['bound']})"]
    rows = [
        [arm]
        + [f"{r['arms'][arm]['max_prob_diff']:.4f} ({len(r['arms'][arm]['picks_differ'])})" for r in res["rows"]]
        + [f"{res['worst'][arm]:.4f} {'within' if res['worst'][arm] <= res['bound'] else 'over'}"]
        for arm in arms
    ]
    return table(head, rows) + ["", "Each cell: the largest probability difference (the picks that differ)."]


DRIFT_MODELS = {"stand-in": "stand-in", "qwen3.5-tiny": "tiny Qwen3.5 (linear + full attention)"}


def drift_table(res: dict) -> list[str]:
    """bench/drift.py: each arm against float32 on torch's kernels, per model and document: the largest probability
    difference, the picks that differ, and its speed (CPU time) against float32's."""
    arms = [a for a in res["rows"][0]["arms"] if a != "float32"]
    lines = [
        "| model | evidence tokens | float32 CPU s | "
        + " | ".join(f"{a}: × float32 / largest probability difference / picks that differ" for a in arms)
        + " |",
        "|---|---|---|" + "---|" * len(arms),
    ]
    for r in res["rows"]:
        cells = []
        for a in arms:
            v = r["arms"][a]
            speed = f"{v['speedup_cpu']:.2f}×" if "speedup_cpu" in v else "untimed"
            cells.append(f"{speed} / {v['max_prob_diff']:.4f} / {len(v['picks_differ'])} of {r['questions']}")
        lines.append(
            f"| {DRIFT_MODELS.get(r['model'], r['model'])} | {r['doc_tokens']} | "
            f"{r['arms']['float32']['cpu_s']:.2f} | " + " | ".join(cells) + " |"
        )
    return lines


def gpu_table(res: dict) -> list[str]:
    """gpu: each arm's median time and one deployment's peak GPU memory per log, and the shared prefixes' speedup
    over the plain path."""
    names = list(res["rows"][0]["arms"])
    lines = [
        "| log tokens | "
        + " | ".join(f"{arms.title('gpu', a)}: ms / peak GiB" for a in names)
        + " | shared prefixes × plain |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    for r in res["rows"]:
        cells = " | ".join(f"{r['arms'][a]['wall_s'] * 1000:.0f} / {r['arms'][a]['peak_gib']:.2f}" for a in names)
        lines.append(f"| {r['doc_tokens']} | {cells} | {r['arms']['default']['speedup_vs_plain']:.2f}× |")
    return lines


def memory_table(res: dict) -> list[str]:
    """bench/memory.py: each run's resident-memory growth over its start along the stream, against the target."""
    docs = res["config"]["docs"]
    marks = sorted({1, docs // 2, docs})
    lines = [
        f"| run | dtype | freed memory released | start MB | growth after document {'/'.join(map(str, marks))} "
        f"(MB) | largest peak growth (MB) | within bound + {res['target_mb'] - res['config']['bound_mb']} MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        growth = "/".join(f"+{r['points'][m - 1]['growth_mb']}" for m in marks)
        lines.append(
            f"| {r['arm']} | {r['dtype']} | {'yes' if r['release_memory'] else 'no'} | {r['start_mb']} | "
            f"{growth} | +{r['max_peak_growth_mb']} | {'yes' if r['within_target'] else 'no'} |"
        )
    return lines


def batch_table(res: dict) -> list[str]:
    """bench/batch.py: rows/s of each arm, when its first rows landed, and how far its answers are from the loop's."""
    lines = [
        "| arm | rows | wall s | answer s | rows/s | first rows after s | steady rows/s | max gap to loop | "
        "1-min load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for a in [*res["arms"], *res["pipeline"]]:
        rate = f"{a['rows_per_s']:,.0f}" if a["rows_per_s"] >= 1000 else f"{a['rows_per_s']:.2f}"
        steady = a["steady_rows_per_s"]
        steady = "—" if not steady else f"{steady:,.0f}" if steady >= 1000 else f"{steady:.2f}"
        first = "—" if a["first_rows_s"] is None else f"{a['first_rows_s']:.1f}"
        gap = "—" if "max_gap_to_loop" not in a else "0" if a["max_gap_to_loop"] == 0 else f"{a['max_gap_to_loop']:.1e}"
        lines.append(
            f"| {arms.title('batch', a['arm']).format(workers=res['workers'])} | {a['rows']:,} | "
            f"{a['wall_s']:.1f} | {a['answer_s']:.1f} | {rate} | {first} | {steady} | {gap} | "
            f"{a['load_avg_1min'][0]:.1f}-{a['load_avg_1min'][1]:.1f} |"
        )
    return lines


def batch_report(res: dict) -> list[str]:
    """batch: what ran, then the per-arm table."""
    return [
        f"{res['model']}, {res['rows']} rows ({res['loop_rows']} for the loop), {res['rows_per_call']} rows per "
        f"decide_many call, {res['threads_per_engine']} thread(s) per engine, each model arm's fastest of "
        f"{res['repeats']} runs.",
        "",
        *batch_table(res),
    ]


def order_table(res: dict) -> list[str]:
    """bench/order.py: how often a choice flips when only its options' order changes, per arm."""
    plain = res["arms"]["plain"]["prompts"]
    lines = [
        "| arm | questions that flip | picks unlike the listed order's | accuracy | prompts (x plain) | "
        "model s | mean label mass |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, a in res["arms"].items():
        lines.append(
            f"| {name} | {a['flip_rate']:.0%} | {a['disagreement']:.0%} | {a['accuracy']:.0%} | "
            f"{a['prompts']} ({a['prompts'] / plain:.1f}x) | {a['model_ms'] / 1000:.1f} | "
            f"{a['mean_label_mass']:.3f} |"
        )
    return lines


def order_report(res: dict) -> list[str]:
    """order: what ran, then the per-arm table."""
    return [
        f"{res['model']}, {res['questions']} questions under every rotation of their options, temperature "
        f"{res['temperature']:g}.",
        "",
        *order_table(res),
    ]


def pct(x: float | None) -> str:
    """A share as a whole percentage ('-' when unknown)."""
    return "-" if x is None else f"{100 * x:.0f}%"


def mb(n: int) -> str:
    """Bytes in MB."""
    return f"{n / 1e6:,.0f} MB"


def table(head: list[str], rows: list[list]) -> list[str]:
    """A markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def identity_table(models: dict) -> list[str]:
    """models: what each model is (as its GGUF file says), its size and load time."""
    return table(
        [
            "model",
            "GGUF name",
            "fine-tune",
            "own chat template",
            "licence",
            "loads as",
            "parameters",
            "installed",
            "fp32 folder",
            "load (CPU)",
        ],
        [
            [
                n,
                m["gguf_name"],
                m["gguf_finetune"] or "none (base)",
                "yes" if m["gguf_chat_template"] else "no",
                m["gguf_license"],
                m["architecture"],
                f"{m['parameters'] / 1e6:.0f} M",
                mb(m["installed_bytes"]),
                mb(m["folder_bytes"]),
                f"{m['load_s']:.1f} s ({m['load_cpu_s']:.1f} s)",
            ]
            for n, m in models.items()
        ],
    )


def quality_table(models: dict) -> list[str]:
    """models: how each model answers the labelled set and the document's questions."""
    rows = []
    for name, m in models.items():
        q, o, d = m["quality"]["as_written"], m["quality"]["every_order"], m["document"]
        rows.append(
            [
                name,
                f"{pct(q['accuracy'])} ({q['correct']}/{q['questions']})",
                pct(q["chance"]),
                pct(q["accuracy_choice"]),
                pct(q["accuracy_noul"]),
                pct(q["accuracy_score"]),
                f"{q['label_mass']:.3f}",
                pct(q["choice_picks_first"]),
                pct(q["choice_first_correct"]),
                pct(o["accuracy_correct_last"]),
                pct(o["accuracy_over_orders"]),
                f"{pct(o['picks_first_over_orders'])} (fair {pct(o['first_fair_share'])})",
                f"{pct(q['noul_yes'])} ({pct(q['noul_yes_correct'])} are yes)",
                f"{d['correct']}/{d['questions']}",
            ]
        )
    return table(
        [
            "model",
            "accuracy",
            "chance",
            "choice",
            "yes/no",
            "score",
            "mean label mass",
            "picks 1st option",
            "1st option correct",
            "acc., correct shown last",
            "acc., mean over orders",
            "picks 1st, all orders",
            "answers yes",
            "document",
        ],
        rows,
    )


def speed_table(models: dict) -> list[str]:
    """models: wall and CPU ms per question, for one short question and for each of the document's questions."""
    return table(
        [
            "model",
            "1 short question: ms (CPU ms)",
            "questions over the document: ms per question (CPU)",
            "prompt tokens (short / document)",
        ],
        [
            [
                name,
                f"{s['short']['wall_ms']:.0f} ({s['short']['cpu_ms']:.0f})",
                f"{s['document']['wall_ms_per_question']:.0f} ({s['document']['cpu_ms_per_question']:.0f})",
                f"{s['short']['prompt_tokens']} / {s['document']['prompt_tokens']:,}",
            ]
            for name, s in ((n, m["speed"]) for n, m in models.items())
        ],
    )


def models_report(res: dict) -> list[str]:
    """models: the three tables and the candidates that were skipped."""
    models = res["models"]
    tables = [*identity_table(models), "", *quality_table(models), "", *speed_table(models)] if models else []
    return tables + [f"Skipped {name}: not installed ({cmd})." for name, cmd in res["skipped"].items()]


def vllm_report(res: dict) -> list[str]:
    """vllm_check: each blink arm's answers against the reference's, then /v1/systemone throughput (per workload where
    the file has two: vllm_serving; else per arm and concurrency with the ratio to the reference), then what vLLM's
    own route did."""
    reference = res["answers"]["reference"]
    compared = res["answers"]["arms"]
    lines = [
        f"Answers of {res['answers']['requests']} System One requests against {arms.title('vllm_check', reference)}:",
        "",
        *table(
            ["arm", "largest probability gap", "picks that differ"],
            [
                [
                    arms.title("vllm_check", a),
                    f"{r['max_prob_diff']:.2g}",
                    f"{len(r['picks_differ'])} of {r['questions']}",
                ]
                for a, r in compared.items()
            ],
        ),
    ]
    rows = res["http"]["rows"]
    lines += vllm_serving(res) if "workloads" in res["http"] else vllm_levels(rows, reference)
    lines += [
        "",
        "Latency:",
        "",
        *table(
            ["arm", *(["workload"] if "workloads" in res["http"] else []), "clients", "requests", "requests/s"]
            + ["p50 (ms)", "p99 (ms)"],
            [
                [
                    arms.title("vllm_check", r["target"]),
                    *([r["workload"]] if "workloads" in res["http"] else []),
                    r["clients"],
                    r["completed"],
                    f"{r['requests_per_s']:.2f}",
                    f"{r['p50_ms']:.0f}",
                    f"{r['p99_ms']:.0f}",
                ]
                for r in rows
            ],
        ),
        "",
        f"vLLM's own route: {res['vllm_own_route']}",
        *(f"Not up: {name}: {why}" for name, why in res["not_up"].items()),
    ]
    return lines


def ratio_key(name: str) -> str:
    """The field of a row holding its requests/s over those of the arm `name` at the same workload and level."""
    return f"vs_{name.replace(' ', '_')}"


def vllm_levels(rows: list[dict], reference: str) -> list[str]:
    """vllm_check files of one workload: requests/s per arm and concurrency, with the ratio to the reference."""
    names = list(dict.fromkeys(r["target"] for r in rows))
    ratio = ratio_key(reference)
    by = {(r["target"], r["clients"]): r for r in rows}
    levels = sorted({r["clients"] for r in rows})

    def rate(name: str, clients: int) -> str:
        r = by.get((name, clients))
        if r is None:
            return "—"
        return f"{r['requests_per_s']:.2f}" + ("" if name == reference else f" ({r[ratio]:.2f}×)")

    return [
        "",
        "Throughput, `/v1/systemone` requests/s (ratio to the reference):",
        "",
        *table(
            ["clients", *(arms.title("vllm_check", n) for n in names)],
            [[c, *(rate(n, c) for n in names)] for c in levels],
        ),
    ]


def vllm_serving(res: dict) -> list[str]:
    """vllm_check's two workloads: per workload and concurrency, blink on torch's and blink on vLLM's requests/s and
    their ratio (the target: at least 1.0x), then the targets."""
    torch_arm, vllm_arm = res["http"]["pair"]
    by = {(r["target"], r["workload"], r["clients"]): r for r in res["http"]["rows"]}
    ratio = ratio_key(vllm_arm)
    rows = []
    for load, what in res["http"]["workloads"].items():
        for clients in res["http"]["clients"]:
            mine, theirs = by.get((torch_arm, load, clients)), by.get((vllm_arm, load, clients))
            rows.append(
                [
                    f"{load} ({what})",
                    clients,
                    f"{mine['requests_per_s']:.2f}" if mine else "—",
                    f"{theirs['requests_per_s']:.2f}" if theirs else "—",
                    f"{mine[ratio]:.2f}×" if mine and ratio in mine else "—",
                ]
            )
    verdict = {True: "met", False: "**missed**", None: "the target's levels are measured by the full run"}
    return [
        "",
        f"Throughput, `/v1/systemone` requests/s, {res['http']['per_level']} requests per level:",
        "",
        *table(
            [
                "workload",
                "clients",
                arms.title("vllm_check", torch_arm),
                arms.title("vllm_check", vllm_arm),
                f"{arms.title('vllm_check', torch_arm)} / {arms.title('vllm_check', vllm_arm)}",
            ],
            rows,
        ),
        "",
        *(f"- {t['target']}: {t['value']:.2f}x — {verdict[t['met']]}" for t in res.get("targets", [])),
    ]


def vllm_summary(res: dict, path: str) -> str:
    """vllm_check's last line: the answers' largest gap per arm, then the throughput targets."""
    gaps = [
        f"{arms.title('vllm_check', a)} |dp| {r['max_prob_diff']:.2g}, {len(r['picks_differ'])} picks differ"
        for a, r in res["answers"]["arms"].items()
    ]
    verdict = {True: "met", False: "MISSED", None: "quick"}
    rates = [
        f"{t['workload']} x{t['value']:.2f} at {t['clients']} client(s) ({verdict[t['met']]})" for t in res["targets"]
    ]
    torch_arm, vllm_arm = res["http"]["pair"]
    return (
        f"blink vllm_check ({'quick, ' if res['quick'] else ''}{res['hardware']}, {res['duration_s']:.0f} s): "
        f"{'; '.join(gaps)}; {torch_arm} over {vllm_arm} requests/s: {', '.join(rates) or 'not measured'}"
        + "".join(f"; not up: {name}: {why}" for name, why in res["not_up"].items())
        + f"; results {os.path.relpath(path)}"
    )


def _cell(value) -> str:
    """One value of a generic table: numbers to 4 significant digits, lists and objects as JSON, whole (a "|" escaped,
    so that it stays in its cell)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False).replace("|", "\\|")
    return "—" if value is None else str(value).replace("|", "\\|")


def _scalar(value) -> bool:
    """A value a table cell holds as it is (not a nested list or object)."""
    return not isinstance(value, (list, dict))


def _table(rows: list[tuple[str, dict]], first: str) -> list[str]:
    """A markdown table of named rows, one column per field any row has (nested fields as compact JSON)."""
    columns = list(dict.fromkeys(k for _, row in rows for k in row))
    lines = ["| " + " | ".join([first, *columns]) + " |", "|" + "---|" * (len(columns) + 1)]
    return lines + [
        "| " + " | ".join([_cell(name), *(_cell(row.get(k)) for k in columns)]) + " |" for name, row in rows
    ]


def generic_report(res) -> list[str]:
    """Any results fields: the plain ones as a list, then one table per list or map of objects (a file of a kind this
    script has no tables for, e.g. a new benchmark's, still prints, whole)."""
    if not isinstance(res, dict):
        res = {"results": res}
    fields, tables = [], []
    for key, value in res.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables += ["", f"{key}:", "", *_table([(str(i), v) for i, v in enumerate(value)], "#")]
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            tables += ["", f"{key}:", "", *_table(list(value.items()), "name")]
        elif isinstance(value, dict) and value and all(_scalar(v) for v in value.values()):
            fields.append(f"- {key}: " + ", ".join(f"{k} {_cell(v)}" for k, v in value.items()))
        else:
            fields.append(f"- {key}: {_cell(value)}")
    return [*fields, *tables]


# ---------------------------------------------------------------------------------------------------------------
# The line a benchmark ends with
# ---------------------------------------------------------------------------------------------------------------


def run_summary(res: dict, path: str) -> str:
    """run's last line: the decision targets first, then the grid's and serving's."""
    parts = [
        f"blink bench ({res['mode']}{', quick' if res['quick'] else ''}, {res['model']}, {res['hardware']}, "
        f"{res['threads']['threads']} "
        f"thread(s), {res['duration_s']:.0f} s)"
    ]
    if res.get("unsteady"):
        start, end = res["matmul_gflops_start_end"]
        parts.append(
            f"UNSTEADY machine: matmul {start:.0f} GFLOP/s at the start, {end:.0f} at the end "
            f"({res['matmul_change']:.0%} change, over {res['unsteady_threshold']:.0%})"
        )
    verdict = {True: "met", False: "MISSED", None: "target is for the full run's cell"}
    for t in res["targets"]:
        if t["threshold"] == 0:
            parts.append(f"{t['value']} of {t['compared']} answers differ from unbatched ({verdict[t['met']]})")
        else:
            both = (
                verdict[t["met"]]
                if t["met"] is None
                else f"wall {verdict[t['met']]}, CPU time {verdict[t['met_cpu_time']]}"
            )
            parts.append(
                f"{t['short']} {t['value']:.1f}x wall, {t['value_cpu_time']:.1f}x CPU time "
                f"(target {t['threshold']:g}x) at {t['cell']} ({both})"
            )
    if res["cells"]:
        best = max(
            (a.get("fraction_of_matmul_body_attention", 0), name) for c in res["cells"] for name, a in c["arms"].items()
        )
        parts.append(f"best prefill {best[0]:.0%} of measured matmul peak ({best[1]})")
    batcher = [r for r in res["throughput"] if r.get("target") == "Batcher" and not r.get("prefix_cache")]
    if batcher:
        top = max(batcher, key=lambda r: r["requests_per_s"])
        parts.append(
            f"Batcher {top['requests_per_s']:.2f} req/s at {top['window_ms']:g} ms (p99 {top['p99_ms']:.0f} ms)"
        )
    http = {(r["target"], r.get("clients")): r for r in res["http"] if "requests_per_s" in r}
    serve_name, own_name = arms.of("http")
    for clients in sorted({r["clients"] for r in http.values()}):
        serve, own = http.get((serve_name, clients)), http.get((own_name, clients))
        if serve and own:
            parts.append(
                f"/v1/systemone x{own['requests_per_s'] / serve['requests_per_s']:.1f} transformers serve "
                f"at {clients} client(s)"
            )
    skipped = [f"{r['target']}: {r['skipped']}" for r in [*res["http"], *res["peers_skipped"]] if "skipped" in r]
    if skipped:
        parts.append("skipped " + "; ".join(skipped))
    parts.append(f"results {os.path.relpath(path)}")
    return "; ".join(parts)


def drift_summary(res: dict, path: str) -> str:
    """drift's last line: bfloat16's and int8's speed on the stand-in and their largest drift."""
    stand = [r for r in res["rows"] if r["model"] == "stand-in"]
    mode = "quick" if res["quick"] else "full"
    parts = []
    for arm in ("bfloat16", "int8"):
        w = res["worst"][arm]
        speed = "/".join(f"{r['arms'][arm]['speedup_cpu']:.2f}" for r in stand)
        parts.append(
            f"{arm}: stand-in {speed}x float32's speed (CPU time; logs of "
            f"{'/'.join(str(r['doc_tokens']) for r in stand)} tokens), largest probability difference "
            f"{w['max_prob_diff']:.4f}, picks differ {w['picks_differ']} of {w['asked']}"
        )
    return (
        f"blink precision ({mode}, {res['hardware']}, {res['threads']} thread, {res['duration_s']:.0f} s): "
        f"{'; '.join(parts)}; results {os.path.relpath(path)}"
    )


def memory_summary(res: dict, path: str) -> str:
    """memory's last line: each run's largest growth and peak against the target."""
    parts = [
        f"{r['arm']} {r['dtype']} {'released' if r['release_memory'] else 'kept'} +{r['max_growth_mb']} MB"
        f" (peak +{r['max_peak_growth_mb']})"
        for r in res["runs"]
    ]
    mode = "quick" if res["quick"] else "full"
    return (
        f"blink memory ({mode}, {res['config']['docs']} documents of ~{res['config']['doc_tokens']} "
        f"tokens, bound {res['config']['bound_mb']} MB, target +{res['target_mb']} MB): {'; '.join(parts)}; "
        f"results {os.path.relpath(path)}"
    )


def serve_arm(r: dict) -> str:
    """A serve row's arm as tables name it (rule lead with its lead)."""
    return arms.title("serve", r["arm"]).format(lead=r.get("lead"))


def serve_table(res: dict) -> list[str]:
    """bench/serve.py: per workload and arm (and draw, where there were several), req/s, latency, cached share, the
    split over replicas and the answers against in-process decide(); where the run counted them, the prompt tokens
    each replica computed, all of them a second, and the machine's load as the workload ended."""
    draws = any("draw" in r for r in res["rows"]) and res.get("draws", 1) > 1
    work = all("computed_per_s" in r for r in res["rows"])
    lines = [
        "| workload | arm |"
        + (" draw |" if draws else "")
        + " req/s | p50 s | p99 s | cached share | requests per replica | documents split |"
        + (" computed tokens per replica | computed tokens/s | load (1 min) |" if work else "")
        + " vs in-process: largest gap, picks changed |",
        "|---|---|"
        + ("---|" if draws else "")
        + "---|---|---|---|---|---|"
        + ("---|---|---|" if work else "")
        + "---|",
    ]
    for r in res["rows"]:
        split = f"{r['documents_split']} of {r['documents_asked_again']}" if r["documents_asked_again"] else "—"
        vs = r["vs_in_process"]
        computed = (
            f" {'/'.join(map(str, r['computed_by_replica']))} | {r['computed_per_s']:.0f} | {r['load_1m']:.2f} |"
            if work
            else ""
        )
        lines.append(
            f"| {r['workload']} | {serve_arm(r)} |" + (f" {r['draw']} |" if draws else "") + f" {r['req_per_s']:.3f} "
            f"| {r['p50_s']:.2f} | {r['p99_s']:.2f} | {r['cached_share']:.1%} | "
            f"{'/'.join(map(str, r['by_replica']))} | {split} |{computed} {vs['max_prob_diff']:.1e}, "
            f"{len(vs['picks_differ'])} of {vs['questions']} |"
        )
    return lines


def serve_spread_table(res: dict) -> list[str]:
    """bench/serve.py over several draws: each arm's figures on each workload, median (min-max) over its draws."""

    def cell(s: dict, fmt: str) -> str:
        return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"

    lines = [
        "| workload | arm | draws | req/s median (min-max) | p50 s | p99 s | cached share "
        "| documents split, each draw |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["spread"]:
        split = ", ".join(map(str, r["documents_split"])) + f" of {r['documents_asked_again']}"
        lines.append(
            f"| {r['workload']} | {serve_arm(r)} | {r['draws']} | {cell(r['req_per_s'], '.3f')} | "
            f"{cell(r['p50_s'], '.2f')} | {cell(r['p99_s'], '.2f')} | {cell(r['cached_share'], '.1%')} | "
            f"{split if r['documents_asked_again'] else '—'} |"
        )
    return lines


def serve_target_line(t: dict) -> str:
    """One target: its value (over draws: the median, each draw's value and in how many it was met)."""
    verdict = "met" if t["met"] else "MISSED"
    if "values" not in t:
        return f"- {t['target']}: {t['value']} ({verdict})"
    each = ", ".join(map(str, t["values"]))
    where = "every draw" if t["met"] else "some draws"
    return (
        f"- {t['target']}: median {t['value']}, each draw {each} (min {t['min']}, max {t['max']}); met in "
        f"{t['met_in']} of {len(t['values'])} draws ({verdict} in {where})"
    )


def serve_report(res: dict) -> list[str]:
    """serve: what ran, the spread over draws (where there were several), the table, then the targets."""
    c = res["config"]
    names = c.get("workloads", ["reask", "distinct", "hot"])
    work = [f"re-ask {c['docs']} documents x {c['asks']} asks"]
    work += [f"distinct {2 * c['docs']} documents"] if "distinct" in names else []
    lines = [
        f"{res['model']} in {res['dtype']} on {res['cluster']}; documents of ~{c['words']:,} words; "
        f"{' and '.join(work)} from {c['clients']} clients"
        + (f", hot {c['hot_requests']} requests from {2 * c['clients']}" if "hot" in names else "")
        + f"; BLINK_ROUTE_MAX_LEAD {res['default_lead']} unless the arm says."
        + (
            f" {res['draws']} draws: every arm deployed {res['draws']} times, the arms taking turns (new replica ids "
            "each time, so new homes for the documents)."
            if res.get("draws", 1) > 1
            else ""
        ),
        "",
    ]
    if res.get("draws", 1) > 1:
        lines += ["Over the draws:", "", *serve_spread_table(res), "", "Each draw:", ""]
    lines += [*serve_table(res), "", *(serve_target_line(t) for t in res["targets"])]
    if res.get("draws", 1) > 1:
        lines.append(f"- draws meeting every target at once: {res['met_at_once']} of {res['draws']}")
    return lines


def serve_summary(res: dict, path: str) -> str:
    """serve's last line: evidence routing's re-ask figures against one replica and the other routers (medians over
    the draws), and the hot workload's p99."""
    if res.get("spread"):
        at = {
            (r["workload"], r["arm"]): {k: r[k]["median"] for k in ("req_per_s", "p99_s", "cached_share")}
            for r in res["spread"]
            if "lead" not in r
        }
    else:
        at = {(r["workload"], r["arm"]): r for r in res["rows"] if "lead" not in r}
    ev = at[("reask", "evidence")]
    peers = ", ".join(
        f"{ev['req_per_s'] / at[('reask', peer)]['req_per_s']:.2f}x {arms.title('serve', peer)}"
        for peer in ("one_replica", "pow2", "prefix_tree")
    )
    hot = (
        f"hot p99 {at[('hot', 'evidence')]['p99_s']:.1f} s (pow2 {at[('hot', 'pow2')]['p99_s']:.1f} s); "
        if ("hot", "evidence") in at
        else ""
    )
    met = sum(t["met"] for t in res["targets"])
    return (
        f"blink on Ray Serve ({'quick' if res['quick'] else 'full'}, {res['hardware']}, {res['duration_s']:.0f} s): "
        f"re-ask under evidence {ev['req_per_s']:.2f} req/s = {peers}; cached share {ev['cached_share']:.1%} "
        f"(one replica {at[('reask', 'one_replica')]['cached_share']:.1%}); {hot}targets met {met} of "
        f"{len(res['targets'])}; "
        f"results {os.path.relpath(path)}"
    )


def route_sim_report(res: dict) -> list[str]:
    """route_sim: the cost model, the check against serve.json, each size's grid, then the targets."""
    lines = ["Cost model (seconds):", "", "| parameter | value | from | measured by |", "|---|---|---|---|"]
    for name, p in res["cost_model"].items():
        lines.append(f"| {name} | {p['value']} | {p['from']} | `{p['command']}` |")
    lines += [
        "",
        "Against serve.json's two-node runs (sim / committed; draws: replica-id draws averaged; homes as run: the "
        "ids drawn so the re-ask documents' rendezvous homes split as in the committed run):",
        "",
        "| workload | arm | draws | homes as run | req/s sim / real | ratio | cached share sim / real "
        "| p99 s sim / real |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["check"]:
        arm = r["arm"] + (f" lead {r['lead']}" if "lead" in r else "")
        lines.append(
            f"| {r['workload']} | {arm} | {r['draws']} | {'yes' if r['homes_as_run'] else 'no'} | "
            f"{r['sim']['req_per_s']:.3f} / {r['real']['req_per_s']:.3f} | {r['req_per_s_ratio']:.2f} | "
            f"{r['sim']['cached_share']:.1%} / {r['real']['cached_share']:.1%} | {r['sim']['p99_s']:.1f} / "
            f"{r['real']['p99_s']:.1f} |"
        )
    if res.get("predicted"):
        lines += ["", "serve.json's workloads under the default (bounded) evidence rule, predicted:", ""]
        lines += [f"- {t['target']}: {t['value']} ({'met' if t['met'] else 'MISSED'})" for t in res["predicted"]]
    for replicas in sorted({r["replicas"] for r in res["rows"]}):
        lines += [
            "",
            f"{replicas} replicas, {10 * replicas} documents, {res['asks_per_replica'] * replicas} requests:",
            "",
            "| zipf s | load | arm | req/s | p50 s | p99 s | cached share / ideal | packed misses | max/mean work "
            "| moved by leave, join |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in res["rows"] if r["replicas"] == replicas):
            moved = r.get("moved")
            shown = ", ".join(f"{m['documents']} ({m['ratio']:.2f}x share)" for m in moved.values()) if moved else "—"
            lines.append(
                f"| {r['zipf_s']} | {r['load']:.0%} | {r['arm']} | {r['req_per_s']:.2f} | {r['p50_s']:.1f} | "
                f"{r['p99_s']:.1f} | {r['cached_share']:.1%} / {r['ideal_cached_share']:.1%} | "
                f"{r['packed_misses']:.1%} | {r['max_over_mean_work']:.2f} | {shown} |"
            )
    lines += ["", *(f"- {t['target']}: {t['value']} ({'met' if t['met'] else 'MISSED'})" for t in res["targets"])]
    return lines


# Each kind of results file: what prints its tables, and the fields those tables show (every other field prints
# after them, so a file prints whole).
def engine_ab_table(res: dict) -> list[str]:
    """CPU ms per request of blink.py at a base revision against the working tree's, the per-pair ratio, and both
    sides' answers against the float32 path."""
    base = res["base"]
    lines = [
        f"| case | {base} (ms) | working tree (ms) | {base} / working tree (quartiles) | pairs "
        "| vs float32: largest gap, picks changed |",
        "|---|---|---|---|---|---|",
    ]
    for case, row in res["rows"].items():
        ms, q = row["cpu_ms"], row["ratio_quartiles"]
        gaps = "; ".join(
            f"{name} {c['max_prob_diff']:.4f}, {len(c['picks_differ'])}" for name, c in row["vs_float32"].items()
        )
        lines.append(
            f"| {case} | {ms[base]} | {ms['working tree']} | {row['ratio_median']} ({q[0]}-{q[1]}) "
            f"| {row['pairs']} | {gaps} |"
        )
    return lines


def field_targets(res: dict) -> list[str]:
    """A field harness's targets (jevbench, krite) with the measured values."""
    verdict = {True: "met", False: "**missed**"}
    return [
        f"- {t['target']}: {_cell(t['value'])} — {'not measured' if t['value'] is None else verdict[bool(t['met'])]}"
        for t in res["targets"]
    ]


def jevbench_report(res: dict) -> list[str]:
    """jevbench: its pillar and overall scores (x100, as its table prints them) per arm and suite, the leaderboard's
    published rows beside them, the targets."""
    pillars = ["REP", "BAT", "MEA", "LOG", "CHO", "overall"]
    lines = [
        f"jevbench {res['jevbench']}, model field {res['model_field']!r}; the model is the stand-in (REP, MEA, LOG,"
        " CHO and overall are its own; BAT is the engine's).",
        "",
        "| system | suite | " + " | ".join(pillars) + " | requests | exit | seconds |",
        "|---|---|" + "---|" * (len(pillars) + 3),
    ]
    for arm, got in res["arms"].items():
        for suite, one in got["suites"].items():
            s, report_ = one["scores"], one["report"] or {}
            cells = [f"{100 * s[p]:.1f}" if s.get(p) is not None else "-" for p in pillars]
            requests = (report_.get("result") or {}).get("requests", "-")
            lines.append(
                f"| blink {arm} ({got['dtype']}) | {suite} | " + " | ".join(cells)
                + f" | {requests} | {one['run']['returncode']} | {one['run']['seconds']} |"
            )  # fmt: skip
    for name, row in res["published"].items():
        cells = [f"{row[p]:.1f}" if p in row else "-" for p in pillars]
        lines.append(f"| {name} (published) | jevbench-mini | " + " | ".join(cells) + " | - | - | - |")
    return [*lines, "", *field_targets(res)]


def krite_report(res: dict) -> list[str]:
    """krite: per arm its flip rates, interference and quality (accuracy, raw ECE) rows, krite's published rows, the
    targets."""
    suites = ", ".join(f"{k} ({v['cases']})" for k, v in res["suites"].items())
    lines = [
        f"krite-bench {res['krite_bench']}; suites {suites}; cases per run {res['cases']}. The model is the"
        " stand-in: accuracy and ECE are its own.",
        "",
        "| system | measure | suite | value |",
        "|---|---|---|---|",
    ]
    for arm, got in res["arms"].items():
        name, f = f"blink {arm} ({got['dtype']})", got["figures"]
        lines += [f"| {name} | flip rate | {sid} | {_cell(v)} |" for sid, v in f["flip_rate"].items()]
        lines += [
            f"| {name} | interference max dp | {k} | {_cell(v)} |" for k, v in f["interference_max_prob_dev"].items()
        ]
        for sid, q in f["quality"].items():
            lines += [
                f"| {name} | accuracy | {sid} | {_cell(q['accuracy'])} |",
                f"| {name} | ECE | {sid} | {_cell(q['ece'])} |",
            ]
        lines += [f"| {name} | error rate | {k} | {_cell(v)} |" for k, v in f["error_rates"].items()]
    for measure, rows in res["published"].items():
        lines += [f"| {who} (published) | {measure} | krite's | {v} |" for who, v in rows.items()]
    return [*lines, "", *field_targets(res)]


REPORTS = {
    "run": (
        run_report,
        ("mode", "model", "parameters", "dtype", "device", "decision", "http", "peers_skipped", "cells", "throughput")
        + ("targets", "started_at"),
    ),
    "budget": (budget_table, ("rows",)),
    "overhead": (overhead_table, ("rows",)),
    "engine_ab": (engine_ab_table, ("rows", "base", "dtype", "model")),
    "drift": (drift_table, ("rows",)),
    "shape4b": (shape4b_table, ("arms", "int8_time_ratio", "model")),
    "quantfloor": (quantfloor_table, ("rows", "worst", "bound", "model")),
    "gpu": (gpu_table, ("rows",)),
    "memory": (memory_table, ("runs", "config", "target_mb")),
    "batch": (
        batch_report,
        ("model", "rows", "loop_rows", "rows_per_call", "threads_per_engine", "repeats", "workers", "arms", "pipeline"),
    ),
    "models": (models_report, ("models", "skipped")),
    "order": (order_report, ("model", "questions", "temperature", "arms")),
    "vllm_check": (vllm_report, ("answers", "http", "not_up", "vllm_own_route", "targets")),
    "serve": (
        serve_report,
        ("model", "dtype", "cluster", "config", "default_lead", "rows", "targets", "draws", "spread", "met_at_once"),
    ),
    "jevbench": (jevbench_report, ("jevbench", "model_field", "arms", "published", "targets", "suites")),
    "krite": (krite_report, ("krite_bench", "suites", "cases", "arms", "published", "targets")),
    "route_sim": (route_sim_report, ("cost_model", "check", "predicted", "rows", "targets", "asks_per_replica")),
}
# The header every run writes (harness.Run.header), and the names older files gave some of its fields.
HEADER = (
    "command",
    "quick",
    "hardware",
    "python",
    "torch",
    "transformers",
    "threads",
    "measured_at",
    "duration_s",
    "load_average",
    "matmul_gflops",
    "matmul_gflops_start_end",
    "matmul_gflops_by_dtype",
    "matmul_change",
    "unsteady_threshold",
    "unsteady",
    "seconds",
)
# The fields that mark a file of each kind that records no command (older files; a file read from stdin has no name).
SIGNATURES = {
    "run": {"cells", "targets", "matmul_gflops_start_end"},
    "batch": {"arms", "pipeline", "loop_rows"},
    "order": {"arms", "questions", "temperature"},
}


def kind(res, name: str) -> str:
    """Which benchmark wrote a results file: from the command it records (`python -m bench NAME`, or an older
    `python bench/NAME.py`), else from the file's name (`full` and `decision` are run's, `vllm-cpu` vllm_check's),
    else from the fields it has; 'generic' when none tells."""
    command = res.get("command", "") if isinstance(res, dict) else ""
    if command.startswith("python -m bench "):
        return command.split()[3]
    if command.startswith("python bench/"):
        return command.split()[1][len("bench/") : -len(".py")]
    stem = os.path.splitext(os.path.basename(name))[0].removesuffix("-quick")
    if stem in ("full", "decision", "quick"):
        return "run"
    if stem.startswith("vllm-"):
        return "vllm_check"
    if stem in REPORTS:
        return stem
    return next((k for k, keys in SIGNATURES.items() if isinstance(res, dict) and keys <= res.keys()), "generic")


def header_line(res: dict) -> str:
    """How a run ran, from its header: when, by what command, for how long, on what, with what."""
    when = res.get("measured_at") or res.get("started_at")
    seconds = res.get("duration_s", res.get("seconds"))
    parts = [
        "Measured",
        *([when] if when else []),
        *([f"by `{res['command']}`"] if "command" in res else []),
        *([f"in {seconds / 60:.1f} min"] if seconds is not None else []),
    ]
    machine = [res.get("hardware")]
    if "torch" in res:
        threads = res.get("threads")
        machine.append(f"torch {res['torch']}" + (f" with {threads} thread(s)" if isinstance(threads, int) else ""))
    if "transformers" in res:
        machine.append(f"transformers {res['transformers']}")
    return " ".join(parts) + ": " + ", ".join(m for m in machine if m) + "."


def report(res, name: str = "") -> str:
    """The markdown block of one results file, whole; `name` is its path, which says its kind when the file does
    not."""
    which = kind(res, name)
    if which not in REPORTS or not isinstance(res, dict):
        return "\n".join(generic_report(res))
    tables, shown = REPORTS[which]
    steady = ["", steadiness_line(res)] if "matmul_gflops_start_end" in res else []
    head = [] if which == "run" else [header_line(res), *steady, ""]
    rest = {k: v for k, v in res.items() if k not in HEADER and k not in shown}
    tail = ["", "Other fields:", "", *generic_report(rest)] if rest else []
    return "\n".join([*head, *tables(res), *tail])


def main(paths: list[str]) -> int:
    """Print every file named (`-` reads stdin; none: every committed results file), each under its name when
    there are several."""
    paths = paths or sorted(
        p for p in glob.glob(os.path.join(harness.RESULTS, "*.json")) if not p.endswith("-quick.json")
    )
    for i, path in enumerate(paths):
        if path == "-":
            res = json.load(sys.stdin)
        else:
            with open(path, encoding="utf-8") as fh:
                res = json.load(fh)
        if len(paths) > 1:
            print(f"{'' if i == 0 else chr(10)}## {path}\n")
        print(report(res, path))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
