"""blink against the systems a user would pick instead, on one loaded model, side by side in one run.

    python -m bench run --decision  # blink at its defaults against every decision peer (pipeline("decision"),
                                    # llama.cpp, blink on vLLM) and `transformers serve` (about 15 min on 2 CPU cores)
    python -m bench run --quick     # a small version of the decision cases, the grid and serving (a few minutes)
    python -m bench run --decision --quick  # every decision peer and the HTTP servers, on small cases
    python -m bench run             # all of it, plus the grid of prompting methods (about 30 min on 2 CPU cores)
    python -m bench run --model <id or folder>

Decision peers (the registry's "decision" arms, bench/lib/arms.py), blink with no BLINK_* variable set:
pipeline("decision") with its own prompt, with blink's exported DecisionConfig, and with its own prompt as a user
runs it in blink's dtype (`pipeline_bfloat16`: its own model, loaded at bfloat16); llama.cpp with and without prefix
reuse; blink on vLLM (where .venv-vllm exists; not in --quick without --decision). Each case also records each arm's
model FLOP utilisation against the matmul probe at its dtype. Over HTTP: `transformers serve` /v1/systemone against
blink's own /v1/systemone with 1, 8 and 32 clients, every request new (not in --quick without --decision). The grid:
blink plain; blink with the shared prefix; one forward per question by hand; per-option continuation log-likelihood
(lm-evaluation-harness multiple choice, SGLang select); generate-then-parse. Ratios are > 1 where blink is faster.
Writes bench/results/full.json or decision.json (-quick.json with --quick; full.png for the grid); the last line
printed is a summary.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from dataclasses import replace

import blink
from bench.lib import arms, harness, report, workloads

# torch-bound: loaded when the run starts, not when `python -m bench report` reads this module's tables
grid = harness.lazy("bench.lib.grid")
peers = harness.lazy("bench.peers.decision")
llamacpp = harness.lazy("bench.peers.llamacpp")
throughput = harness.lazy("bench.peers.throughput")

# Each slow arm runs at most `budget` prompt tokens per cell (always at least one question); its time for the whole
# request is then scaled from the questions it ran, and the cell says so. blink with the shared prefix always runs
# every question.
CONFIGS = {
    "full": {
        "docs": [200, 2000, 8000],
        "questions": [1, 8, 64],
        "options": 4,
        "option_axis": {"doc": 200, "questions": 8, "options": [2, 26]},
        "plain_budget": 24000,
        "peer_budget": 12000,
        "peer_cap": {"unbatched": 64, "per_option": 64, "generate": 64},
        "throughput": {
            "clients": 8,
            "per_client": 3,
            "windows_ms": [0, 5, 20],
            "doc": 120,
            "prefix_doc": 300,
            "prefix_questions": 3,
            "prefix_per_client": 2,
        },
    },
    "quick": {
        "docs": [100],
        "questions": [2],
        "options": 4,
        "option_axis": None,
        "plain_budget": 24000,
        "peer_budget": 12000,
        "peer_cap": {"unbatched": 1, "per_option": 1, "generate": 1},
        "throughput": {
            "clients": 2,
            "per_client": 1,
            "windows_ms": [0, 20],
            "doc": 40,
            "prefix_doc": 0,
            "prefix_questions": 0,
            "prefix_per_client": 0,
        },
    },
}
# The decision peers: the three target cases at full size (--decision and the full run), small in --quick.
# reps: repetitions of the three cases, each over a new document; short_per_rep: short questions per repetition, each
# over a new text (one short question takes a tenth of a second: several per repetition steady its ratio)
DECISION = {
    "full": {"doc": 1000, "questions": 8, "options": 4, "reps": 3, "short_per_rep": 10},
    "quick": {"doc": 200, "questions": 3, "options": 4, "reps": 1, "short_per_rep": 2},
}
# run's HTTP workload: one choice over a ~doc-token ticket log per request, per_level new requests at each level of
# concurrent clients (workloads.DISTINCT)
HTTP = {
    "full": {"doc": 120, "clients": [1, 8, 32], "per_level": 32},
    "quick": {"doc": 60, "clients": [1, 4], "per_level": 4},
}
# (case, target ratio against pipeline("decision") in blink's dtype, what it is)
DECISION_TARGETS = (
    ("document", 2.0, "questions over a new document"),
    ("again", 4.0, "the same document again with new questions"),
    ("short", 1.2, "one short yes/no question"),
)
OWN_PROMPT_PIPELINES = ("pipeline", "pipeline_bfloat16")  # pipeline("decision") with its own prompt, by dtype
LLAMA_TARGET = 1.5  # llama.cpp (its faster arm) at least this many times slower than blink, in every case
# the int8 peers, blink at int8 against each (llama.cpp at Q8_0: its faster arm), in every case
INT8_TARGETS = ((("onnxruntime_int8",), 1.2), (("llama.cpp_q8_0", "llama.cpp_q8_0_reuse"), 2.0))
VLLM_TARGET = 1.0  # blink on vLLM at least this many times slower than blink, in every case
MAX_PROB_DIFF = 0.03  # blink's answers against the float32 unbatched path: no pick flips, probabilities this close
GRID = arms.of("grid")
PEERS = [name for name, arm in GRID.items() if arm.runs]  # the per-question peers of the grid


def best_of(fn, short_s: float = 1.0, reps: int = 3) -> grid.Measured:
    """Run once; a run under `short_s` seconds is repeated up to `reps` times and the fastest (by its own wall
    time) kept."""
    return harness.best_of(fn, reps, lambda wall, cpu, run: run.wall_s, stop_above=short_s)[2]


def ladder(n_questions: int, per_question: float, budget: int) -> int:
    """How many of the request's questions plain blink runs: the largest of 1, 8, 64 (or all) within budget, so
    the same subsample serves several cells."""
    steps = sorted({s for s in (1, 8, 64) if s < n_questions} | {n_questions})
    fitting = [s for s in steps if s * per_question <= budget]
    return max(fitting) if fitting else 1


def spans_of(engine: blink.TorchEngine, prompts: list[blink.Prompt], prefix: bool) -> list[tuple[int, int]]:
    """(cached, new) token spans blink computes for these prompts from a cold start, by its own prefix grouping
    and encode plan."""
    spans = []
    seqs, keep = [p.ids for p in prompts], engine.prefixes.keeps
    settings = replace(engine.settings, prefix_cache=prefix)
    for rows, shared in blink.prefix_groups(seqs, [p.cuts for p in prompts], settings, keep):
        if shared:
            points = [c for c in prompts[rows[0]].cuts if c < shared] if keep else []
            spans += [(a, b - a) for a, b in blink.encode_plan(engine.prefill_cost, 0, [*points, shared])]
        spans += [(shared, len(seqs[i]) - shared) for i in rows]
    return spans


class Bench:
    """One loaded model, its documents, and every measurement of this run (reused across cells)."""

    def __init__(self, engine: blink.TorchEngine, cfg: dict):
        self.engine, self.cfg = engine, cfg
        self.device = engine.model.lm_head.weight.device
        self.params = sum(p.numel() for p in engine.model.parameters())
        self.body_params = round(engine.prefill_cost.token_flops / 2)  # what every prompt token passes through
        self.docs: dict[int, str] = {}
        self.memo: dict = {}

    def doc(self, target: int) -> str:
        """The ticket log of about `target` tokens, built once."""
        if target not in self.docs:
            self.docs[target] = workloads.document(self.engine.tok, target) if target else ""
        return self.docs[target]

    def measure(self, key: tuple, fn) -> grid.Measured:
        """A measurement, taken once per run and reused by every cell that needs the same one."""
        if key not in self.memo:
            self.memo[key] = best_of(fn)
        return self.memo[key]

    def flops(self, tokens: float, spans: list[tuple[int, int]], wall: float) -> dict:
        """Achieved prefill FLOP/s: the usual 2 x parameters x tokens, and the body matmuls plus attention."""
        if wall <= 0:
            return {}
        two_pt = 2 * self.params * tokens / wall
        useful = self.engine.prefill_cost.flops(spans) / wall
        return {"gflops_2pt": round(two_pt / 1e9, 2), "gflops_body_attention": round(useful / 1e9, 2)}

    def blink_arm(self, name: str, doc_target: int, n_opt: int, qs: dict, n_total: int) -> tuple[dict, grid.Measured]:
        """blink (arm `name`: plain or with the shared prefix) on `qs` (the first questions of the request), scaled to
        the request's n_total questions."""
        doc, prefix = self.doc(doc_target), GRID[name].settings["prefix_cache"]
        key = (name, doc_target, n_opt, len(qs))
        run = self.measure(key, lambda: grid.blink_request(self.engine, doc, qs, prefix))
        scale = n_total / len(qs)
        prompts = self.engine.render(grid.request(self.engine, doc, qs))
        row = {
            "measured_questions": len(qs),
            "extrapolated": scale != 1,
            "wall_s": round(run.wall_s * scale, 4),
            "wall_s_measured": round(run.wall_s, 4),
            "cpu_s": round(run.cpu_s * scale, 4),
            "prefill_tokens": round(run.prefill_tokens * scale),
            "peak_mb": round(run.peak_mb, 1),
            "shared_prefix_tokens": run.extra["shared_prefix_tokens"],
            **self.flops(run.prefill_tokens, spans_of(self.engine, prompts, prefix), run.wall_s),
        }
        return row, run

    def peer_arm(self, name: str, doc_target: int, n_opt: int, qs: dict, n_measure: int) -> tuple[dict, dict]:
        """A per-question peer on the first `n_measure` questions, scaled to all of them."""
        doc, fn = self.doc(doc_target), GRID[name].function()
        runs = {
            k: self.measure((name, doc_target, n_opt, k), lambda k=k: fn(self.engine, doc, k, qs[k]))
            for k in list(qs)[:n_measure]
        }
        scale = len(qs) / n_measure
        wall = sum(r.wall_s for r in runs.values())
        cpu = sum(r.cpu_s for r in runs.values())
        tokens = sum(r.prefill_tokens for r in runs.values())
        spans = [s for r in runs.values() for s in r.extra.get("spans", [(0, r.prefill_tokens)])]
        row = {
            "measured_questions": n_measure,
            "extrapolated": scale != 1,
            "wall_s": round(wall * scale, 4),
            "wall_s_measured": round(wall, 4),
            "cpu_s": round(cpu * scale, 4),
            "prefill_tokens": round(tokens * scale),
            "peak_mb": round(max(r.peak_mb for r in runs.values()), 1),
            **self.flops(tokens, spans, wall),
        }
        if name == "per_option":
            row["forwards"] = n_opt * len(qs)
        if name == "generate":
            row["generated_tokens"] = round(sum(r.extra["generated_tokens"] for r in runs.values()) * scale)
        return row, runs

    def cell(self, doc_target: int, n_q: int, n_opt: int) -> dict:
        """Every arm on one workload: n_q questions with n_opt options over a document of about doc_target tokens."""
        load0 = os.getloadavg()[0]
        doc = self.doc(doc_target)
        qs = workloads.questions(n_q, n_opt, workloads.ticket_count(doc))
        lengths = [len(ids) for ids in grid.render_ids(self.engine, doc, qs)]
        per_q = sum(lengths) / len(lengths)
        cfg = self.cfg
        out = {
            "doc_tokens_target": doc_target,
            "doc_tokens": len(self.engine.tok(doc)["input_ids"]),
            "questions": n_q,
            "options": n_opt,
            "prompt_tokens": sum(lengths),
            "prompt_tokens_per_question": round(per_q, 1),
            "arms": {},
        }
        watch = harness.Stopwatch()
        n_plain = ladder(n_q, per_q, cfg["plain_budget"])
        plain_qs = dict(list(qs.items())[:n_plain])
        out["arms"]["blink_plain"], plain = self.blink_arm("blink_plain", doc_target, n_opt, plain_qs, n_q)
        out["arms"]["blink_prefix"], prefix = self.blink_arm("blink_prefix", doc_target, n_opt, qs, n_q)
        peer_runs = {}
        for name in PEERS:
            forwards = n_opt if name == "per_option" else 1
            n_measure = max(1, min(n_q, cfg["peer_cap"][name], int(cfg["peer_budget"] // (per_q * forwards))))
            out["arms"][name], peer_runs[name] = self.peer_arm(name, doc_target, n_opt, qs, n_measure)
        out["agreement"] = agreement(plain, prefix, peer_runs)
        out["speedup"] = speedups(out["arms"])
        out["speedup_cpu_time"] = speedups(out["arms"], "cpu_s")
        out["cell_seconds"] = round(watch.seconds(), 1)
        out["load_avg_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
        return out


def against_matmul(cells: list[dict], gflops_by_arm: dict[str, float]) -> None:
    """Each arm's achieved FLOP/s as a fraction of the machine's measured matmul FLOP/s at the dtype it computes in
    ({arm: GFLOP/s})."""
    for c in cells:
        for name, row in c["arms"].items():
            for kind in ("2pt", "body_attention"):
                row[f"fraction_of_matmul_{kind}"] = round(row[f"gflops_{kind}"] / gflops_by_arm[name], 3)


def agreement(plain: grid.Measured, prefix: grid.Measured, peer_runs: dict) -> dict:
    """Where each arm's choice differs from blink's (plain where it ran the question, else the prefix run)."""
    ref = {**prefix.choices, **plain.choices}
    common = plain.choices.keys() & prefix.choices.keys()
    out = {
        "blink_prefix_vs_plain": {
            "compared": len(common),
            "differ": sorted(k for k in common if plain.choices[k] != prefix.choices[k]),
            "max_label_logit_gap": round(grid.label_logit_gap(plain.rows, prefix.rows), 7),
        }
    }
    for name, runs in peer_runs.items():
        got = {k: c for r in runs.values() for k, c in r.choices.items()}
        row = {"compared": len(got), "differ": sorted(k for k, c in got.items() if c != ref[k])}
        if name == "unbatched":
            rows = {k: v for r in runs.values() for k, v in r.rows.items()}
            row["max_label_logit_gap"] = round(grid.label_logit_gap(rows, {**prefix.rows, **plain.rows}), 7)
        if name == "per_option":
            for alt in ("choice_acc_norm", "choice_token_mean"):
                row[f"differ_{alt[7:]}"] = sorted(k for k, r in runs.items() if r.extra[alt] != ref[k])
        if name == "generate":
            row["unparsed"] = sorted(k for k, c in got.items() if c is None)
            row["replies"] = sorted({r.extra["reply"] for r in runs.values()})[:8]
        out[name] = row
    return out


def speedups(rows: dict, clock: str = "wall_s") -> dict:
    """How many times faster each blink arm answers the request than every other arm, on one clock."""

    def ratio(a: str, b: str) -> float:
        return round(rows[b][clock] / rows[a][clock], 2) if rows[a][clock] > 0 else math.nan

    return {
        "blink_plain": {p: ratio("blink_plain", p) for p in PEERS},
        "blink_prefix": {p: ratio("blink_prefix", p) for p in ("blink_plain", *PEERS)},
    }


def targets(cells: list[dict]) -> list[dict]:
    """The three speed targets, evaluated on what this run measured."""
    out = []
    four = [c for c in cells if c["options"] == 4]
    if four:
        worst = min(four, key=lambda c: c["speedup"]["blink_plain"]["per_option"])
        value = worst["speedup"]["blink_plain"]["per_option"]
        worst_cpu = min(c["speedup_cpu_time"]["blink_plain"]["per_option"] for c in four)
        out.append(
            {
                "target": "blink plain >= 3x per-option log-likelihood at 4 options (worst 4-option cell)",
                "short": "plain vs per-option",
                "value": value,
                "threshold": 3.0,
                "met": value >= 3.0,
                "cell": cell_name(worst),
                "value_cpu_time": worst_cpu,
                "met_cpu_time": worst_cpu >= 3.0,
                "all": {cell_name(c): c["speedup"]["blink_plain"]["per_option"] for c in four},
                "all_cpu_time": {cell_name(c): c["speedup_cpu_time"]["blink_plain"]["per_option"] for c in four},
            }
        )
    eights = [c for c in four if c["questions"] == 8]
    if eights:
        c = min(eights, key=lambda c: abs(c["doc_tokens_target"] - 2000))
        value = c["speedup"]["blink_prefix"]["blink_plain"]
        value_cpu = c["speedup_cpu_time"]["blink_prefix"]["blink_plain"]
        exact = c["doc_tokens_target"] == 2000
        out.append(
            {
                "target": "shared prefix >= 4x blink plain, 8 questions over a 2,000-token document",
                "short": "prefix vs plain",
                "value": value,
                "threshold": 4.0,
                "met": value >= 4.0 if exact else None,
                "cell": cell_name(c),
                "value_cpu_time": value_cpu,
                "met_cpu_time": value_cpu >= 4.0 if exact else None,
                "note": "" if exact else "not the target's cell: only the full run has the 2,000-token document",
            }
        )
    compared, differ = distinct(cells, "unbatched")
    p_compared, p_differ = distinct(cells, "blink_prefix_vs_plain")
    out.append(
        {
            "target": "0 answers that differ from the unbatched path",
            "short": "differ from unbatched",
            "value": len(differ),
            "threshold": 0,
            "met": not differ,
            "compared": compared,
            "differ": differ,
            "prefix_vs_plain": {"compared": p_compared, "differ": p_differ},
        }
    )
    return out


def distinct(cells: list[dict], arm: str) -> tuple[int, list[str]]:
    """Questions compared and those that differ, each counted once although cells share measurements (a cell's
    compared questions are the first ones of its document and option count)."""
    compared: dict = {}
    differ: set = set()
    for c in cells:
        where = (c["doc_tokens_target"], c["options"])
        compared[where] = max(compared.get(where, 0), c["agreement"][arm]["compared"])
        differ |= {f"{where[0]} tok/{where[1]} opt/{k}" for k in c["agreement"][arm]["differ"]}
    return sum(compared.values()), sorted(differ)


def cell_name(c: dict) -> str:
    """A short name for a cell: questions x options over document tokens."""
    return f"{c['questions']}q x {c['options']}opt / {c['doc_tokens_target']} tok"


def grid_cells(cfg: dict) -> list[tuple[int, int, int]]:
    """The (document, questions, options) cells of a configuration."""
    cells = [(d, n, cfg["options"]) for d in cfg["docs"] for n in cfg["questions"]]
    axis = cfg.get("option_axis")
    if axis:
        cells += [(axis["doc"], axis["questions"], k) for k in axis["options"]]
    return cells


def warm_up(engine: blink.TorchEngine) -> None:
    """One short run of every arm, so first-call setup is not billed to the first cell."""
    qs = workloads.questions(2, 2, 1)
    for name in ("blink_plain", "blink_prefix"):
        grid.blink_request(engine, "warm-up", qs, GRID[name].settings["prefix_cache"])
    for name in PEERS:
        GRID[name].function()(engine, "warm-up", "q00", qs["q00"])


def throughput_rows(engine: blink.TorchEngine, cfg: dict, with_app: bool, threads: int) -> list[dict]:
    """Batcher (and app) throughput with concurrent clients, every window; plus blink.decide one at a time."""
    tc = cfg["throughput"]
    n = tc["clients"] * tc["per_client"]
    teams = workloads.TEAMS[:4]

    def requests(doc_tokens: int, n_questions: int) -> list:
        docs = [workloads.document(engine.tok, doc_tokens, seed=100 + i) for i in range(n + 1)]
        return [(d, workloads.questions(n_questions, len(teams), workloads.ticket_count(d))) for d in docs]

    small = requests(tc["doc"], 1)
    rows = [throughput.serial_run(engine, small, tc["clients"], tc["per_client"], prefix=False)]
    rows += [
        throughput.batcher_run(engine, small, w, tc["clients"], tc["per_client"], prefix=False)
        for w in tc["windows_ms"]
    ]
    if tc["prefix_doc"]:  # several questions per request: packed requests should each keep their own prefix
        shared = requests(tc["prefix_doc"], tc["prefix_questions"])
        for prefix in (False, True):
            row = throughput.batcher_run(
                engine, shared, max(tc["windows_ms"]), tc["clients"], tc["prefix_per_client"], prefix
            )
            rows.append({**row, "workload": f"{tc['prefix_questions']} questions over {tc['prefix_doc']} tokens"})
    for row in rows[: 1 + len(tc["windows_ms"])]:
        row["workload"] = f"1 question over {tc['doc']} tokens"
    if with_app:
        rows += [
            {**r, "workload": f"1 question over {tc['doc']} tokens"} if "skipped" not in r else r
            for r in throughput.app_runs(engine, small, tc["windows_ms"], tc["clients"], tc["per_client"], threads)
        ]
    return rows


def same_dtype_pipeline(row: dict) -> str | None:
    """The pipeline arm (its own prompt) that computed in blink's dtype in a case, if one ran."""
    dtype = row["arms"]["blink"].get("dtype")
    return next((p for p in OWN_PROMPT_PIPELINES if row["arms"].get(p, {}).get("dtype") == dtype), None)


def speed_target(row: dict, case: str, peer: str, mine: str, ratios: tuple, threshold: float, what: str, exact: bool):
    """One speed target's row: `mine` at least `threshold` times faster than `peer` in one case, by the ratios
    (wall clock, CPU time) given; met is None where the run was not exact."""
    value, cpu = ratios
    return {
        "target": f"{mine} >= {threshold:g}x {peer}: {what}",
        "case": case,
        "peer": peer,
        "short": f"vs {peer}: {what}" if mine == "blink" else f"{mine} vs {peer}: {what}",
        "value": value,
        "value_cpu_time": cpu,
        "threshold": threshold,
        "met": value >= threshold if exact else None,
        "met_cpu_time": cpu >= threshold if exact else None,
        "cell": f"{row['questions']} question(s), {row['prompt_tokens']} prompt tokens",
    }


def ratio_target(row: dict, case: str, peer: str, threshold: float, what: str, exact: bool) -> dict:
    """blink at least `threshold` times faster than `peer` in one case (wall clock and CPU time)."""
    ratios = row[f"vs_{peer}"]["wall"], row[f"vs_{peer}"]["cpu"]
    out = speed_target(row, case, peer, "blink", ratios, threshold, what, exact)
    return {**out, "picks_differ_from_blink": row[f"vs_{peer}"]["picks_differ_from_blink"]}


def int8_target(row: dict, case: str, peer: str, threshold: float, what: str, exact: bool) -> dict:
    """blink at int8 (the blink_int8 arm where it ran, else blink at its defaults) at least `threshold` times faster
    than an int8 peer in one case (wall clock and CPU time)."""
    mine = "blink_int8" if "blink_int8" in row["arms"] else "blink"
    ratios = tuple(round(row["arms"][peer][k] / row["arms"][mine][k], 2) for k in ("total_wall_s", "total_cpu_s"))
    return {**speed_target(row, case, peer, mine, ratios, threshold, what, exact), "blink_arm": mine}


def decision_targets(decision: dict, quick: bool) -> list[dict]:
    """The targets on what this run measured: blink against pipeline("decision") in its own dtype on the three cases,
    against llama.cpp (its faster arm) and blink on vLLM on every case where they ran, and its answers against the
    float32 unbatched path; in --quick the cells are smaller than the targets' (met is None there)."""
    exact = not quick
    out = []
    for case, threshold, what in DECISION_TARGETS:
        row = decision[case]
        peer = same_dtype_pipeline(row)
        if peer:
            out.append(ratio_target(row, case, peer, threshold, what, exact))
    for case, _, what in DECISION_TARGETS:
        row = decision[case]
        ran = [name for name, (kind, _) in llamacpp.ARMS.items() if kind == "q4_1" and f"vs_{name}" in row]
        if ran:
            best = min(ran, key=lambda name: row[f"vs_{name}"]["wall"])  # the arm closest to blink
            out.append(ratio_target(row, case, best, LLAMA_TARGET, what, exact))
    for case, _, what in DECISION_TARGETS:
        for peers_, threshold in INT8_TARGETS:
            ran = [name for name in peers_ if name in decision[case]["arms"]]
            if ran:
                best = min(ran, key=lambda name: decision[case]["arms"][name]["total_wall_s"])  # closest to blink
                out.append(int8_target(decision[case], case, best, threshold, what, exact))
    for case, _, what in DECISION_TARGETS:
        if "vs_blink_vllm" in decision[case]:
            out.append(ratio_target(decision[case], case, "blink_vllm", VLLM_TARGET, what, exact))
    compared = sum(decision[c]["vs_unbatched"]["questions"] for c in workloads.CASES)
    differ = [f"{c}/{k}" for c in workloads.CASES for k in decision[c]["vs_unbatched"]["picks_differ"]]
    gap = max(decision[c]["vs_unbatched"]["max_prob_diff"] for c in workloads.CASES)
    out.append(
        {
            "target": f"answers as the float32 unbatched path gives them: no pick differs, |dp| <= {MAX_PROB_DIFF:g}",
            "short": "differ from unbatched",
            "value": len(differ),
            "threshold": 0,
            "met": not differ and gap <= MAX_PROB_DIFF,
            "compared": compared,
            "differ": differ,
            "max_prob_diff": round(gap, 4),
            "max_prob_diff_threshold": MAX_PROB_DIFF,
        }
    )
    return out


def decision_part(
    engine: blink.TorchEngine, run: harness.Run, servers: bool, only: list[str] | None = None
) -> tuple[dict, list, list]:
    """The decision peers: every arm of the registry's "decision" arms against blink on the three cases (or the arms
    in `only`, pipeline always), then over HTTP against `transformers serve` (not with `only`); blink on vLLM and the
    HTTP servers only where `servers` (not in --quick without --decision). An arm that cannot run here is a row
    saying why."""
    size = "quick" if run.quick else "full"
    threads = run.threads["threads"]
    names = [n for n in arms.of("decision") if n != "blink" and (servers or arms.of("decision")[n].python == "project")]
    if only:
        names = [n for n in names if n in only or n == "pipeline"]
    logs = run.files()
    print(f"server logs in {logs}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        export_dir = os.path.join(tmp, "export")
        why = peers.export_config(engine.model_id, export_dir)
        with contextlib.ExitStack() as stack:
            ctx = peers.PeerContext(engine, threads, logs, stack, None if why else export_dir, why)
            pipes, skipped = peers.start_peers(ctx, names)
            cases = peers.decision_cases(engine, DECISION[size], pipes)
        left_out = [n for n in arms.of("decision") if n not in names and n != "blink"]
        skipped += [
            {"target": n, "skipped": "not among --peers" if only else "--quick without --decision"} for n in left_out
        ]
        for case, row in cases.items():
            others = "".join(f", {name} x{row[f'vs_{name}']['wall']}" for name in pipes if name != "pipeline")
            rates = ", ".join(f"{name} {a['gflops']:.0f}" for name, a in row["arms"].items() if a.get("gflops"))
            print(
                f"decision {case:>8}: blink {row['arms']['blink']['total_wall_s']:.2f} s, pipeline "
                f"{row['arms']['pipeline']['total_wall_s']:.2f} s: x{row['vs_pipeline']['wall']} "
                f"(CPU time x{row['vs_pipeline']['cpu']}){others}; prefill {row['prefill_tokens']} of "
                f"{row['prompt_tokens']} tokens, {row['cached_tokens']} from the cache; differ from unbatched "
                f"{len(row['vs_unbatched']['picks_differ'])} of {row['vs_unbatched']['questions']}; model GFLOP/s "
                f"{rates}",
                flush=True,
            )
        if servers and not only:
            http = peers.http_rows(engine, HTTP[size], threads, None if why else export_dir, logs)
        else:
            why = "not among --peers" if only else "--quick without --decision"
            http = [{"target": name, "skipped": why} for name in arms.of("http")]
    for r in http:
        print(
            f"http {r['target']} {r.get('clients', '')}: {r.get('requests_per_s', r.get('skipped'))} req/s "
            f"p50 {r.get('p50_ms')} p99 {r.get('p99_ms')} ms",
            flush=True,
        )
    return cases, http, skipped


def flags(ap) -> None:
    """run's own flags."""
    ap.add_argument("--decision", action="store_true", help="only the decision peers and HTTP, at the targets' sizes")
    ap.add_argument("--model", default=blink.STANDIN_MODEL, help="model id or folder (default: the stand-in)")
    ap.add_argument("--name", default=None, help="results file stem (default: full or decision)")
    ap.add_argument("--app", action="store_true", help="also drive the Gradio app's /decide with gradio_client")
    ap.add_argument("--no-throughput", action="store_true", help="skip the Batcher throughput part")
    ap.add_argument(
        "--peers",
        default=None,
        help="comma-separated decision arms to run (pipeline always runs); the HTTP servers are left out",
    )
    ap.add_argument(
        "--token-budget",
        type=int,
        default=None,
        help="blink's padded tokens per forward (default: blink's own default for this hardware)",
    )
    ap.add_argument(
        "--prefix-kv-tokens",
        type=int,
        default=None,
        help="prefix copies x length held at once (default: blink's own default)",
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, write JSON (and PNG for the grid), print one summary line last."""
    run = harness.Run("run", argv, __doc__, flags, threads="auto")
    args = run.args
    mode = "decision" if args.decision else "full"
    size = "quick" if run.quick else "full"  # the workloads' size (--decision runs the full-size cases)
    cfg = CONFIGS[size]

    # blink at its defaults: no BLINK_* variable is read (the hardware is); the two flags change them for every arm
    defaults = blink.Settings.from_env({})
    settings = replace(
        defaults,
        token_budget=args.token_budget or defaults.token_budget,
        prefix_kv_tokens=args.prefix_kv_tokens or defaults.prefix_kv_tokens,
    )
    engine = blink.TorchEngine(args.model, settings=settings)
    device = engine.model.lm_head.weight.device
    if run.threads == "auto":
        run.threads = harness.choose_threads(engine.model, device)
    else:
        run.threads = {"threads": run.threads, "how": "given"}
    run.probe_dtypes = [blink.dtype_name(engine.model.dtype)]  # blink's own dtype: its utilisation's ceiling
    run.probe(device)
    bench = Bench(engine, cfg)
    print(
        f"model {args.model}: {bench.params / 1e6:.1f}M parameters, {engine.model.dtype}, {device}, "
        f"{run.threads['threads']} thread(s) ({run.threads['how']}), matmul {run.matmul_gflops:.1f} GFLOP/s, blink's "
        f"linear layers by {engine.matmul}",
        flush=True,
    )

    only = args.peers.split(",") if args.peers else None
    unknown = [n for n in only or [] if n not in arms.of("decision")]
    if unknown:
        raise SystemExit(f"--peers: no decision arm {', '.join(unknown)} (bench/lib/arms.py names them)")
    decision, http, peers_skipped = decision_part(engine, run, servers=args.decision or not run.quick, only=only)
    cells = []
    if mode != "decision":
        warm_up(engine)
        for doc_target, n_q, n_opt in grid_cells(cfg):
            c = bench.cell(doc_target, n_q, n_opt)
            cells.append(c)
            a, s = c["arms"], c["speedup"]
            print(
                f"{cell_name(c):>26}: plain {a['blink_plain']['wall_s']:8.2f}s  prefix "
                f"{a['blink_prefix']['wall_s']:8.2f}s  unbatched {a['unbatched']['wall_s']:8.2f}s  per-option "
                f"{a['per_option']['wall_s']:8.2f}s  generate {a['generate']['wall_s']:8.2f}s | plain "
                f"x{s['blink_plain']['per_option']} per-option, prefix x{s['blink_prefix']['blink_plain']} plain "
                f"({c['cell_seconds']}s)",
                flush=True,
            )

    # Measured again after the cells: the best of the two is the closer to the ceiling, and a large change between
    # the two flags the run as unsteady (harness.steadiness).
    run.probe()
    dtypes = {name: grid.user_model(engine).dtype if arm.runs else engine.model.dtype for name, arm in GRID.items()}
    against_matmul(cells, {name: run.matmul_probe(blink.dtype_name(d))[1] for name, d in dtypes.items()})
    peers.utilisation(decision, run.matmul_probe)

    rows = (
        []
        if args.no_throughput or mode == "decision"
        else throughput_rows(engine, cfg, args.app, run.threads["threads"])
    )
    for r in rows:
        print(
            f"throughput {r.get('target')} window {r.get('window_ms')} ms prefix {r.get('prefix_cache')}: "
            f"{r.get('requests_per_s', r.get('skipped'))} req/s p50 {r.get('p50_ms')} p99 {r.get('p99_ms')} ms",
            flush=True,
        )

    res = {
        "mode": mode,
        "model": args.model,
        "parameters": bench.params,
        "body_parameters": bench.body_params,
        "dtype": blink.dtype_name(engine.model.dtype),
        "device": str(device),
        "settings": {
            "token_budget": settings.token_budget,
            "prefix_cache": settings.prefix_cache,
            "prefix_cache_mb": settings.prefix_cache_mb,
            "prefix_min_tokens": settings.prefix_min_tokens,
            "prefix_kv_tokens": settings.prefix_kv_tokens,
            "readout": settings.readout,
            "linear_layers": engine.matmul,
            **cfg,
            "decision": DECISION[size],
            "http": HTTP[size],
        },
        "decision": decision,
        "http": http,
        "peers_skipped": peers_skipped,
        "cells": cells,
        "throughput": rows,
        "targets": decision_targets(decision, run.quick) + (targets(cells) if cells else []),
        "notes": NOTES,
    }
    path = run.write(res, args.name or mode)
    res = run.written
    if cells:
        try:
            from bench.lib import plot

            plot.plot(res, path.removesuffix(".json") + ".png")
        except ImportError as exc:
            print(f"no plot: {exc}")
    print(run_summary(res, path))
    return 0


NOTES = [
    "The decision peers and the grid's arms run the same weights in one process (blink_vllm and the HTTP servers in "
    "processes of their own). The peers run the model as from_pretrained loads it by default (the checkpoint's "
    "dtype, torch's own kernels); where blink runs it otherwise (bfloat16 on a CPU that computes it natively, or a "
    "CPU's float32 linear layers by oneDNN: dtype, settings.linear_layers), they get their own copy. "
    "pipeline_bfloat16 (where blink computes in bfloat16 and the checkpoint is not) is the pipeline as a user runs "
    "it at blink's dtype: pipeline('decision', model=<checkpoint>, dtype=torch.bfloat16), its own model and "
    "tokenizer freshly loaded (not blink's model, whose packed weights are blink's own work).",
    "llama.cpp and llama.cpp_reuse run llama-cpp-python on the stand-in's own Q4_1 GGUF file, fed blink's prompt "
    "token ids; llama.cpp_reuse keeps the longest common prefix with the previous prompt in its KV cache. blink_vllm "
    "is `python app.py` with BLINK_BACKEND=vllm in .venv-vllm, asked over /v1/systemone; its CPU time is its "
    "server's process group's. After a peer with processes of its own answers, the next arm waits until those "
    "processes are idle (decision.<case>.settled_s: vLLM's engine core keeps a core busy for about a second after "
    "each request, which would otherwise slow whichever arm came next).",
    "Prompts: every arm of the grid (cells) runs blink's rendered prompts (blink's template), and so do llama.cpp, "
    "blink_vllm and pipeline_export (blink's exported config, token for token). pipeline('decision') and "
    "pipeline_bfloat16 run the pipeline's own built-in prompt, so they answer a different prompt and may pick "
    "differently (decision.<case>.vs_<arm>.picks_differ_from_blink).",
    "Model FLOP utilisation (decision.<case>.arms.<arm>.utilisation): the prefill FLOPs of the non-embedding weights "
    "(2 x those weights per token an arm's model computed: blink's meta.prefill_tokens, the pipelines' input_ids "
    "counted at their model's forward, llama.cpp's evaluated tokens, blink_vllm's x_meta.prefill_tokens; attention "
    "and the LM head left out) over the arm's wall time, as a share of the matmul probe at the dtype it computes in "
    "(matmul_gflops_by_dtype; probe_dtype says which: llama.cpp's Q4_1 has none of its own and is held against "
    "float32's). A cache that spares tokens lowers an arm's utilisation and its time alike.",
    "Over HTTP, every request is new (workloads.DISTINCT): transformers serve keeps nothing across requests, and "
    "blink's answer cache would answer an exact repeat without running the model.",
    "unsteady is true when the matmul probe at the end of the run differs from the one at its start by more than "
    "unsteady_threshold (of the larger): the machine's speed changed during the run, so its ratios are suspect.",
    "Cells whose arm says extrapolated=true ran only measured_questions of the request's questions; wall_s and "
    "prefill_tokens are scaled to the whole request (the peers answer each question independently, so their cost "
    "is linear in the question count; blink plain runs whole batches of the subsample).",
    "A measurement is taken once per run and reused by every cell that needs the same one (the first k questions "
    "of a larger set are the k questions of the smaller one).",
    "unbatched: model(ids).logits[0, -1] per question, the full LM head on every position, as written by hand.",
    "per_option: one forward of (context + option text)[:-1] per option, full-vocabulary log-softmax, summed "
    "continuation log-probs (lm-evaluation-harness `acc`; `acc_norm` divides by characters; SGLang select's "
    "default token_length_normalized averages per token). lm-evaluation-harness scores one-token continuations "
    "(letters) from one shared forward, and SGLang's radix cache encodes the shared context once; this arm is "
    "the K-forwards-per-question cost.",
    "generate: model.generate greedy, 4 new tokens, then the first offered letter in the text.",
    "gflops_2pt is 2 x all parameters x prefill tokens / wall time (the usual definition); "
    "gflops_body_attention counts what the prompt tokens need: 2 x non-embedding parameters per token plus "
    "attention products (4 x width x keys per full-attention layer), not the peers' LM head on every position. "
    "fraction_of_matmul_* holds each against the matmul probe at the dtype the arm computes in (blink's arms: "
    "blink's dtype; the peers: the checkpoint's).",
    "peak_mb: CPU resident-set peak above the level at the start of the arm (sampled every 5 ms), or the CUDA "
    "allocator peak on a GPU. On a CPU, memory an earlier arm freed may be reused without growing the resident "
    "set, so small figures are lower bounds.",
    "cpu_s: this process's CPU time (a peer in processes of its own: theirs); speedup_cpu_time repeats the ratios on "
    "it, which waiting for a core does not inflate.",
]


def _s(row: dict) -> str:
    """Seconds of one arm, starred when scaled from a subsample."""
    return f"{row['wall_s']:.2f}{'*' if row['extrapolated'] else ''}"


def _ratio(cell: dict, arm: str, peer: str, digits: int) -> str:
    """How many times faster blink arm `arm` answered than `peer` in one cell, starred when either side was scaled
    from a subsample."""
    scaled = cell["arms"][arm]["extrapolated"] or cell["arms"][peer]["extrapolated"]
    return f"{cell['speedup'][arm][peer]:.{digits}f}x{'*' if scaled else ''}"


GRID = arms.of("grid")


def cells_table(res: dict) -> list[str]:
    """One row per cell: time per request of every arm and the speed-ups (* where a side was scaled)."""
    head = ["doc tokens", "questions", "options", *(f"{arm.title} (s)" for arm in GRID.values())]
    head += ["blink vs per-option", "blink vs forward/question", "prefix vs blink"]
    head += ["differ (unbatched/per-option/generate)"]
    rows = []
    for c in res["cells"]:
        a, g = c["arms"], c["agreement"]
        differ = "/".join(f"{len(g[p]['differ'])} of {g[p]['compared']}" for p in GRID if p in g)
        rows.append(
            [c["doc_tokens"], c["questions"], c["options"], *(_s(a[k]) for k in GRID)]
            + [_ratio(c, "blink_plain", "per_option", 1), _ratio(c, "blink_plain", "unbatched", 2)]
            + [_ratio(c, "blink_prefix", "blink_plain", 1), differ]
        )
    return report.table(head, rows)


def flops_table(res: dict) -> list[str]:
    """Achieved prefill FLOP/s of blink's arms against the measured matmul."""
    head = ["doc tokens", "questions", "options", "arm", "prefill tokens", "GFLOP/s (2PT)", "of matmul"]
    head += ["GFLOP/s (body+attention)", "of matmul", "peak MB"]
    rows = [
        [c["doc_tokens"], c["questions"], c["options"], GRID[arm].title, r["prefill_tokens"]]
        + [f"{r['gflops_2pt']:.0f}", f"{r['fraction_of_matmul_2pt']:.0%}", f"{r['gflops_body_attention']:.0f}"]
        + [f"{r['fraction_of_matmul_body_attention']:.0%}", f"{r['peak_mb']:.0f}"]
        for c in res["cells"]
        for arm, r in ((arm, c["arms"][arm]) for arm in ("blink_plain", "blink_prefix"))
    ]
    return report.table(head, rows)


def throughput_table(res: dict) -> list[str]:
    """Requests per second and latency percentiles per batch window."""
    head = ["target", "workload", "window (ms)", "shared prefix", "clients", "requests/s", "p50 (ms)", "p99 (ms)"]
    head += ["mean requests per forward"]
    rows = []
    for r in res.get("throughput", []):
        if "skipped" in r:
            rows.append([r["target"], f"skipped: {r['skipped']}", *[""] * 7])
            continue
        window = "-" if r["window_ms"] is None else f"{r['window_ms']:g}"
        rows.append(
            [r["target"], r.get("workload", ""), window, "on" if r["prefix_cache"] else "off", r["clients"]]
            + [f"{r['requests_per_s']:.2f}", f"{r['p50_ms']:.0f}", f"{r['p99_ms']:.0f}", r["mean_batched_requests"]]
        )
    return report.table(head, rows)


CASE_NAMES = {
    "document": "questions over a new document",
    "again": "the same document, new questions",
    "short": "one short yes/no question",
}


def decision_table(res: dict) -> list[str]:
    """blink at its defaults against pipeline("decision") per case: time per request, ratios, tokens, and the
    questions where a peer picked another option than blink."""
    peers_ = [k[3:] for k in next(iter(res["decision"].values())) if k.startswith("vs_") and k != "vs_unbatched"]
    head = ["case", "questions", "prompt tokens", "computed by blink", "read from the cache", "blink (s)"]
    for p in peers_:
        head += [f"{p} (s)", f"blink vs {p} (wall / CPU)", f"{p} picks unlike blink"]
    rows = []
    for case, row in res["decision"].items():
        a, reps = row["arms"], len(row["arms"]["blink"]["wall_s"])
        compared = row["questions"] * row.get("requests_per_rep", 1)  # the first repetition's questions
        cells = [CASE_NAMES[case], row["questions"], row["prompt_tokens"], row["prefill_tokens"]]
        cells += [row["cached_tokens"], f"{a['blink']['total_wall_s'] / reps:.2f}"]
        for p in peers_:
            vs = row["vs_" + p]
            cells += [f"{a[p]['total_wall_s'] / reps:.2f}", f"{vs['wall']:.2f}x / {vs['cpu']:.2f}x"]
            cells += [f"{len(vs['picks_differ_from_blink'])} of {compared}"]
        rows.append([*cells, unbatched(row)])
    return report.table([*head, "differ from unbatched"], rows)


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
    rows = [
        [CASE_NAMES[case], f"{row['arms']['blink']['total_wall_s'] / len(row['arms']['blink']['wall_s']):.2f}"]
        + [f"{row['vs_' + peer]['wall']:.2f}x" for peer, _ in peers]
        for case, row in res["decision"].items()
    ]
    return report.table(["case", "blink (s)", *(title for _, title in peers)], rows)


def unbatched(row: dict) -> str:
    """How many of a case's blink answers picked otherwise than the unbatched path, of how many."""
    got = row["vs_unbatched"]
    return f"{len(got['picks_differ'])} of {got['questions']}"


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
            report.pct(a["utilisation"]),
        ]
        for case, row in res["decision"].items()
        for name, a in row["arms"].items()
        if a.get("utilisation") is not None
    ]
    return report.table(head, rows) if rows else []


def http_table(res: dict) -> list[str]:
    """Requests per second and latency over HTTP, per server and concurrency (and workload, where a row names one);
    skipped servers with the reason."""
    rows = res.get("http", [])
    named = any("workload" in r for r in rows)  # rows of servers that were skipped name none
    workload = lambda r: [r.get("workload", "")] if named else []  # noqa: E731
    cells = [
        [r["target"], *workload(r), r["clients"], r["completed"], f"{r['requests_per_s']:.2f}"]
        + [f"{r['p50_ms']:.0f}", f"{r['p99_ms']:.0f}"]
        if "requests_per_s" in r
        else [r["target"], *workload(r), f"skipped: {r['skipped']}", *[""] * 4]
        for r in rows
        if "requests_per_s" in r or "skipped" in r
    ]
    head = ["server", *(["workload"] if named else []), "clients", "requests", "requests/s", "p50 (ms)", "p99 (ms)"]
    return report.table(head, cells)


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


def run_report(res: dict) -> list[str]:
    """run (full, --decision, --quick): the targets, the decision peers, HTTP, the grid and serving."""
    head = (
        f"{res['model']} ({res['parameters'] / 1e6:.1f}M parameters, {res['dtype']}, {res['device']}), "
        f"{res['threads']['threads']} thread(s) ({res['threads']['how']}), "
        f"measured matmul {res['matmul_gflops']:.0f} GFLOP/s (best of the start and the end of the run)"
        + "".join(f", {d} {max(g):.0f}" for d, g in res.get("matmul_gflops_by_dtype", {}).items())
        + f", blink's linear layers by {res['settings'].get('linear_layers', 'torch')}."
    )
    parts = [head, "", *targets_list(res)]
    if res.get("decision"):  # a run without --decision or the full run has none
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


REPORT = (
    run_report,
    ("mode", "model", "parameters", "dtype", "device", "decision", "http", "peers_skipped", "cells", "throughput")
    + ("targets", "started_at"),
)
