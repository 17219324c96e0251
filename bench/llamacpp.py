"""llama.cpp, what a CPU user picks, as a decision peer: llama-cpp-python on the stand-in's own GGUF file (the Q4_1
weights blink's stand-in is de-quantized from), fed blink's exact prompt token ids, each question's label logits read
at the prompt's last position. Two arms: every prompt evaluated from nothing ("llama.cpp"), and the longest common
prefix with the previous prompt kept in its KV cache, as llama-server does ("llama.cpp_reuse"). Both take System One
bodies like the other pipelines in bench/peers.py, and answer in blink's shapes.

Runs where `llama_cpp` imports (`bash tools/setup.sh --llama`: pip builds llama.cpp from source, for the
instructions of the CPU it builds on); otherwise its rows say why it was skipped.
"""

from __future__ import annotations

import importlib.util

import models
import numpy as np

import blink

ARMS = {"llama.cpp": False, "llama.cpp_reuse": True}  # arm: keeps the longest common prefix in its KV cache
SKIP_NO_PACKAGE = (
    "needs llama-cpp-python (bash tools/setup.sh --llama, which builds llama.cpp from source: about 5 min on 2 cores)"
)


def common_prefix(held: list[int], ids: list[int]) -> int:
    """How many leading token ids two sequences share."""
    n = 0
    for a, b in zip(held, ids):
        if a != b:
            break
        n += 1
    return n


class LlamaArm:
    """One llama.cpp context answering blink's rendered prompts; counts the tokens it evaluated."""

    def __init__(self, engine: blink.TorchEngine, gguf: str, threads: int, reuse: bool, llama_cpp=None):
        if llama_cpp is None:
            import llama_cpp
        self.llama_cpp, self.engine, self.reuse = llama_cpp, engine, reuse
        self.llm = llama_cpp.Llama(
            model_path=gguf,
            n_ctx=int(min(blink.context_length(engine.model.config), 32768)),
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            verbose=False,
        )
        self.held: list[int] = []  # the ids whose keys and values the context holds, in order
        self.evaluated = 0

    def last_logits(self):
        """The full-vocabulary logits at the last evaluated position, as float64 (a copy of llama.cpp's buffer)."""
        row = self.llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(row, shape=(self.llm.n_vocab(),)).astype(np.float64)

    def read(self, ids: list[int], cand: list[int]) -> tuple[list[float], float]:
        """One prompt's (label logits, full-vocabulary log-sum-exp): evaluated from nothing, or (reuse) from the
        longest prefix the context already holds (at least its last token is evaluated, for its logits)."""
        keep = min(common_prefix(self.held, ids), len(ids) - 1) if self.reuse else 0
        self.llm.n_tokens = keep  # eval() drops the cache past n_tokens before it evaluates
        self.llm.eval(ids[keep:])
        self.held = list(ids)
        self.evaluated += len(ids) - keep
        logits = self.last_logits()
        top = logits.max()
        return logits[cand].tolist(), float(top + np.log(np.exp(logits - top).sum()))

    def __call__(self, body: dict) -> dict:
        """A System One body {state, questions} answered in blink's shapes, at temperature 1."""
        request = blink.parse_request(body["state"], body["questions"], settings=self.engine.settings)
        prompts = self.engine.render(request)
        readouts = blink._readouts(prompts, [self.read(p.ids, p.cand) for p in prompts])
        return blink.assemble(request, readouts, {q.key: 1.0 for q in request.questions})


def pipes(engine: blink.TorchEngine, threads: int) -> tuple[dict, list[dict]]:
    """The llama.cpp arms for bench/peers.py's decision cases, or none and a row saying why they cannot run here."""
    if importlib.util.find_spec("llama_cpp") is None:
        return {}, [{"target": "llama.cpp", "skipped": SKIP_NO_PACKAGE}]
    if engine.model_id != blink.STANDIN_MODEL:
        return {}, [{"target": "llama.cpp", "skipped": "runs on the stand-in's GGUF file only"}]
    gguf = models.standin_gguf()
    return {name: LlamaArm(engine, gguf, threads, reuse) for name, reuse in ARMS.items()}, []
