"""blink on a CUDA GPU at a production model's size: speed and GPU memory at the GPU defaults.

    python -m bench gpu            # needs a CUDA device; writes bench/results/gpu.json
    python -m bench gpu --quick    # shorter logs, one repetition

What the shared prefixes and the prefix copy budget change there, on one model built at that size.

The model is a random-weight Qwen3.5 text model built here at the shape below (4.21 B parameters, Qwen3.5's
hybrid of linear- and full-attention layers, its 248,320-entry vocabulary), with the tiny test tokenizer: its
answers mean nothing, its sizes and times are those of a model this large. It is not blink-4b, whose weights and
exact shape this benchmark does not read. Arms (the registry's "gpu" arms, bench/lib/arms.py), each a torch engine at
the defaults a GPU machine gets (Settings.from_env: bfloat16, shared prefixes, BLINK_PREFIX_KV_TOKENS 131,072) but for
what it names:
  default       the GPU defaults
  kv_32768      BLINK_PREFIX_KV_TOKENS=32768 (fewer prefix copies held at once)
  plain         BLINK_PREFIX_CACHE=0: every question runs its whole prompt
Each log gets 8 questions (six choices, a yes/no, a score). Each arm runs the request cold (kept prefixes dropped,
the template header kept by a short request), interleaved, the median of the repetitions kept, and its peak GPU
memory recorded: working_gib, what the request took beyond what was held before it (torch's allocator), and
peak_gib, that plus the arm's own weights: what one deployment of this model alone holds at its peak.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

import blink
from bench.lib import answers, arms, checkpoints, cold, harness, report, workloads

CONFIGS = {"full": {"docs": [1000, 4000, 16000], "reps": 3}, "quick": {"docs": [1000, 4000], "reps": 1}}


def build_model(folder: str) -> tuple[str, int]:
    """The random-weight Qwen3.5 of checkpoints.SHAPE saved in bfloat16 to `folder`, built on the GPU; (folder,
    parameter count)."""
    import torch

    params = checkpoints.qwen_4b(folder, "cuda")
    torch.cuda.empty_cache()
    return folder, params


def weights_gib(engine: blink.TorchEngine) -> float:
    """The GPU memory the engine's weights take (GiB)."""
    return sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 2**30


def measure(folder: str, targets: list[int], reps: int) -> list[dict]:
    """Every arm on each log length: median wall time, peak GPU memory, and the probability gap to the plain path."""
    engines = arms.engines("gpu", folder, blink.Settings.from_env({}))
    ref = engines["plain"]
    warm = blink.parse_request(*cold.WARM, settings=ref.settings)
    rows = []
    for target in targets:
        doc = workloads.document(ref.tok, target, seed=7)
        request = blink.parse_request(doc, cold.questions(workloads.ticket_count(doc)), settings=ref.settings)
        first = {arm: cold.cold_run(engine, request, warm) for arm, engine in engines.items()}  # warms each arm
        times: dict[str, list[float]] = {arm: [] for arm in engines}
        peaks = {arm: first[arm].working_mb / 1024 for arm in engines}
        names = list(engines)
        for rep in range(reps):
            for arm in names[rep % len(names) :] + names[: rep % len(names)]:
                got = cold.cold_run(engines[arm], request, warm)
                times[arm].append(got.wall_s)
                peaks[arm] = max(peaks[arm], got.working_mb / 1024)
        prompts = ref.render(request)
        row = {
            "doc_tokens": cold.evidence_tokens(prompts[0]),
            "questions": len(request.questions),
            "prompt_tokens": sum(len(p.ids) for p in prompts),
            "arms": {},
        }
        plain_s = statistics.median(times["plain"])
        for arm in engines:
            wall = statistics.median(times[arm])
            row["arms"][arm] = {
                "wall_s": round(wall, 4),
                "working_gib": round(peaks[arm], 2),
                "peak_gib": round(weights_gib(engines[arm]) + peaks[arm], 2),
                "speedup_vs_plain": round(plain_s / wall, 2),
                "max_prob_diff_vs_plain": round(
                    answers.compare(first["plain"].answers, first[arm].answers)["max_prob_diff"], 4
                ),
            }
        rows.append(row)
        print(
            f"{row['doc_tokens']:>6} tok: "
            + "; ".join(
                f"{arm} {v['wall_s'] * 1000:.0f} ms, {v['peak_gib']:.1f} GiB, {v['speedup_vs_plain']:.2f}x plain"
                for arm, v in row["arms"].items()
            ),
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Measure, write JSON, print one summary line last."""
    import torch

    run = harness.Run("gpu", argv, __doc__, threads="0")
    if not torch.cuda.is_available():
        print("python -m bench gpu needs a CUDA device; torch sees none", file=sys.stderr)
        return 2
    cfg = CONFIGS["quick" if run.quick else "full"]
    run.probe(torch.device("cuda"))
    with tempfile.TemporaryDirectory() as tmp:
        folder, params = build_model(os.path.join(tmp, "qwen3.5-4b-shape"))
        saved_gib = round(sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 2**30, 2)
        rows = measure(folder, cfg["docs"], cfg["reps"])
    res = {
        "model": {
            "kind": "random-weight Qwen3.5 text model",
            "parameters": params,
            "saved_gib": saved_gib,
            **checkpoints.SHAPE,
        },
        "defaults": {
            k: getattr(blink.Settings.from_env({}), k)
            for k in ("compute_dtype", "token_budget", "prefix_kv_tokens", "prefix_cache_mb")
        },
        "rows": rows,
        "notes": [
            "Random weights: the probability gaps say only that the arms compute the same thing; the "
            "sizes and times are those of a model of this shape.",
            "working_gib: torch.cuda.max_memory_allocated during the arm's runs less what was allocated "
            "before each; peak_gib adds the arm's own weights (the other arms' stay out).",
        ],
    }
    path = run.write(res)
    worst_peak = max(v["peak_gib"] for r in rows for v in r["arms"].values())
    print(
        f"blink on {blink.hardware()} ({params / 1e9:.2f} B-parameter Qwen3.5 shape, bfloat16): "
        f"largest peak GPU memory {worst_peak:.1f} GiB at up to {rows[-1]['doc_tokens']} tokens; shared prefixes "
        f"{'/'.join(str(r['arms']['default']['speedup_vs_plain']) for r in rows)}x the plain path; results "
        f"{os.path.relpath(path)}"
    )
    return 0


def gpu_table(res: dict) -> list[str]:
    """Each arm's median time and one deployment's peak GPU memory per log, and the shared prefixes' speedup over the
    plain path."""
    names = list(res["rows"][0]["arms"])
    head = ["log tokens", *(f"{arms.title('gpu', a)}: ms / peak GiB" for a in names), "shared prefixes × plain"]
    rows = [
        [r["doc_tokens"], *(f"{r['arms'][a]['wall_s'] * 1000:.0f} / {r['arms'][a]['peak_gib']:.2f}" for a in names)]
        + [f"{r['arms']['default']['speedup_vs_plain']:.2f}×"]
        for r in res["rows"]
    ]
    return report.table(head, rows)


REPORT = (gpu_table, ("rows",))
