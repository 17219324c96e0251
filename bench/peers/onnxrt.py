"""ONNX Runtime INT8, what CPU decision servers built on ONNX Runtime ship, as a decision peer: the stand-in exported
with torch.onnx and quantized with onnxruntime's `quantize_dynamic` (bench/workers/onnx_worker.py), run by onnxruntime
at the run's threads, fed blink's exact prompt token ids, each question's label logits read at the prompt's last
position; every prompt evaluated from nothing (the exported graph keeps no cache). It answers System One bodies in
blink's shapes, as the llama.cpp arm does (bench/peers/llamacpp.py).

onnxruntime and the exporter live in an environment of their own (.venv-onnx, `bash tools/setup.sh --onnx`: they pin
onnx, onnxscript and the exporter's torch); the arm drives it as a worker process there, whose CPU time counts as the
arm's. The exported file is kept under BLINK_CACHE (onnx/); the first run exports it (about a minute).
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import TYPE_CHECKING

import blink
from bench.lib import servers
from bench.peers import llamacpp
from bench.workers import isolated

if TYPE_CHECKING:
    from bench.lib.arms import Arm
    from bench.peers.decision import PeerContext

ONNX_PYTHON = os.path.join(servers.ROOT, ".venv-onnx", "bin", "python")
SKIP_NO_ENV = f"no ONNX Runtime environment at {ONNX_PYTHON} (bash tools/setup.sh --onnx builds it)"


class Worker:
    """bench/workers/onnx_worker.py in .venv-onnx, its reader built from `args`; `call(method, *args)` as
    isolated.Child's."""

    library = "onnxruntime"

    def __init__(self, *args, python: str = ONNX_PYTHON):
        self.process = subprocess.Popen(
            [python, "-m", "bench.workers.onnx_worker"],
            cwd=servers.ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.call("build", *args)

    def call(self, method: str, *args):
        """Run `method(*args)` on the worker's reader; its result."""
        try:
            self.process.stdin.write(json.dumps({"method": method, "args": list(args)}) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except (BrokenPipeError, ConnectionResetError):
            line = ""
        if not line:
            self.process.wait(timeout=30)
            raise isolated.Crashed(f"onnxruntime died in its worker: {isolated.exit_reason(-self.process.returncode)}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"onnxruntime failed in its worker: {reply['error']}")
        return reply["value"]

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the worker has used so far."""
        return isolated.cpu_seconds(isolated.proc_stat(self.process.pid))

    def close(self) -> None:
        """End the worker: close its stdin, then wait for it (killed if it does not end)."""
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class OnnxArm(llamacpp.LlamaArm):
    """An ONNX Runtime INT8 peer answering System One bodies with blink's rendered prompts (LlamaArm's readout)."""

    dtype = "int8"  # quantize_dynamic's weights; no matmul probe of its own (held against float32's)


def cache_folder(engine: blink.TorchEngine) -> str:
    """Where the engine's model's exported ONNX files are kept (under BLINK_CACHE)."""
    folder = blink.model_source(engine.model_id, engine.settings.cache_dir)
    return os.path.join(engine.settings.cache_dir, "onnx", os.path.basename(os.path.normpath(folder)))


def start(arm: Arm, ctx: PeerContext) -> OnnxArm | str:
    """An ONNX Runtime INT8 arm in its worker process (stopped with ctx.stack), or why it cannot run here."""
    if not os.path.exists(ONNX_PYTHON):
        return SKIP_NO_ENV
    folder = blink.model_source(ctx.engine.model_id, ctx.engine.settings.cache_dir)
    worker = Worker(folder, cache_folder(ctx.engine), ctx.threads)
    ctx.stack.callback(worker.close)
    return OnnxArm(ctx.engine, worker)
