"""blink on a CUDA GPU at a production model's size: speed and GPU memory at the GPU defaults, and what the shared
prefixes and the prefix copy budget change.

    python bench/gpu.py            # needs a CUDA device; writes bench/results/gpu.json
    python bench/gpu.py --quick    # shorter logs, one repetition

The model is a random-weight Qwen3.5 text model built here at the shape below (4.21 B parameters, Qwen3.5's
hybrid of linear- and full-attention layers, its 248,320-entry vocabulary), with the tiny test tokenizer: its
answers mean nothing, its sizes and times are those of a model this large. It is not blink-4b, whose weights and
exact shape this script does not read. Arms, each a torch engine at the defaults a GPU machine gets
(Settings.from_env: bfloat16, shared prefixes, BLINK_PREFIX_KV_TOKENS 131,072) but for what it names:
  default       the GPU defaults
  kv_32768      BLINK_PREFIX_KV_TOKENS=32768 (fewer prefix copies held at once)
  plain         BLINK_PREFIX_CACHE=0: every question runs its whole prompt
Each log gets 8 questions (six choices, a yes/no, a score). Each arm runs the request cold (kept prefixes dropped,
the template header kept by a short request), interleaved, the median of the repetitions kept, and its peak GPU
memory recorded: working_gib, what the request took beyond what was held before it (torch's allocator), and
peak_gib, that plus the arm's own weights: what one deployment of this model alone holds at its peak.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import drift  # noqa: E402
import saved  # noqa: E402
import torch  # noqa: E402
import workloads  # noqa: E402

import blink  # noqa: E402

CONFIGS = {"full": {"docs": [1000, 4000, 16000], "reps": 3}, "quick": {"docs": [1000, 4000], "reps": 1}}
SHAPE = {
    "hidden_size": 2560,
    "intermediate_size": 9216,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "vocab_size": 248320,
}


def build_model(folder: str) -> tuple[str, int]:
    """The random-weight Qwen3.5 of SHAPE saved in bfloat16 to `folder`; (folder, parameter count)."""
    import tiny_models
    from transformers import Qwen3_5ForCausalLM

    tok = tiny_models.build_tokenizer()
    config = tiny_models.text_config(tok)
    for key, value in SHAPE.items():
        setattr(config, key, value)
    config.layer_types = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(SHAPE["num_hidden_layers"])
    ]
    config.max_position_embeddings = 32768
    tok.model_max_length = 32768
    config.initializer_range = 0.02
    config.tie_word_embeddings = True
    config.rope_parameters = {**config.rope_parameters, "mrope_section": [11, 11, 10]}  # 64 rotary dims, 32 freqs
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder, params


def arms(folder: str) -> dict[str, blink.TorchEngine]:
    """The model under each arm's settings (see the module's docstring)."""
    gpu = blink.Settings.from_env({})
    return {
        "default": blink.TorchEngine(folder, settings=gpu),
        "kv_32768": blink.TorchEngine(folder, settings=replace(gpu, prefix_kv_tokens=32768)),
        "plain": blink.TorchEngine(folder, settings=replace(gpu, prefix_cache=False)),
    }


def cold(engine: blink.TorchEngine, request: blink.Request, warm: blink.Request) -> tuple[float, float, dict]:
    """One request over a log the engine has not seen: wall seconds, the GPU memory it took beyond what was held
    before it (GiB; the other arms' weights stay out of it) and the readouts."""
    engine.prefixes.clear()
    engine.forward(warm)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    readouts = engine.forward(request).readouts
    torch.cuda.synchronize()
    return time.perf_counter() - t0, (torch.cuda.max_memory_allocated() - held) / 2**30, readouts


def weights_gib(engine: blink.TorchEngine) -> float:
    """The GPU memory the engine's weights take (GiB)."""
    return sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 2**30


def measure(folder: str, targets: list[int], reps: int) -> list[dict]:
    """Every arm on each log length: median wall time, peak GPU memory, and the probability gap to the plain path."""
    engines = arms(folder)
    ref = engines["plain"]
    warm = blink.parse_request(*drift.WARM, settings=ref.settings)
    rows = []
    for target in targets:
        doc = workloads.document(ref.tok, target, seed=7)
        request = blink.parse_request(doc, drift.questions(workloads.ticket_count(doc)), settings=ref.settings)
        first = {arm: cold(engine, request, warm) for arm, engine in engines.items()}  # warms every arm too
        times: dict[str, list[float]] = {arm: [] for arm in engines}
        peaks = {arm: first[arm][1] for arm in engines}
        names = list(engines)
        for rep in range(reps):
            for arm in names[rep % len(names) :] + names[: rep % len(names)]:
                wall, peak, _ = cold(engines[arm], request, warm)
                times[arm].append(wall)
                peaks[arm] = max(peaks[arm], peak)
        prompts = ref.render(request)
        row = {
            "doc_tokens": drift.evidence_tokens(prompts[0]),
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
                "max_prob_diff_vs_plain": round(drift.compare(first["plain"][2], first[arm][2])["max_prob_diff"], 4),
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter logs, one repetition")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for the JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA device; torch sees none", file=sys.stderr)
        return 2
    mode = "quick" if args.quick else "full"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder, params = build_model(os.path.join(tmp, "qwen3.5-4b-shape"))
        saved_gib = round(sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 2**30, 2)
        rows = measure(folder, CONFIGS[mode]["docs"], CONFIGS[mode]["reps"])
    res = {
        "mode": mode,
        "command": saved.command("gpu.py", argv),
        "hardware": blink.hardware(),
        "torch": torch.__version__,
        "model": {"kind": "random-weight Qwen3.5 text model", "parameters": params, "saved_gib": saved_gib, **SHAPE},
        "defaults": {
            k: getattr(blink.Settings.from_env({}), k)
            for k in ("compute_dtype", "token_budget", "prefix_kv_tokens", "prefix_cache_mb")
        },
        "rows": rows,
        "duration_s": round(time.perf_counter() - started, 1),
        "notes": [
            "Random weights: the probability gaps say only that the arms compute the same thing; the "
            "sizes and times are those of a model of this shape.",
            "working_gib: torch.cuda.max_memory_allocated during the arm's runs less what was allocated "
            "before each; peak_gib adds the arm's own weights (the other arms' stay out).",
        ],
    }
    path = saved.write_json(os.path.join(args.out, f"gpu{'-quick' if args.quick else ''}.json"), res)
    worst_peak = max(v["peak_gib"] for r in rows for v in r["arms"].values())
    print(
        f"blink on {res['hardware']} ({params / 1e9:.2f} B-parameter Qwen3.5 shape, bfloat16): "
        f"largest peak GPU memory {worst_peak:.1f} GiB at up to {rows[-1]['doc_tokens']} tokens; shared prefixes "
        f"{'/'.join(str(r['arms']['default']['speedup_vs_plain']) for r in rows)}x the plain path; results "
        f"{os.path.relpath(path)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
