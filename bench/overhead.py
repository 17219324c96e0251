"""Where the time of one short question goes: parsing, rendering and tokenizing, the forward, answering.

    python -m bench overhead          # 30 repetitions of each step, one thread
    python -m bench overhead --quick  # 5 repetitions

Each step of one short question (the forward, and within it the model; answer assembly and meta) under each of the
registry's "overhead" arms (bench/lib/arms.py): blink's defaults, shared prefixes off (the earlier default) and the
linear layers by torch's own kernels (BLINK_CPU_MATMUL=torch) where the defaults chose oneDNN. CPU time per step, the
best repetition (this process's CPU time, which waiting for a core does not inflate). Then the forward at the
defaults under torch's profiler: the share of its CPU time in matrix products and their FLOP/s, against one large
product of the same width on this machine (what the CPU can do).
Writes bench/results/overhead.json; the last line printed is a summary.
"""

from __future__ import annotations

import os
from dataclasses import replace

import blink
from bench.lib import arms, harness, report, workloads

# torch-bound: loaded when the run starts, not when `python -m bench report` reads this module's tables
peers = harness.lazy("bench.peers.decision")

STATE = "Order 4417: I was charged twice for the same order and want my money back."
QUESTIONS = {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}


def best_ms(fn, reps: int) -> tuple[float, object]:
    """The least CPU time of `reps` calls, in ms, and that call's result."""
    _, cpu, out = harness.best_of(fn, reps, lambda wall, cpu, out: cpu)
    return round(cpu * 1000, 3), out


def steps(dep: blink.Deployment, reps: int) -> dict:
    """Each step of one request, timed on its own, and the whole decide() call."""
    engine = dep.engine()
    parse_ms, request = best_ms(lambda: dep.request(STATE, QUESTIONS), reps)
    prepare_ms, job = best_ms(lambda: engine.prepare(request), reps)
    forward_ms, (forward,) = best_ms(lambda: engine.run([job]), reps)
    answer_ms, _ = best_ms(lambda: dep.answer(job, forward, 1.0), reps)
    decide_ms, out = best_ms(lambda: dep.decide(STATE, QUESTIONS), reps)
    return {
        "parse_ms": parse_ms,
        "render_tokenize_ms": prepare_ms,
        "forward_ms": forward_ms,
        "answer_meta_ms": answer_ms,
        "decide_ms": decide_ms,
        "prompt_tokens": out["meta"]["input_tokens"],
        "computed_tokens": out["meta"]["prefill_tokens"],
        "cached_tokens": out["meta"]["cached_tokens"],
    }


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")  # torch's kernels, oneDNN's


def forward_profile(dep: blink.Deployment, reps: int, forward_ms: float, computed: int) -> dict:
    """The defaults' forward of the short question under torch's profiler: matrix products' share of its CPU time,
    and the rate they ran at (2 x non-embedding parameters per computed token over that share of the unprofiled
    forward_ms), beside one large product (2,048 x 2,048 x 2,048, the faster kernel) on this machine."""
    from torch.profiler import ProfilerActivity, profile

    engine = dep.engine()
    job = engine.prepare(dep.request(STATE, QUESTIONS))
    engine.run([job])  # the header is kept from here on, as in a server
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            engine.run([job])
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total_us = sum(e.self_cpu_time_total for e in events)
    share = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS) / total_us
    return {
        "matmul_share": round(share, 3),
        "matmul_gflops": round(engine.prefill_cost.token_flops * computed / (share * forward_ms / 1000) / 1e9, 1),
        "large_product_gflops": round(harness.matmul_flops(engine.model.device) / 1e9, 1),
        "top_ops": [
            {"op": e.key, "self_cpu_ms": round(e.self_cpu_time_total / 1000 / reps, 2)}
            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:6]
        ],
    }


def kernel_gflops(engine: blink.TorchEngine, rows: int, reps: int) -> dict:
    """GFLOP/s of a `rows`-row product of the model's MLP shape by torch's own kernel and by oneDNN's (what
    BLINK_CPU_MATMUL chooses between), the best of `reps`."""
    hidden, width = blink.mlp_shape(engine.model)
    import torch

    seconds = harness.kernel_seconds(torch.randn(rows, hidden), torch.randn(width, hidden), reps)
    return {
        "rows": rows,
        "shape": [width, hidden],
        **{name: round(2 * rows * hidden * width / s / 1e9, 1) for name, s in seconds.items()},
    }


