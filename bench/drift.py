"""Precision by measurement: bfloat16 and int8 against float32, for speed and for how far they move the answers.

    python -m bench drift            # the stand-in (100, 1,000, 3,800 and 7,000-token logs), a tiny Qwen3.5 (to 18,000)
    python -m bench drift --quick    # shorter logs, one repetition, a few minutes

Arms (the registry's "drift" arms, bench/arms.py), each a torch engine at blink's defaults but for what it names:
  float32          float32 on torch's own kernels (BLINK_DTYPE=float32 BLINK_CPU_MATMUL=torch): the exact path, and
                   the reference every other arm is compared with
  float32_onednn   float32 with the linear layers by oneDNN (BLINK_CPU_MATMUL=onednn)
  bfloat16         bfloat16 weights and activations (BLINK_DTYPE=bfloat16), shared prefixes on
  bfloat16_plain   the same without shared prefixes (BLINK_PREFIX_CACHE=0): the prefix path drifts no more than this
  int8             bfloat16 with every linear layer but lm_head int8 (BLINK_QUANTIZE=int8: weights per output
                   channel, widened to bfloat16 as each layer runs)

Each document gets 8 questions of every type (6 choices of 4 options, a yes/no, a 5-level score). Reported per arm:
the largest label-logit and probability difference from float32 and the questions whose pick differs, with
float32's margin between its top two labels there (from a first, untimed run that warms every arm), and its time
against float32's (bfloat16_plain untimed): the request runs cold (only the template header kept, as after any
other request), the arms interleaved and each repetition's order rotated, the least wall and CPU time of the
repetitions kept. Answers are compared as every benchmark compares them (bench/answers.py). Writes
bench/results/drift.json (drift-quick.json with --quick); the last line is a summary.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import blink
from bench import answers, arms, grid, harness, report, workloads
from tests import tiny_models

CONFIGS = {
    "full": {"standin": [100, 1000, 3800, 7000], "tiny": [100, 1000, 18000], "reps": 3},
    "quick": {"standin": [100, 1000], "tiny": [100, 2000], "reps": 1},
}
REFERENCE = "float32"
UNTIMED = ("bfloat16_plain",)  # run for its drift only: the plain path over long logs is slow and not a default
WARM = ("The parcel arrived on time.", {"q": {"type": "noul", "instructions": "Did the parcel arrive?"}})


def tiny_qwen(folder: str, context: int) -> str:
    """A tiny random-weight Qwen3.5 (linear and full attention layers) with room for `context` tokens."""
    model_folder(folder, {"max_position_embeddings": context})
    return folder


def model_folder(
    folder: str, shape: dict, dtype=None, device: str = "cpu", mrope_section: list[int] | None = None
) -> int:
    """A random-weight Qwen3.5 text model (the test tokenizer, tests/tiny_models.py) with the config fields in
    `shape` over the tiny test model's (and its rotary sections), built on `device` in `dtype` (float32 unless told)
    and saved to `folder`; its parameter count."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    tok = tiny_models.build_tokenizer()
    config = tiny_models.text_config(tok)
    for key, value in shape.items():
        setattr(config, key, value)
    if mrope_section:
        config.rope_parameters = {**config.rope_parameters, "mrope_section": mrope_section}
    tok.model_max_length = config.max_position_embeddings
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config).to(dtype or torch.float32).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


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


def evidence_tokens(prompt: blink.Prompt) -> int:
    """How many of a rendered prompt's tokens are the evidence (between its first and last cut; all of it when the
    prompt has no cuts)."""
    return prompt.cuts[-1] - prompt.cuts[0] if prompt.cuts else len(prompt.ids)


@dataclass
class Cold:
    """One request over a log the engine had not seen: its wall and CPU seconds, its answers at temperature 1, and on
    a GPU the memory it took beyond what was held before it (torch's allocator)."""

    wall_s: float
    cpu_s: float
    answers: dict
    working_mb: float | None = None


