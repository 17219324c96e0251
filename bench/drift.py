"""Precision by measurement: bfloat16 and int8 against float32, for speed and for how far they move the answers.

    python bench/drift.py            # the stand-in (100, 1,000, 3,800 and 7,000-token logs), a tiny Qwen3.5 (to 18,000)
    python bench/drift.py --quick    # shorter logs, one repetition, a few minutes

Arms, each a torch engine at blink's defaults but for what it names:
  float32          float32 on torch's own kernels (BLINK_DTYPE=float32 BLINK_CPU_MATMUL=torch): the exact path, and
                   the reference every other arm is compared with
  float32_onednn   float32 with the linear layers by oneDNN (BLINK_CPU_MATMUL=onednn)
  bfloat16         bfloat16 weights and activations (BLINK_DTYPE=bfloat16), shared prefixes on
  bfloat16_plain   the same without shared prefixes (BLINK_PREFIX_CACHE=0): the prefix path drifts no more than this
  int8             float32 with every linear layer but lm_head quantized to int8 by torch's dynamic quantization
                   (weights int8, activations quantized per batch)

Each document gets 8 questions of every type (6 choices of 4 options, a yes/no, a 5-level score). Reported per arm:
the largest label-logit and probability difference from float32 and the questions whose pick differs, with
float32's margin between its top two labels there (from a first, untimed run that warms every arm), and its time
against float32's (bfloat16_plain untimed): the request runs cold (only the template header kept, as after any
other request), the arms interleaved and each repetition's order rotated, the least wall and CPU time of the
repetitions kept. Writes bench/results/drift.json (drift-quick.json with --quick); the last line is a summary.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import saved  # noqa: E402
import torch  # noqa: E402
import workloads  # noqa: E402

import blink  # noqa: E402

CONFIGS = {
    "full": {"standin": [100, 1000, 3800, 7000], "tiny": [100, 1000, 18000], "reps": 3},
    "quick": {"standin": [100, 1000], "tiny": [100, 2000], "reps": 1},
}
REFERENCE = "float32"
UNTIMED = ("bfloat16_plain",)  # run for its drift only: the plain path over long logs is slow and not a default
WARM = ("The parcel arrived on time.", {"q": {"type": "noul", "instructions": "Did the parcel arrive?"}})


def tiny_qwen(folder: str, context: int) -> str:
    """A tiny random-weight Qwen3.5 (linear and full attention layers) with room for `context` tokens."""
    import tiny_models
    from transformers import Qwen3_5ForCausalLM

    tok = tiny_models.build_tokenizer()
    config = tiny_models.text_config(tok)
    config.max_position_embeddings = context
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(config).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def quantize_int8(engine: blink.TorchEngine) -> blink.TorchEngine:
    """The engine with every linear layer but lm_head (blink reads its rows itself) quantized to int8 by torch's
    dynamic quantization."""
    from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic

    head = engine.model.get_output_embeddings()
    names = {
        name: default_dynamic_qconfig
        for name, m in engine.model.named_modules()
        if type(m) is torch.nn.Linear and m is not head
    }
    quantize_dynamic(engine.model, names, dtype=torch.qint8, inplace=True)
    return engine


def engines(model: str) -> dict[str, blink.TorchEngine]:
    """The model under each arm's settings (see the module's docstring)."""
    base = blink.Settings(prefix_min_tokens=256)
    fp32 = replace(base, dtype="float32")
    bf16 = replace(base, dtype="bfloat16")
    return {
        "float32": blink.TorchEngine(model, settings=replace(fp32, cpu_matmul="torch")),
        "float32_onednn": blink.TorchEngine(model, settings=replace(fp32, cpu_matmul="onednn")),
        "bfloat16": blink.TorchEngine(model, settings=bf16),
        "bfloat16_plain": blink.TorchEngine(model, settings=replace(bf16, prefix_cache=False)),
        "int8": quantize_int8(blink.TorchEngine(model, settings=replace(fp32, cpu_matmul="torch"))),
    }


def questions(n_tickets: int) -> dict:
    """Eight questions about a ticket log, every type: six choices of four teams, a yes/no and a 5-level score."""
    qs = workloads.questions(6, 4, n_tickets)
    last = max(1, n_tickets)
    qs["refund"] = {"type": "noul", "instructions": f"Did the customer in ticket #{last} ask for a refund?"}
    qs["upset"] = {
        "type": "score",
        "instructions": f"How upset is the customer in ticket #{last}?",
        "criteria": ["calm", "mildly annoyed", "frustrated", "angry", "furious"],
    }
    return qs


def probabilities(readouts: dict) -> dict[str, list[float]]:
    """Each question's label distribution at temperature 1."""
    return {k: blink.softmax(r.logits[0], 1.0) for k, r in readouts.items()}


