"""Precision by measurement: bfloat16 and int8 against float32, for speed and for how far they move the answers.

    python -m bench drift            # the stand-in (100, 1,000, 3,800 and 7,000-token logs), a tiny Qwen3.5 (to 18,000)
    python -m bench drift --quick    # shorter logs, one repetition, a few minutes
    python -m bench drift --schemes --threads 2   # which 8 bits: blink's int8 and bfloat16 and simulated schemes

Arms (the registry's "drift" arms, bench/lib/arms.py), each a torch engine at blink's defaults but for what it names:
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
repetitions kept. Answers are compared as every benchmark compares them (bench/lib/answers.py). Writes
bench/results/drift.json (drift-quick.json with --quick); the last line is a summary.

--schemes: how far 8-bit schemes move the stand-in's answers from float32's. Each arm answers the same 8 questions
over the stand-in's logs and is compared with float32 on torch's own kernels as above: the largest probability
difference and the picks that differ. Four arms are blink's own engines, loaded by its loading code:
  bfloat16           blink's CPU default (BLINK_DTYPE=bfloat16)
  int8               BLINK_QUANTIZE=int8 in bfloat16 (weights int8 per output channel, activations bfloat16)
  w8a8_prefix        BLINK_QUANTIZE=w8a8-prefix (float32): the evidence's encode in 8-bit products on fbgemm, the
                     template header and the questions' tails in float32
  w8a8_prefix_bfloat16  the same with BLINK_DTYPE=bfloat16: the header and the tails in bfloat16
The others are simulated: the float32 engine with every linear layer's input and weight rounded ("fake
quantization": each value replaced by its nearest representable one, the product then taken in float32), to say
where the error comes from and what a finer 8-bit scheme would reach:
  act_bfloat16       the layers' inputs rounded to bfloat16, the weights exact (bfloat16's activations alone)
  w8_channel         the weights int8 per output channel (int8's weights alone), the inputs exact
  w8_group32         the weights int8 per 32 input values, the inputs exact (the finest weights at 8 bits here)
  w8a8_token         the weights per output channel and the inputs per token (dynamic int8, as torch._int_mm
                     or ONNX Runtime's per-call quantization would run it, at a finer scale than per tensor)
  w8a8_smooth65_exact_down  per token as above, smoothed (SmoothQuant, alpha 0.65), down_proj kept exact
  fbgemm_token       not simulated: fbgemm's int8 product itself (torch.ops.quantized.linear_dynamic), inputs per
                     token (rows scaled to max 1) at the 7 bits of its reduce_range (8-bit inputs can saturate the
                     int16 sums of AVX2's u8 x s8 instruction, vpmaddubsw)
  fbgemm_smooth65_exact_down  the same, smoothed and down_proj kept exact as above
  w7a8_smooth65_exact_down, w8a7_smooth65_exact_down  the smoothed scheme above with the weights, or the inputs, at 7
                     bits (63 levels a side): the bit AVX2's 16-bit sums cost one operand or the other
  fbgemm8_token, fbgemm8_smooth65_exact_down  fbgemm's product with 8-bit inputs beside 7-bit weights (its sums cannot
                     saturate that way either)
  q8_0               weights and inputs int8 per 32 values (llama.cpp's Q8_0 blocks, both operands)
Symmetric rounding, scale = the group's largest magnitude / 127. Every arm's kept prefixes are dropped before each
request. The logs are drift's four on the stand-in (two with --quick; `--logs 100,1000` asks logs of those lengths).
`--only a,b` runs those arms alone. Then one product at blink-4b's MLP shape is timed in float32, bfloat16 and on
fbgemm's int8 path. Writes bench/results/quantfloor.json (`--name` names another; NAME-quick.json with --quick; the
committed quantfloor.json was written by `python -m bench quantfloor`, as this was called before it joined drift);
the last line is a summary.
"""

from __future__ import annotations

import os
import tempfile
import types
import warnings
from dataclasses import replace

import blink
from bench.lib import answers, arms, checkpoints, cold, harness, report, workloads

CONFIGS = {
    "full": {"standin": [100, 1000, 3800, 7000], "tiny": [100, 1000, 18000], "reps": 3},
    "quick": {"standin": [100, 1000], "tiny": [100, 2000], "reps": 1},
}
REFERENCE = "float32"
UNTIMED = ("bfloat16_plain",)  # run for its drift only: the plain path over long logs is slow and not a default