def cold_run(engine: blink.TorchEngine, request: blink.Request, warm: blink.Request) -> Cold:
    """The request over a log the engine has not seen: its kept prefixes dropped, then the template header kept by
    a short request, as after any other request. On a GPU the wall time waits for the device."""
    engine.prefixes.clear()
    engine.forward(warm)
    device = engine.model.lm_head.weight.device

    def forward() -> blink.Forward:
        result = engine.forward(request)
        harness.sync(device)
        return result

    if device.type != "cuda":
        wall, cpu, result = harness.timed(forward)
        return Cold(wall, cpu, answers.of(request, result.readouts))
    with grid.PeakMemory(device) as memory:
        wall, cpu, result = harness.timed(forward)
    return Cold(wall, cpu, answers.of(request, result.readouts), memory.peak_mb)


def measure(name: str, model: str, targets: list[int], reps: int) -> list[dict]:
    """Every arm on each document length of one model: drift from float32 and time against it."""
    engines = arms.engines("drift", model, blink.Settings(prefix_min_tokens=256))
    ref = engines[REFERENCE]
    warm = blink.parse_request(*WARM, settings=ref.settings)
    rows = []
    for target in targets:
        doc = workloads.document(ref.tok, target, seed=7)
        request = blink.parse_request(doc, questions(workloads.ticket_count(doc)), settings=ref.settings)
        prompt = ref.render(request)[0]
        first = {arm: cold_run(engine, request, warm).answers for arm, engine in engines.items()}  # warms each arm
        timed = [arm for arm in engines if arm not in UNTIMED]
        best: dict[str, list[float]] = {arm: [float("inf"), float("inf")] for arm in timed}
        for rep in range(reps):
            for arm in timed[rep % len(timed) :] + timed[: rep % len(timed)]:
                got = cold_run(engines[arm], request, warm)
                best[arm] = [min(best[arm][0], got.wall_s), min(best[arm][1], got.cpu_s)]
        row = {
            "model": name,
            "doc_tokens": evidence_tokens(prompt),
            "questions": len(request.questions),
            "prompt_tokens": sum(len(p.ids) for p in ref.render(request)),
            "arms": {},
        }
        for arm in engines:
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
            differ = {} if arm == REFERENCE else answers.compare(first[REFERENCE], first[arm])
            row["arms"][arm] = {**timing, **differ}
        row["bfloat16_vs_bfloat16_plain"] = answers.compare(first["bfloat16_plain"], first["bfloat16"])
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


def main(argv: list[str] | None = None) -> int:
    """Measure, write JSON, print one summary line last."""
    run = harness.Run("drift", argv, __doc__, lambda ap: ap.add_argument("--reps", type=int, help="default 3, quick 1"))
    cfg = CONFIGS["quick" if run.quick else "full"]
    reps = run.args.reps or cfg["reps"]
    run.probe()
    rows = measure("stand-in", blink.STANDIN_MODEL, cfg["standin"], reps)
    with tempfile.TemporaryDirectory() as tmp:
        rows += measure(
            "qwen3.5-tiny", tiny_qwen(os.path.join(tmp, "tiny"), max(cfg["tiny"]) + 2048), cfg["tiny"], reps
        )
    res = {
        "cpu_bf16": blink.native_bf16(),
        "reps": reps,
        "rows": rows,
        "worst": {arm: worst(rows, arm) for arm in arms.of("drift") if arm != REFERENCE},
        "notes": [
            "Reference: float32 on torch's own kernels with shared prefixes (equal to the plain path within "
            "float rounding). Probabilities are each question's distribution over its options at temperature 1; "
            "picks are the most probable option.",
            "Times: one request over a log not seen before, the arms interleaved, the least of the "
            "repetitions; speedup_cpu (this process's CPU time) is the figure that waiting for a core does not "
            "inflate.",
            "The tiny Qwen3.5 has random weights and 64 hidden units: its times say little about a real "
            "model; it is here for the drift of its linear-attention layers.",
            "Measured on a CPU: CUDA's bfloat16 kernels round differently, so rerun this on the GPU a "
            "deployment uses before relying on the figures there.",
        ],
    }
    path = run.write(res)
    print(report.drift_summary(run.written, path))
    return 0
