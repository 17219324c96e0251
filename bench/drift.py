"""How far bfloat16 moves blink's answers, with and without the shared prefix, against a float32 reference.

    python bench/drift.py            # the stand-in (2,000 and 7,000-token logs) and a tiny Qwen3.5 (18,000 tokens)
    python bench/drift.py --quick    # shorter logs, under a minute

For each model and document: the same questions answered by the plain path in float32 (the reference), the plain
path in bfloat16, and the shared-prefix path in bfloat16 (the evidence encoded once, each question's tail against a
copy; then the same request again, its evidence read from the kept prefix). Reported per arm: the largest label-logit
and probability difference from the reference, and the answers whose pick differs. The shared prefix is on by default
in a dtype only where its drift is no larger than the plain path's own (Settings.derived_defaults). Writes
bench/results/drift.json; the last line printed is a summary.
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

import torch  # noqa: E402

import blink  # noqa: E402
import saved  # noqa: E402
import workloads  # noqa: E402

CONFIGS = {"full": {"standin": [2000, 7000], "tiny": [18000], "questions": 4},
           "quick": {"standin": [300], "tiny": [2000], "questions": 2}}


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


def engines(model: str) -> dict[str, blink.TorchEngine]:
    """The model under the three settings compared: float32 plain, bfloat16 plain, bfloat16 with shared prefixes."""
    base = blink.Settings(prefix_min_tokens=256)
    return {"fp32_plain": blink.TorchEngine(model, settings=replace(base, dtype="float32", prefix_cache=False)),
            "bf16_plain": blink.TorchEngine(model, settings=replace(base, dtype="bfloat16", prefix_cache=False)),
            "bf16_prefix": blink.TorchEngine(model, settings=replace(base, dtype="bfloat16", prefix_cache=True))}


def probabilities(readouts: dict) -> dict[str, list[float]]:
    """Each question's label distribution at temperature 1."""
    return {k: blink.softmax(r.logits[0], 1.0) for k, r in readouts.items()}


def compare(ref: dict, got: dict) -> dict:
    """The largest label-logit and probability differences of one arm's readouts from the reference's, and the
    questions whose top label differs."""
    p_ref, p_got = probabilities(ref), probabilities(got)
    return {"max_logit_diff": max(abs(a - b) for k in ref for a, b in zip(ref[k].logits[0], got[k].logits[0])),
            "max_prob_diff": max(abs(a - b) for k in ref for a, b in zip(p_ref[k], p_got[k])),
            "picks_differ": sorted(k for k in ref if max(range(len(p_ref[k])), key=p_ref[k].__getitem__)
                                   != max(range(len(p_got[k])), key=p_got[k].__getitem__))}


def measure(name: str, model: str, targets: list[int], n_questions: int) -> list[dict]:
    """Every arm on each document length of one model."""
    arms = engines(model)
    rows = []
    for target in targets:
        doc = workloads.document(arms["fp32_plain"].tok, target, seed=7)
        qs = workloads.questions(n_questions, 4, workloads.ticket_count(doc))
        request = blink.parse_request(doc, qs, settings=arms["fp32_plain"].settings)
        t0 = time.perf_counter()
        ref = arms["fp32_plain"].forward(request).readouts
        plain = arms["bf16_plain"].forward(request).readouts
        arms["bf16_prefix"].prefixes.clear()
        cold = arms["bf16_prefix"].forward(request)
        warm = arms["bf16_prefix"].forward(request)
        prompt = arms["fp32_plain"].render(request)[0]
        row = {"model": name, "doc_tokens": prompt.cuts[1] - prompt.cuts[0], "questions": n_questions,
               "prompt_tokens": len(prompt.ids), "bf16_plain": compare(ref, plain),
               "bf16_prefix": compare(ref, cold.readouts), "bf16_prefix_kept": compare(ref, warm.readouts),
               "bf16_prefix_vs_bf16_plain": compare(plain, cold.readouts),
               "kept_tokens_read": warm.cached_tokens, "seconds": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(f"{name:>8} {row['doc_tokens']:>6} tok: bf16 plain {row['bf16_plain']['max_logit_diff']:.4f} logit / "
              f"{row['bf16_plain']['max_prob_diff']:.4f} prob, bf16 prefix {row['bf16_prefix']['max_logit_diff']:.4f}"
              f" / {row['bf16_prefix']['max_prob_diff']:.4f} (kept {row['bf16_prefix_kept']['max_logit_diff']:.4f}),"
              f" picks differ {len(row['bf16_plain']['picks_differ'])}/{len(row['bf16_prefix']['picks_differ'])} of "
              f"{n_questions} ({row['seconds']} s)", flush=True)
    return rows


def summary_line(res: dict, path: str) -> str:
    """The one line the command ends with."""
    worst = {arm: max(r[arm]["max_prob_diff"] for r in res["rows"]) for arm in ("bf16_plain", "bf16_prefix")}
    flips = {arm: sum(len(r[arm]["picks_differ"]) for r in res["rows"]) for arm in ("bf16_plain", "bf16_prefix")}
    asked = sum(r["questions"] for r in res["rows"])
    return (f"blink drift ({res['mode']}, {res['hardware']}, {res['duration_s']:.0f} s): bf16 against fp32, largest "
            f"probability difference plain {worst['bf16_plain']:.4f}, shared prefix {worst['bf16_prefix']:.4f}; "
            f"picks differ plain {flips['bf16_plain']}, prefix {flips['bf16_prefix']} of {asked}; results "
            f"{os.path.relpath(path)}")


def main(argv: list[str] | None = None) -> int:
    """Measure, write JSON, print one summary line last."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short documents, under a minute")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for the JSON")
    args = ap.parse_args(argv)
    mode = "quick" if args.quick else "full"
    cfg = CONFIGS[mode]
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rows = measure("stand-in", blink.STANDIN_MODEL, cfg["standin"], cfg["questions"])
    with tempfile.TemporaryDirectory() as tmp:
        rows += measure("qwen3.5-tiny", tiny_qwen(os.path.join(tmp, "tiny"), max(cfg["tiny"]) + 2048), cfg["tiny"],
                        cfg["questions"])
    res = {"mode": mode, "command": saved.command("drift.py", argv),
           "hardware": blink.hardware(), "torch": torch.__version__, "threads": args.threads, "rows": rows,
           "duration_s": round(time.perf_counter() - started, 1),
           "notes": ["Reference: the plain path in float32. Probabilities are each question's softmax over its labels "
                     "at temperature 1; picks are the top label.",
                     "bf16_prefix: the evidence encoded once and kept (cold); bf16_prefix_kept: the same request "
                     "again, its evidence read from the kept prefix.",
                     "Measured on a CPU (no GPU here): CUDA's bfloat16 kernels round differently, so rerun this on "
                     "the GPU a deployment uses before relying on the figures there."]}
    path = saved.write_json(os.path.join(args.out, f"drift{'-quick' if args.quick else ''}.json"), res)
    print(summary_line(res, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