def compare(ref: dict, got: dict) -> dict:
    """The largest label-logit and probability differences of one arm's readouts from the reference's, and the
    questions whose top label differs."""
    p_ref, p_got = probabilities(ref), probabilities(got)
    differ = sorted(
        k
        for k in ref
        if max(range(len(p_ref[k])), key=p_ref[k].__getitem__) != max(range(len(p_got[k])), key=p_got[k].__getitem__)
    )
    return {
        "max_logit_diff": max(abs(a - b) for k in ref for a, b in zip(ref[k].logits[0], got[k].logits[0])),
        "max_prob_diff": max(abs(a - b) for k in ref for a, b in zip(p_ref[k], p_got[k])),
        "picks_differ": differ,
        "reference_margins": {k: round(margin(p_ref[k]), 4) for k in differ},
    }


def margin(probs: list[float]) -> float:
    """How far the top label's probability is ahead of the next one's."""
    top, second = sorted(probs, reverse=True)[:2]
    return top - second


def evidence_tokens(prompt: blink.Prompt) -> int:
    """How many of a rendered prompt's tokens are the evidence (between its first and last cut; all of it when the
    prompt has no cuts)."""
    return prompt.cuts[-1] - prompt.cuts[0] if prompt.cuts else len(prompt.ids)


def cold_run(engine: blink.TorchEngine, request: blink.Request, warm: blink.Request) -> tuple[float, float, dict]:
    """One request over a log the engine has not seen (its kept prefixes dropped, then the template header kept by
    a short request, as after any other request): wall and CPU seconds, and the readouts."""
    engine.prefixes.clear()
    engine.forward(warm)
    wall, cpu = time.perf_counter(), time.process_time()
    readouts = engine.forward(request).readouts
    return time.perf_counter() - wall, time.process_time() - cpu, readouts


def measure(name: str, model: str, targets: list[int], reps: int) -> list[dict]:
    """Every arm on each document length of one model: drift from float32 and time against it."""
    arms = engines(model)
    ref = arms[REFERENCE]
    warm = blink.parse_request(*WARM, settings=ref.settings)
    rows = []
    for target in targets:
        doc = workloads.document(ref.tok, target, seed=7)
        request = blink.parse_request(doc, questions(workloads.ticket_count(doc)), settings=ref.settings)
        prompt = ref.render(request)[0]
        first = {arm: cold_run(engine, request, warm)[2] for arm, engine in arms.items()}  # warms every arm too
        timed = [arm for arm in arms if arm not in UNTIMED]
        best: dict[str, list[float]] = {arm: [float("inf"), float("inf")] for arm in timed}
        for rep in range(reps):
            for arm in timed[rep % len(timed) :] + timed[: rep % len(timed)]:
                wall, cpu, _ = cold_run(arms[arm], request, warm)
                best[arm] = [min(best[arm][0], wall), min(best[arm][1], cpu)]
        row = {
            "model": name,
            "doc_tokens": evidence_tokens(prompt),
            "questions": len(request.questions),
            "prompt_tokens": sum(len(p.ids) for p in ref.render(request)),
            "arms": {},
        }
        for arm in arms:
            timing = (
                {}
                if arm in UNTIMED
                else {
                    "wall_s": round(best[arm][0], 4),
                    "cpu_s": round(best[arm][1], 4),
                    "speedup_wall": round(best[REFERENCE][0] / best[arm][0], 3),
                    "speedup_cpu": round(best[REFERENCE][1] / best[arm][1], 3),
                }
            )
            row["arms"][arm] = {**timing, **({} if arm == REFERENCE else compare(first[REFERENCE], first[arm]))}
        row["bfloat16_vs_bfloat16_plain"] = compare(first["bfloat16_plain"], first["bfloat16"])
        rows.append(row)
        print(
            f"{name:>12} {row['doc_tokens']:>6} tok: "
            + "; ".join(
                f"{arm}"
                + (f" {v['speedup_cpu']:.2f}x" if "speedup_cpu" in v else "")
                + (
                    f" {v['max_prob_diff']:.4f} {len(v['picks_differ'])} flips"
                    if arm != REFERENCE
                    else f" {v['cpu_s']:.2f}s"
                )
                for arm, v in row["arms"].items()
            ),
            flush=True,
        )
    return rows


