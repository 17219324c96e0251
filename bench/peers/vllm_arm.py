"""blink on vLLM, what serves at scale, as a peer: `python app.py` with BLINK_BACKEND=vllm in the vLLM environment
(.venv-vllm, built by `bash tools/setup.sh --vllm`: vLLM pins its own torch and transformers), otherwise at blink's
defaults, answering System One bodies over HTTP. `python -m bench run` runs it beside pipeline("decision") as the arm
`blink_vllm`; `python -m bench vllm_check` compares the two backends' answers and throughput on their own.

An HTTP peer's work happens in other processes (vLLM's engine core is a process of its own), so its CPU time is that
of the server's process group, read from /proc around each request, not this process's.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING

import blink
from bench.lib import arms, servers, workloads
from bench.workers import isolated

if TYPE_CHECKING:
    from bench.peers.decision import PeerContext

VLLM_PYTHON = os.path.join(servers.ROOT, ".venv-vllm", "bin", "python")
START_S = 600  # one vLLM engine starting on a small machine, not compiled (vllm_args)
MAX_MODEL_LEN = 4096  # the decision cases' prompts are about 1,150 tokens


def missing() -> str | None:
    """Why blink on vLLM cannot run here (None when it can)."""
    if not os.path.exists(VLLM_PYTHON):
        return f"no vLLM environment at {VLLM_PYTHON} (bash tools/setup.sh --vllm builds it)"
    return None


def vllm_args(max_model_len: int) -> dict:
    """The vLLM engine arguments of every vLLM arm: a bounded context; on a CPU the engine not compiled (it starts in
    about a minute rather than three); on a GPU a share of its memory each, as two engines may share it."""
    return {
        "max_model_len": max_model_len,
        **({"gpu_memory_utilization": 0.3} if blink.cuda_available() else {"enforce_eager": True}),
    }


def vllm_env() -> dict:
    """What vLLM reads on a CPU: its KV cache size in GiB (the default takes a large share of a small machine)."""
    return {"VLLM_CPU_KVCACHE_SPACE": "1"}


def app_env(model: str, arm: arms.Arm, max_model_len: int) -> dict:
    """The BLINK_* (and vLLM) variables of one blink server: the model and the arm's settings; on vLLM its engine
    arguments too."""
    env = {"BLINK_MODEL": model, **arm.env()}
    if arm.python == "vllm":
        env.update(BLINK_VLLM_ARGS=json.dumps(vllm_args(max_model_len)), **vllm_env())
    return env


def python_of(arm: arms.Arm) -> str:
    """The python a server arm runs in."""
    return VLLM_PYTHON if arm.python == "vllm" else sys.executable


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of the live processes in a process group (Linux /proc)."""
    stats = (isolated.proc_stat(pid) for pid in filter(str.isdigit, os.listdir("/proc")))
    return sum(isolated.cpu_seconds(fields) for fields in stats if fields is not None and int(fields[2]) == pgid)


class VllmPipe:
    """One blink-on-vLLM server answering System One bodies (its answers in System One's shapes), counting the prompt
    tokens its engine computed (x_meta.prefill_tokens: those vLLM's prefix cache did not hold) and naming the dtype
    it computes in (x_meta.dtype)."""

    def __init__(self, url: str, model: str, pgid: int, http):
        self.url, self.model, self.pgid, self.http = url, model, pgid, http
        self.tokens, self.dtype = 0, None

    def __call__(self, body: dict) -> dict:
        got = self.http.post(self.url, json={"model": self.model, **body})
        got.raise_for_status()
        answered = got.json()
        self.tokens += int(answered["x_meta"]["prefill_tokens"])
        self.dtype = answered["x_meta"].get("dtype", self.dtype)
        return answered["answers"]

    def computed_tokens(self) -> int:
        """Prompt tokens the server's engine has computed so far."""
        return self.tokens

    def elsewhere_cpu(self) -> float:
        """CPU seconds the server's processes have used so far."""
        return group_cpu_seconds(self.pgid)


def start(arm: arms.Arm, ctx: PeerContext) -> VllmPipe | str:
    """A blink-on-vLLM server for the arm, up until ctx.stack closes (stopped with its engine core), or why it
    cannot run here."""
    why = missing()
    if why:
        return why
    import httpx

    env = app_env(ctx.engine.model_id, arm, MAX_MODEL_LEN)
    base = servers.bench_env(ctx.threads)
    server = ctx.stack.enter_context(servers.app(env, ctx.logs, base, python_of(arm), START_S))
    url = server.url + "v1/systemone"
    warm = workloads.system_one("warm-up", {"w": {"type": "noul"}})
    from bench.peers.decision import systemone_probe  # torch: imported where the arm starts

    why = server.down or systemone_probe(url, ctx.engine.model_id, warm)
    if why:
        return f"the server did not answer: {why}"
    http = ctx.stack.enter_context(httpx.Client(timeout=600))
    return VllmPipe(url, ctx.engine.model_id, server.proc.pid, http)
