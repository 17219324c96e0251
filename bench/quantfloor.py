"""How far 8-bit schemes move the stand-in's answers from float32's: blink's int8 and bfloat16, and simulated schemes.

    python -m bench quantfloor           # the stand-in over drift's logs (100, 1,000, 3,800 and 7,000 tokens)
    python -m bench quantfloor --quick   # the 100 and 1,000-token logs

Each arm answers drift's 8 questions (bench/drift.py) over drift's ticket logs, and is compared with float32 on
torch's own kernels as drift compares them (bench/answers.py): the largest probability difference and the picks that
differ. Two arms are blink's own engines, loaded by its loading code:
  bfloat16           blink's CPU default (BLINK_DTYPE=bfloat16)
  int8               BLINK_QUANTIZE=int8 in bfloat16 (weights int8 per output channel, activations bfloat16)
The others are simulated: the float32 engine with every linear layer's input and weight rounded ("fake
quantization": each value replaced by its nearest representable one, the product then taken in float32), to say
where the error comes from and what a finer 8-bit scheme would reach:
  act_bfloat16       the layers' inputs rounded to bfloat16, the weights exact (bfloat16's activations alone)
  w8_channel         the weights int8 per output channel (int8's weights alone), the inputs exact
  w8_group32         the weights int8 per 32 input values, the inputs exact (the finest weights at 8 bits here)
  w8a8_token         the weights per output channel and the inputs per token (dynamic int8, as torch._int_mm
                     or ONNX Runtime's per-call quantization would run it, at a finer scale than per tensor)
  q8_0               weights and inputs int8 per 32 values (llama.cpp's Q8_0 blocks, both operands)
Symmetric rounding, scale = the group's largest magnitude / 127. Every arm's kept prefixes are dropped before each
request. Writes bench/results/quantfloor.json (quantfloor-quick.json with --quick); the last line is a summary.
"""

from __future__ import annotations

import os
import types
from dataclasses import replace

import blink
from bench import answers, drift, harness, workloads

CONFIGS = {"full": [100, 1000, 3800, 7000], "quick": [100, 1000]}
# Simulated schemes: (weight grouping, input grouping); a grouping is "channel" (the weight's output rows),
# "token" (the input's rows), a group size along the reduced dimension, "bfloat16", or None (exact).
SIMULATED = {
    "act_bfloat16": (None, "bfloat16"),
    "w8_channel": ("channel", None),
    "w8_group32": (32, None),
    "w8a8_token": ("channel", "token"),
    "q8_0": (32, 32),
}
BOUND = 0.03  # the drift bound the bfloat16 default is held to (docs/configuration.md)


def rounded(t, grouping):
    """t with each value replaced by its nearest one in the scheme: int8 over groups (symmetric, max/127), or
    bfloat16; t itself where grouping is None."""
    import torch

    if grouping is None:
        return t
    if grouping == "bfloat16":
        return t.to(torch.bfloat16).float()
    rows = t.unsqueeze(-2) if grouping in ("channel", "token") else t.reshape(*t.shape[:-1], -1, grouping)
    scale = rows.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return (torch.round(rows / scale).clamp(-127, 127) * scale).reshape(t.shape)


def simulate(model, exact: dict, weights, inputs) -> None:
    """Every linear layer of `model` but lm_head made to run the scheme: its weight rounded from `exact` (name ->
    float32 weight), its input rounded at each call."""
    import torch

    def forward(self, x):
        return torch.nn.functional.linear(rounded(x.float(), inputs), self.weight, self.bias)

    for name, layer in linear_layers(model):
        layer.weight.data = rounded(exact[name], weights)
        layer.forward = types.MethodType(forward, layer)


def linear_layers(model) -> list:
    """(name, layer) for every nn.Linear of the model but lm_head."""
    import torch

    head = model.get_output_embeddings()
    return [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear and m is not head]


def answered(engine: blink.TorchEngine, request: blink.Request) -> dict:
    """The engine's answers to the request with nothing kept from an earlier one (its prefixes dropped)."""
    engine.prefixes.clear()
    return answers.of(request, engine.forward(request).readouts)


def main(argv: list[str] | None = None) -> int:
    """Measure every arm against float32 on each log, write JSON, print one summary line last."""
    run = harness.Run("quantfloor", argv, __doc__, threads="2")
    targets = CONFIGS["quick" if run.quick else "full"]
    base = blink.Settings(prefix_min_tokens=256)
    reference = blink.TorchEngine(blink.STANDIN_MODEL, settings=replace(base, dtype="float32", cpu_matmul="torch"))
    shipped = {
        "bfloat16": blink.TorchEngine(blink.STANDIN_MODEL, settings=replace(base, dtype="bfloat16")),
        "int8": blink.TorchEngine(blink.STANDIN_MODEL, settings=replace(base, quantize="int8", dtype="bfloat16")),
    }
    sim = blink.TorchEngine(blink.STANDIN_MODEL, settings=reference.settings)
    exact = {name: layer.weight.detach().clone() for name, layer in linear_layers(sim.model)}
    rows = []
    for target in targets:
        doc = workloads.document(reference.tok, target, seed=7)
        request = blink.parse_request(doc, drift.questions(workloads.ticket_count(doc)), settings=base)
        ref = answered(reference, request)
        row = {"doc_tokens": drift.evidence_tokens(reference.render(request)[0]), "arms": {}}
        for arm, engine in shipped.items():
            row["arms"][arm] = answers.compare(ref, answered(engine, request))
        for arm, (weights, inputs) in SIMULATED.items():
            simulate(sim.model, exact, weights, inputs)
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
        "simulated": {arm: {"weights": w, "inputs": i} for arm, (w, i) in SIMULATED.items()},
        "rows": rows,
        "worst": worst,
    }
    path = run.write(res)
    print(
        f"largest probability difference from float32 over {len(rows)} logs on {blink.hardware()} (bound {BOUND}): "
        + ", ".join(f"{arm} {v:.4f}" for arm, v in worst.items())
        + f"; results {os.path.relpath(path)}"
    )
    return 0