def worst(rows: list[dict], arm: str, model: str | None = None) -> dict:
    """An arm's largest probability difference, its picks that differ and its least speedup over the rows."""
    picked = [r for r in rows if model is None or r["model"] == model]
    return {
        "max_prob_diff": max(r["arms"][arm]["max_prob_diff"] for r in picked),
        "picks_differ": sum(len(r["arms"][arm]["picks_differ"]) for r in picked),
        "asked": sum(r["questions"] for r in picked),
        "min_speedup_cpu": min(
            (r["arms"][arm]["speedup_cpu"] for r in picked if "speedup_cpu" in r["arms"][arm]), default=None
        ),
        "widest_flipped_margin": max(
            (m for r in picked for m in r["arms"][arm]["reference_margins"].values()), default=None
        ),
    }


def summary_line(res: dict, path: str) -> str:
    """The one line the command ends with."""
    stand = [r for r in res["rows"] if r["model"] == "stand-in"]
    parts = []
    for arm in ("bfloat16", "int8"):
        w = worst(res["rows"], arm)
        speed = "/".join(f"{r['arms'][arm]['speedup_cpu']:.2f}" for r in stand)
        parts.append(
            f"{arm}: stand-in {speed}x float32's speed (CPU time; logs of "
            f"{'/'.join(str(r['doc_tokens']) for r in stand)} tokens), largest probability difference "
            f"{w['max_prob_diff']:.4f}, picks differ {w['picks_differ']} of {w['asked']}"
        )
    return (
        f"blink precision ({res['mode']}, {res['hardware']}, {res['threads']} thread, {res['duration_s']:.0f} s): "
        f"{'; '.join(parts)}; results {os.path.relpath(path)}"
    )


def main(argv: list[str] | None = None) -> int:
    """Measure, write JSON, print one summary line last."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter documents, one repetition")
    ap.add_argument("--reps", type=int, help="repetitions per arm (default 3, quick 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for the JSON")
    args = ap.parse_args(argv)
    mode = "quick" if args.quick else "full"
    cfg = CONFIGS[mode]
    reps = args.reps or cfg["reps"]
    torch.set_num_threads(args.threads)
    started, load_before = time.perf_counter(), [round(x, 2) for x in os.getloadavg()]
    rows = measure("stand-in", blink.STANDIN_MODEL, cfg["standin"], reps)
    with tempfile.TemporaryDirectory() as tmp:
        rows += measure(
            "qwen3.5-tiny", tiny_qwen(os.path.join(tmp, "tiny"), max(cfg["tiny"]) + 2048), cfg["tiny"], reps
        )
    res = {
        "mode": mode,
        "command": saved.command("drift.py", argv),
        "hardware": blink.hardware(),
        "cpu_bf16": blink.native_bf16(),
        "torch": torch.__version__,
        "threads": args.threads,
        "reps": reps,
        "load_average": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]},
        "rows": rows,
        "worst": {arm: worst(rows, arm) for arm in ("float32_onednn", "bfloat16", "bfloat16_plain", "int8")},
        "duration_s": round(time.perf_counter() - started, 1),
        "notes": [
            "Reference: float32 on torch's own kernels with shared prefixes (equal to the plain path within "
            "float rounding). Probabilities are each question's softmax over its labels at temperature 1; "
            "picks are the top label.",
            "Times: one request over a log not seen before, the arms interleaved, the least of the "
            "repetitions; speedup_cpu (this process's CPU time) is the figure to read on a shared machine, "
            "where waiting for a core inflates the wall clock.",
            "The tiny Qwen3.5 has random weights and 64 hidden units: its times say little about a real "
            "model; it is here for the drift of its linear-attention layers.",
            "Measured on a CPU: CUDA's bfloat16 kernels round differently, so rerun this on the GPU a "
            "deployment uses before relying on the figures there.",
        ],
    }
    path = saved.write_json(os.path.join(args.out, f"drift{'-quick' if args.quick else ''}.json"), res)
    print(summary_line(res, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
