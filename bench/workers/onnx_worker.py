"""ONNX Runtime's side of bench/peers/onnxrt.py, run in its own environment (.venv-onnx: `bash tools/setup.sh
--onnx`) as `python -m bench.workers.onnx_worker THREADS` from the repository root: it exports a transformers folder
to ONNX with torch.onnx (the logits at the prompt's last position only, as llama.cpp computes them), quantizes it with
onnxruntime's `quantize_dynamic` (int8 weights, activations quantized per call: what CPU decision servers built on
ONNX Runtime ship), and answers JSON lines on stdin, one call each ({"method": ..., "args": [...]}), with one JSON
line on stdout ({"ok": true, "value": ...} or {"ok": false, "error": ...}). It imports nothing of blink's.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np

OPSET = 18


def export(folder: str, path: str) -> str:
    """The causal LM in `folder` (float32, no cache) exported to ONNX at `path`: input_ids [1, n] -> the logits at
    the last position [1, vocab]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    class LastLogits(torch.nn.Module):
        """The model's logits at the last position of one unpadded prompt."""

        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids):
            return self.lm(input_ids=input_ids, use_cache=False, logits_to_keep=1).logits[:, -1, :]

    ids = torch.randint(0, model.config.vocab_size, (1, 32))
    seq = torch.export.Dim("seq", min=2, max=8192)
    with torch.no_grad():
        torch.onnx.export(
            LastLogits(model),
            (ids,),
            path,
            input_names=["input_ids"],
            output_names=["logits"],
            dynamic_shapes={"input_ids": {1: seq}},
            opset_version=OPSET,
            dynamo=True,
            external_data=False,
        )
    return path


def quantized(folder: str, cache: str) -> str:
    """The int8 ONNX file of `folder`'s model under the folder `cache` (exported and quantized once, then reused)."""
    final = os.path.join(cache, "model.int8.onnx")
    if os.path.exists(final):
        return final
    from onnxruntime.quantization import QuantType, quantize_dynamic

    os.makedirs(cache, exist_ok=True)
    fp32 = export(folder, os.path.join(cache, f"model.float32.{os.getpid()}.onnx"))
    partial = os.path.join(cache, f"model.int8.{os.getpid()}.onnx")
    quantize_dynamic(fp32, partial, weight_type=QuantType.QInt8)
    os.remove(fp32)
    os.replace(partial, final)
    return final


class OnnxReader:
    """One ONNX Runtime session reading label logits from prompt ids, every prompt evaluated from nothing; counts the
    tokens it evaluated."""

    def __init__(self, folder: str, cache: str, threads: int):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.path = quantized(folder, cache)
        self.session = ort.InferenceSession(self.path, opts, providers=["CPUExecutionProvider"])
        self.evaluated = 0

    def read(self, ids: list[int], cand: list[int], cuts: tuple[int, ...] = ()) -> tuple[list[float], float]:
        """One prompt's (label logits, full-vocabulary log-sum-exp), run whole (its cut points are not used)."""
        logits = self.session.run(None, {"input_ids": np.asarray([ids], dtype=np.int64)})[0][0].astype(np.float64)
        self.evaluated += len(ids)
        top = logits.max()
        return logits[cand].tolist(), float(top + np.log(np.exp(logits - top).sum()))

    def tokens_evaluated(self) -> int:
        """Tokens evaluated so far."""
        return self.evaluated

    def system_info(self) -> str:
        """onnxruntime's version and the file it runs."""
        import onnxruntime as ort

        return f"onnxruntime {ort.__version__}, {os.path.basename(self.path)}"


def serve() -> None:
    """Build the reader from the first line's arguments, then answer calls until stdin closes."""
    out = sys.stdout
    sys.stdout = sys.stderr  # only replies go to the real stdout
    held = None
    for line in sys.stdin:
        call = json.loads(line)
        try:
            if held is None:
                held = OnnxReader(*call["args"])
                value = None
            else:
                value = getattr(held, call["method"])(*call["args"])
            reply = {"ok": True, "value": value}
        except Exception as exc:  # noqa: BLE001 - sent back to the parent, which raises it
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