def pipeline_prompt_tokens(engine: blink.TorchEngine) -> int | None:
    """Tokens transformers' pipeline("decision") runs through the model for the same question with its own built-in
    prompt (counted at the model's input); None where this transformers has no decision pipeline."""
    try:
        pipe = peers.decision_pipeline(engine)
    except (KeyError, ValueError, ImportError):
        return None
    seen: list[int] = []
    hook = pipe.model.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append((kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[-1]),
        with_kwargs=True,
    )
    try:
        pipe(workloads.system_one(STATE, QUESTIONS))
    finally:
        hook.remove()
    return sum(seen)


def main(argv: list[str] | None = None) -> int:
    """Time the steps under each arm; write JSON; print one summary line last."""
    run = harness.Run("overhead", argv, __doc__)
    reps = 5 if run.quick else 30
    engines = arms.engines("overhead", blink.STANDIN_MODEL, blink.Settings.from_env({}))
    run.probe()
    rows = {}
    for name, eng in engines.items():
        # the same request again and again: no answer cache, so each decide() runs the model
        serving = blink.Deployment.serving(eng, replace(eng.settings, answer_cache_mb=0))
        rows[name] = {"linear_layers": eng.matmul, **steps(serving, reps)}
        print(f"{name:>13}: " + ", ".join(f"{k} {v}" for k, v in rows[name].items()), flush=True)
    engine, d = engines["defaults"], rows["defaults"]
    profiled = forward_profile(
        blink.Deployment.serving(engine, replace(engine.settings, answer_cache_mb=0)),
        reps,
        d["forward_ms"],
        d["computed_tokens"],
    )
    print(f"   profile: {profiled}", flush=True)
    kernels = kernel_gflops(engine, d["computed_tokens"], reps)
    print(f"   kernels: {kernels}", flush=True)
    peer_tokens = pipeline_prompt_tokens(engine)
    res = {
        "repetitions": reps,
        "rows": rows,
        "forward_profile": profiled,
        "kernel_gflops": kernels,
        "pipeline_prompt_tokens": peer_tokens,
    }
    path = run.write(res)
    outside = d["parse_ms"] + d["render_tokenize_ms"] + d["answer_meta_ms"]
    print(
        f"blink overhead ({blink.hardware()}, {run.threads} thread(s)): one short question, decide "
        f"{d['decide_ms']:.1f} ms CPU at the defaults ({d['computed_tokens']} of {d['prompt_tokens']} tokens "
        f"computed; pipeline('decision') runs {peer_tokens} with its own prompt) against "
        f"{rows['prefix off']['decide_ms']:.1f} ms with shared prefixes off; linear layers by {d['linear_layers']} "
        f"(BLINK_CPU_MATMUL=auto), {rows['torch kernels']['decide_ms']:.1f} ms by torch's own (a {kernels['rows']}-row "
        f"product of the MLP's shape: {kernels['torch']} GFLOP/s by torch's kernel, {kernels.get('onednn')} by "
        "oneDNN's); outside the forward "
        f"{outside:.2f} ms (parse {d['parse_ms']}, render and tokenize {d['render_tokenize_ms']}, answer and meta "
        f"{d['answer_meta_ms']}); matrix products {profiled['matmul_share']:.0%} of the forward at "
        f"{profiled['matmul_gflops']:.0f} GFLOP/s against {profiled['large_product_gflops']:.0f} for one large "
        "product; "
        f"results {os.path.relpath(path)}"
    )
    return 0


OVERHEAD_STEPS = {
    "parse_ms": "parse",
    "render_tokenize_ms": "render + tokenize",
    "forward_ms": "forward",
    "answer_meta_ms": "answer + meta",
    "decide_ms": "whole decide()",
}


def overhead_table(res: dict) -> list[str]:
    """CPU ms of each step of one short question, per configuration."""
    head = ["configuration", "linear layers", *(f"{v} (ms)" for v in OVERHEAD_STEPS.values())]
    rows = [
        [name, r.get("linear_layers", "torch"), *(f"{r[k]:.2f}" for k in OVERHEAD_STEPS)]
        + [r["prompt_tokens"], r["computed_tokens"], r["cached_tokens"]]
        for name, r in res["rows"].items()
    ]
    return report.table([*head, "prompt tokens", "computed", "from the cache"], rows)


REPORT = (overhead_table, ("rows",))
