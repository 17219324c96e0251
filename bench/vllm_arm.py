"""blink on vLLM, what serves at scale, as a peer: `python app.py` with BLINK_BACKEND=vllm in the vLLM environment
(.venv-vllm, built by `bash tools/setup.sh --vllm`: vLLM pins its own torch and transformers), otherwise at blink's
defaults, answering System One bodies over HTTP. bench/run.py --decision runs it beside pipeline("decision") as the
arm `blink_vllm`; bench/vllm_check.py compares the two backends' answers and throughput on their own.

An HTTP peer's work happens in other processes (vLLM's engine core is a process of its own), so its CPU time is that
of the server's process group, read from /proc around each request, not this process's.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import isolated
import peers
import throughput

import blink

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")
NAME = "blink_vllm"
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


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of the live processes in a process group (Linux /proc)."""
    stats = (isolated.proc_stat(pid) for pid in filter(str.isdigit, os.listdir("/proc")))
    return sum(isolated.cpu_seconds(fields) for fields in stats if fields is not None and int(fields[2]) == pgid)


def with_probabilities(answer: dict) -> dict:
    """A System One answer with its distribution under "probabilities", as blink's own answers have it (a noul's
    reply carries p(yes) alone)."""
    if answer.get("type") == "noul" and "probabilities" not in answer:
        return {**answer, "probabilities": {"yes": answer["noul"], "no": 1.0 - answer["noul"]}}
    return answer


class VllmPipe:
    """One blink-on-vLLM server answering System One bodies in blink's answer shapes."""

    def __init__(self, url: str, model: str, pgid: int, http):
        self.url, self.model, self.pgid, self.http = url, model, pgid, http

    def __call__(self, body: dict) -> dict:
        got = self.http.post(self.url, json={"model": self.model, **body})
        got.raise_for_status()
        return {key: with_probabilities(a) for key, a in got.json()["answers"].items()}

    def elsewhere_cpu(self) -> float:
        """CPU seconds the server's processes have used so far."""
        return group_cpu_seconds(self.pgid)


@contextlib.contextmanager
def pipes(model: str, threads: int, logs: str) -> Iterator[tuple[dict, list[dict]]]:
    """({NAME: VllmPipe}, []) while a blink-on-vLLM server runs, or ({}, [a row saying why it cannot]); the server
    is stopped, with its engine core, on leaving."""
    why = missing()
    if why:
        yield {}, [{"target": "blink on vLLM", "skipped": why}]
        return
    import httpx

    port = throughput.free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        "GRADIO_SERVER_NAME": "127.0.0.1",
        "GRADIO_SERVER_PORT": str(port),
        "BLINK_MODEL": model,
        "BLINK_BACKEND": "vllm",
        "BLINK_VLLM_ARGS": json.dumps(vllm_args(MAX_MODEL_LEN)),
        **vllm_env(),
    }
    with peers.process(
        [VLLM_PYTHON, os.path.join(ROOT, "app.py")], threads, os.path.join(logs, "blink-vllm.log"), env
    ) as proc:
        why = peers.wait_up(base + "/", proc, START_S) or peers.systemone_probe(
            base + "/v1/systemone", model, peers.system_one("warm-up", {"w": {"type": "noul"}})
        )
        if why:
            yield {}, [{"target": "blink on vLLM", "skipped": f"the server did not answer: {why}"}]
            return
        with httpx.Client(timeout=600) as http:
            yield {NAME: VllmPipe(base + "/v1/systemone", model, proc.pid, http)}, []