def measure(name: str, model: str, targets: list[int], reps: int) -> list[dict]:
    """Every arm on each document length of one model: drift from float32 and time against it."""
    engines = arms.engines("drift", model, blink.Settings(prefix_min_tokens=256))
    ref = engines[REFERENCE]
    warm = blink.parse_request(*cold.WARM, settings=ref.settings)
    rows = []
    for target in targets:
        doc = workloads.document(ref.tok, target, seed=7)
        request = blink.parse_request(doc, cold.questions(workloads.ticket_count(doc)), settings=ref.settings)
        prompt = ref.render(request)[0]
        first = {arm: cold.cold_run(engine, request, warm).answers for arm, engine in engines.items()}  # warms each arm
        timed = [arm for arm in engines if arm not in UNTIMED]
        best: dict[str, list[float]] = {arm: [float("inf"), float("inf")] for arm in timed}
        for rep in range(reps):
            for arm in timed[rep % len(timed) :] + timed[: rep % len(timed)]:
                got = cold.cold_run(engines[arm], request, warm)
                best[arm] = [min(best[arm][0], got.wall_s), min(best[arm][1], got.cpu_s)]
        row = {
            "model": name,
            "doc_tokens": cold.evidence_tokens(prompt),
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


# Simulated schemes: (weight grouping, input grouping, smoothing, layers kept exact); a grouping is "channel" (the
# weight's output rows), "token" (the input's rows), either at 7 bits ("channel7", "token7"), a group size along the
# reduced dimension, "bfloat16", "fbgemm"/"fbgemm8" (inputs to fbgemm's product at 7 or 8 bits), or None (exact).
# Smoothing alpha (SmoothQuant, Xiao et al. 2023): each input channel j divided by s_j = max|x_j|^alpha /
# max|W_j|^(1 - alpha) and the weight's column j multiplied by it, max|x_j| read on a calibration log that is not
# one of the logs measured; None: no smoothing. Layers kept exact: those whose name holds one of the strings.
SHIPPED = {  # blink's own engines, by their settings
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantize": "int8", "dtype": "bfloat16"},
    "w8a8_prefix": {"quantize": "w8a8-prefix"},
    "w8a8_prefix_bfloat16": {"quantize": "w8a8-prefix", "dtype": "bfloat16"},
}
SIMULATED = {
    "act_bfloat16": (None, "bfloat16", None, ()),
    "w8_channel": ("channel", None, None, ()),
    "w8_group32": (32, None, None, ()),
    "w8a8_token": ("channel", "token", None, ()),
    "w8a8_smooth": ("channel", "token", 0.5, ()),
    "w8a8_smooth_exact_down": ("channel", "token", 0.5, ("down_proj",)),
    "w8a8_smooth65_exact_down": ("channel", "token", 0.65, ("down_proj",)),
    "fbgemm_token": ("channel", "fbgemm", None, ()),
    "fbgemm_smooth65_exact_down": ("channel", "fbgemm", 0.65, ("down_proj",)),
    "w7a8_smooth65_exact_down": ("channel7", "token", 0.65, ("down_proj",)),
    "w8a7_smooth65_exact_down": ("channel", "token7", 0.65, ("down_proj",)),
    "fbgemm8_token": ("channel7", "fbgemm8", None, ()),
    "fbgemm8_smooth65_exact_down": ("channel7", "fbgemm8", 0.65, ("down_proj",)),
    "q8_0": (32, 32, None, ()),
}
CALIBRATION_TOKENS = 1500  # the calibration log's length (seed 99: none of the measured logs)
SCHEME_LOGS = {"full": [100, 1000, 3800, 7000], "quick": [100, 1000]}
BOUND = 0.03  # the drift bound the bfloat16 default is held to (docs/configuration.md)


def rounded(t, grouping):
    """t with each value replaced by its nearest one in the scheme: int8 over groups (symmetric, max/127), or
    bfloat16; t itself where grouping is None."""
    import torch

    if grouping is None:
        return t
    if grouping == "bfloat16":
        return t.to(torch.bfloat16).float()
    levels = 63 if grouping in ("channel7", "token7") else 127
    rows = (
        t.unsqueeze(-2)
        if grouping in ("channel", "channel7", "token", "token7")
        else t.reshape(*t.shape[:-1], -1, grouping)
    )
    scale = rows.abs().amax(-1, keepdim=True).clamp(min=1e-12) / levels
    return (torch.round(rows / scale).clamp(-levels, levels) * scale).reshape(t.shape)


def fbgemm_forward(self, x):
    """The layer on fbgemm's dynamic int8 product (torch.ops.quantized.linear_dynamic), each row scaled to max |x| = 1
    and a row of +1 and -1 appended, so every row gets the same grid whatever rows share the call: per-token scales
    out of a per-tensor kernel. AVX2's u8 x s8 instruction sums pairs in 16 bits: 7-bit inputs beside 8-bit weights
    (fbgemm's reduce_range) or 8-bit inputs beside 7-bit weights cannot saturate them (`self.reduce_range`)."""
    import torch

    rows = (x.float() / self.smoothing).reshape(-1, x.shape[-1])
    scale = rows.abs().amax(-1, keepdim=True).clamp(min=1e-12)
    grid = torch.cat([rows / scale, self.grid_row])
    out = torch.ops.quantized.linear_dynamic(grid, self.packed, self.reduce_range)[:-1] * scale
    out = out.reshape(*x.shape[:-1], -1)
    return out if self.bias is None else out + self.bias


def fbgemm_pack(layer, weight, input_bits: int = 7) -> None:
    """`weight` int8 per output channel (symmetric, max/127; max/63 beside 8-bit inputs), packed for fbgemm on
    `layer`."""
    import torch

    torch.backends.quantized.engine = "fbgemm"
    layer.reduce_range = input_bits == 7
    scale = weight.abs().amax(1).clamp(min=1e-12).double() / (127 if layer.reduce_range else 63)
    with warnings.catch_warnings():  # torch's quantized tensors are deprecated in favour of torchao; still shipped
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(weight, scale, torch.zeros(len(scale), dtype=torch.long), 0, torch.qint8)
        layer.packed = torch.ops.quantized.linear_prepack(q, None)
    layer.grid_row = torch.zeros(1, weight.shape[1])
    layer.grid_row[0, :2] = torch.tensor([1.0, -1.0])


def simulate(model, exact: dict, scheme: tuple, input_max: dict) -> None:
    """Every linear layer of `model` but lm_head made to run the scheme (SIMULATED): its weight rounded from `exact`
    (name -> float32 weight), smoothed by `input_max` (name -> each input channel's largest magnitude) where the
    scheme says, its input rounded at each call; a layer the scheme keeps exact runs its float32 weight."""
    import torch

    weights, inputs, alpha, kept = scheme

    def forward(self, x):
        return torch.nn.functional.linear(rounded(x.float() / self.smoothing, inputs), self.weight, self.bias)

    def plain(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)

    for name, layer in linear_layers(model):
        exact_layer = any(part in name for part in kept)
        smoothing = torch.ones(exact[name].shape[1])
        if alpha is not None and not exact_layer:
            column_max = exact[name].abs().amax(0).clamp(min=1e-5)
            smoothing = input_max[name].clamp(min=1e-5) ** alpha / column_max ** (1 - alpha)
        layer.smoothing = smoothing
        if exact_layer:
            layer.weight.data = exact[name]
            layer.forward = types.MethodType(plain, layer)
        elif inputs in ("fbgemm", "fbgemm8"):
            fbgemm_pack(layer, exact[name] * smoothing, 8 if inputs == "fbgemm8" else 7)
            layer.forward = types.MethodType(fbgemm_forward, layer)
        else:
            layer.weight.data = rounded(exact[name] * smoothing, weights)
            layer.forward = types.MethodType(forward, layer)


KERNEL_SHAPE = (512, 2560, 9216)  # rows x in x out: blink-4b's MLP up projection over a 512-token chunk


def kernel_rates(reps: int = 3) -> dict:
    """GFLOP/s of one product at KERNEL_SHAPE in float32, bfloat16 and on fbgemm's int8 path as fbgemm_forward runs
    it (the row scaling included): the best of `reps` rounds, the products taking turns after a warm-up call each
    (blink.interleaved_seconds, as blink measures its kernels)."""
    import torch

    rows, width, out = KERNEL_SHAPE
    x, weight = torch.randn(rows, width), torch.randn(out, width) * 0.02
    layer = types.SimpleNamespace(smoothing=torch.ones(width), bias=None)
    fbgemm_pack(layer, weight)
    x16, w16 = x.bfloat16(), weight.bfloat16()
    products = {
        "float32": lambda: torch.nn.functional.linear(x, weight),
        "bfloat16": lambda: torch.nn.functional.linear(x16, w16),
        "fbgemm_int8": lambda: fbgemm_forward(layer, x),
    }
    rounds = blink.interleaved_seconds(products, reps, calls=1)
    return {name: round(2 * rows * width * out / min(seconds) / 1e9, 1) for name, seconds in rounds.items()}


def input_maxima(engine: blink.TorchEngine, settings: blink.Settings) -> dict:
    """Each linear layer's largest input magnitude per channel over a calibration log (CALIBRATION_TOKENS, seed 99)
    asked the eight questions, on the engine's model as it is (blink.input_maxima, by layer name)."""
    names, layers = zip(*linear_layers(engine.model))
    doc = workloads.document(engine.tok, CALIBRATION_TOKENS, seed=99)
    request = blink.parse_request(doc, cold.questions(workloads.ticket_count(doc)), settings=settings)
    maxima = blink.input_maxima(list(layers), lambda: answered(engine, request))
    return {name: seen for name, seen in zip(names, maxima) if seen is not None}


def linear_layers(model) -> list:
    """(name, layer) for every nn.Linear of the model but lm_head."""
    import torch

    head = model.get_output_embeddings()
    return [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear and m is not head]


def answered(engine: blink.TorchEngine, request: blink.Request) -> dict:
    """The engine's answers to the request with nothing kept from an earlier one (its prefixes dropped)."""
    engine.prefixes.clear()
    return answers.of(request, engine.forward(request).readouts)


def schemes(run: harness.Run) -> int:
    """--schemes: every scheme against float32 on each log; write quantfloor.json, print one summary line last."""
    targets = run.args.logs or SCHEME_LOGS["quick" if run.quick else "full"]
    base = blink.Settings(prefix_min_tokens=256)
    reference = blink.TorchEngine(blink.STANDIN_MODEL, settings=replace(base, dtype="float32", cpu_matmul="torch"))
    only = run.args.only or [*SHIPPED, *SIMULATED]
    shipped = {
        arm: blink.TorchEngine(blink.STANDIN_MODEL, settings=replace(base, **SHIPPED[arm]))
        for arm in SHIPPED
        if arm in only
    }
    simulated = {arm: scheme for arm, scheme in SIMULATED.items() if arm in only}
    sim = blink.TorchEngine(blink.STANDIN_MODEL, settings=reference.settings)
    exact = {name: layer.weight.detach().clone() for name, layer in linear_layers(sim.model)}
    input_max = input_maxima(sim, base)
    rows = []
    for target in targets:
        doc = workloads.document(reference.tok, target, seed=7)
        request = blink.parse_request(doc, cold.questions(workloads.ticket_count(doc)), settings=base)
        ref = answered(reference, request)
        row = {"doc_tokens": cold.evidence_tokens(reference.render(request)[0]), "arms": {}}
        for arm, engine in shipped.items():
            row["arms"][arm] = answers.compare(ref, answered(engine, request))
        for arm, scheme in simulated.items():
            simulate(sim.model, exact, scheme, input_max)
            row["arms"][arm] = answers.compare(ref, answered(sim, request))
        rows.append(row)
        print(
            f"{row['doc_tokens']:>6} tok: "
            + "; ".join(f"{a} {v['max_prob_diff']:.4f}" for a, v in row["arms"].items()),
            flush=True,
        )
    worst = {arm: max(r["arms"][arm]["max_prob_diff"] for r in rows) for arm in rows[0]["arms"]}
    res = {
        "model": "stand-in",
        "reference": "float32 on torch's own kernels",
        "bound": BOUND,
        "simulated": {
            arm: {"weights": w, "inputs": i, "smoothing_alpha": a, "kept_exact": list(k)}
            for arm, (w, i, a, k) in simulated.items()
        },
        "rows": rows,
        "worst": worst,
    }
    res["kernel_shape"], res["kernel_gflops"] = list(KERNEL_SHAPE), kernel_rates()
    path = run.write(res, stem=run.args.name)
    print(
        f"largest probability difference from float32 over {len(rows)} logs on {blink.hardware()} (bound {BOUND}): "
        + ", ".join(f"{arm} {v:.4f}" for arm, v in worst.items())
        + "; products at "
        + "x".join(map(str, KERNEL_SHAPE))
        + ": "
        + ", ".join(f"{k} {v} GFLOP/s" for k, v in res["kernel_gflops"].items())
        + f"; results {os.path.relpath(path)}"
    )
    return 0


def flags(parser) -> None:
    """drift's own flags."""
    parser.add_argument("--reps", type=int, help="default 3, quick 1")
    parser.add_argument("--schemes", action="store_true", help="8-bit schemes against float32 (quantfloor.json)")
    parser.add_argument(
        "--logs", type=lambda s: [int(n) for n in s.split(",")], help="--schemes: the logs' lengths (tokens, a,b,...)"
    )
    parser.add_argument(
        "--only", type=lambda s: s.split(","), help="--schemes: these arms alone (names, a,b,...; default all)"
    )
    parser.add_argument("--name", default="quantfloor", help="--schemes: the results file's name (default quantfloor)")


def main(argv: list[str] | None = None) -> int:
    """Measure, write JSON, print one summary line last."""
    run = harness.Run("drift", argv, __doc__, flags)
    if run.args.schemes:
        return schemes(run)
    cfg = CONFIGS["quick" if run.quick else "full"]
    reps = run.args.reps or cfg["reps"]
    run.probe()
    rows = measure("stand-in", blink.STANDIN_MODEL, cfg["standin"], reps)
    with tempfile.TemporaryDirectory() as tmp:
        rows += measure(
            "qwen3.5-tiny", checkpoints.tiny_qwen(os.path.join(tmp, "tiny"), max(cfg["tiny"]) + 2048), cfg["tiny"], reps
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
    print(drift_summary(run.written, path))
    return 0


DRIFT_MODELS = {"stand-in": "stand-in", "qwen3.5-tiny": "tiny Qwen3.5 (linear + full attention)"}


def drift_table(res: dict) -> list[str]:
    """Each arm against float32 on torch's kernels, per model and document: the largest probability difference, the
    picks that differ, and its speed (CPU time) against float32's."""
    names = [a for a in res["rows"][0]["arms"] if a != "float32"]
    head = ["model", "evidence tokens", "float32 CPU s"]
    head += [f"{a}: × float32 / largest probability difference / picks that differ" for a in names]
    rows = []
    for r in res["rows"]:
        cells = [DRIFT_MODELS.get(r["model"], r["model"]), r["doc_tokens"], f"{r['arms']['float32']['cpu_s']:.2f}"]
        for a in names:
            v = r["arms"][a]
            speed = f"{v['speedup_cpu']:.2f}×" if "speedup_cpu" in v else "untimed"
            cells.append(f"{speed} / {v['max_prob_diff']:.4f} / {len(v['picks_differ'])} of {r['questions']}")
        rows.append(cells)
    return report.table(head, rows)


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


def schemes_table(res: dict) -> list[str]:
    """--schemes: each arm's largest probability difference from float32 and its picks that differ, per
    log, and its worst against the bound."""
    arms = list(res["rows"][0]["arms"])
    head = ["arm", *(f"{r['doc_tokens']}-token log" for r in res["rows"]), f"largest (bound {res['bound']})"]
    rows = [
        [arm]
        + [f"{r['arms'][arm]['max_prob_diff']:.4f} ({len(r['arms'][arm]['picks_differ'])})" for r in res["rows"]]
        + [f"{res['worst'][arm]:.4f} {'within' if res['worst'][arm] <= res['bound'] else 'over'}"]
        for arm in arms
    ]
    lines = report.table(head, rows) + ["", "Each cell: the largest probability difference (the picks that differ)."]
    if "kernel_gflops" in res:
        shape = "x".join(map(str, res["kernel_shape"]))
        rates = ", ".join(f"{k} {v}" for k, v in res["kernel_gflops"].items())
        lines.append(f"One product at {shape} (rows x in x out), GFLOP/s: {rates}.")
    return lines


def drift_report(res: dict) -> list[str]:
    """drift's table, or --schemes' (a file with a bound)."""
    return schemes_table(res) if "bound" in res else drift_table(res)


REPORT = (drift_report, ("rows",))
