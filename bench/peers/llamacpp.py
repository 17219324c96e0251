"""llama.cpp, what a CPU user picks, as a decision peer: llama-cpp-python fed blink's exact prompt token ids, each
question's label logits read at the prompt's last position. On the stand-in it reads the stand-in's own GGUF file (the
Q4_1 weights blink's stand-in is de-quantized from); on a Qwen3.5 checkpoint folder (blink-4b's architecture: the
random-weight models of bench/lib/qwen_gguf.py, or the real one) it reads that folder converted by llama.cpp's own
converter to BF16 (runs the qwen35 architecture, its fused CPU gated-delta-net op included). Two arms per weight type:
every prompt evaluated from nothing ("llama.cpp"), and the longest common prefix with the previous prompt kept in its
KV cache, as llama-server does ("llama.cpp_reuse"; a recurrent layer's state cannot be cut back, so on Qwen3.5 the
state is saved at blink's cut points and the longest one put back, as llama-server's context checkpoints are:
LlamaReader.restored); at Q4_1 (the stand-in's own file), at Q8_0
("llama.cpp_q8_0", "llama.cpp_q8_0_reuse"), the precision of the INT8 peers, and at BF16 ("llama.cpp_bf16",
"llama.cpp_bf16_reuse"): each other type made by llama.cpp's own quantizer (llama_model_quantize) from the source
file (the stand-in's Q4_1, whose de-quantized weights are the very ones blink's stand-in loads; a checkpoint's BF16,
whose weights are its own), kept under BLINK_CACHE (gguf/). All take System One bodies like the other decision
peers (bench/peers/decision.py), and answer in blink's shapes.

Runs where `llama_cpp` imports (`bash tools/setup.sh --llama`: pip builds llama.cpp from source, for the
instructions of the CPU it builds on); otherwise its rows say why it was skipped.
"""

from __future__ import annotations

import collections
import ctypes
import importlib.util
import os
from typing import TYPE_CHECKING

import numpy as np

import blink
from bench.lib import answers, checkpoints, qwen_gguf
from bench.workers import isolated

if TYPE_CHECKING:  # the child process that computes imports this module: it needs none of these
    from bench.lib.arms import Arm
    from bench.peers.decision import PeerContext

# each arm's weights (the GGUF type) and whether it keeps the longest common prefix in its KV cache
ARMS = {
    "llama.cpp": ("q4_1", False),
    "llama.cpp_reuse": ("q4_1", True),
    "llama.cpp_q8_0": ("q8_0", False),
    "llama.cpp_q8_0_reuse": ("q8_0", True),
    "llama.cpp_bf16": ("bf16", False),
    "llama.cpp_bf16_reuse": ("bf16", True),
}
CHECKPOINTS = 8  # states a reuse arm keeps on a model whose memory cannot be cut back (llama-server keeps 8)
SKIP_CRASHED = "setup builds it without AMX (tools/llama_build.py); rebuild with bash tools/setup.sh --llama"
SKIP_MODEL = "runs on the stand-in's GGUF file or a local Qwen3.5 checkpoint folder (llama.cpp's converter) only"
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


class LlamaReader:
    """One llama.cpp context reading label logits from prompt ids; counts the tokens it evaluated. Built where it
    runs: in a child process of its own for the real library (isolated.Child), in this one for a fabricated
    llama_cpp in tests."""

    def __init__(self, gguf: str, n_ctx: int, threads: int, reuse: bool, llama_cpp=None):
        if llama_cpp is None:
            import llama_cpp
        self.llama_cpp, self.reuse = llama_cpp, reuse
        self.llm = llama_cpp.Llama(
            model_path=gguf,
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            verbose=False,
        )
        self.held: list[int] = []  # the ids whose keys and values the context holds, in order
        self.evaluated = 0
        # reuse on a model with recurrent layers, whose memory cannot be cut back (`saves`): the sequence's state
        # saved at prompts' cut points, by the ids before them, the most recent CHECKPOINTS kept (llama-server's
        # context checkpoints, there at fixed distances from a prompt's end; here where blink's prompts are cut)
        self.checkpoints: collections.OrderedDict[tuple[int, ...], object] = collections.OrderedDict()
        model = self.llm.model
        self.saves = reuse and (llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model))

    def last_logits(self):
        """The full-vocabulary logits at the last evaluated position, as float64 (a copy of llama.cpp's buffer)."""
        row = self.llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(row, shape=(self.llm.n_vocab(),)).astype(np.float64)

    def read(self, ids: list[int], cand: list[int], cuts: tuple[int, ...] = ()) -> tuple[list[float], float]:
        """One prompt's (label logits, full-vocabulary log-sum-exp): evaluated from nothing, or (reuse) from the
        longest prefix the context already holds, else from the longest checkpoint saved at one of its cut points
        `cuts` (at least its last token is evaluated, for its logits); under reuse a state is saved at every cut
        point evaluated past."""
        keep = self.kept(min(common_prefix(self.held, ids), len(ids) - 1)) if self.reuse else 0
        if self.saves:
            keep = self.restored(ids, [c for c in cuts if keep < c < len(ids)]) or keep
        self.llm.n_tokens = keep  # eval() drops the cache past n_tokens before it evaluates
        for end in [c for c in cuts if keep < c < len(ids)] if self.saves else []:
            self.llm.eval(ids[self.llm.n_tokens : end])
            self.save(ids[:end])
        self.llm.eval(ids[self.llm.n_tokens :])
        self.held = list(ids)
        self.evaluated += len(ids) - keep
        logits = self.last_logits()
        top = logits.max()
        return logits[cand].tolist(), float(top + np.log(np.exp(logits - top).sum()))

    def kept(self, keep: int) -> int:
        """The held tokens the context keeps for the next prompt: its first `keep`, its memory cut there, or none
        where llama.cpp cannot cut it there. A recurrent layer's state (Qwen3.5's Gated DeltaNet layers) goes back to
        nothing only, so on such a model a prompt that does not extend the one before it is evaluated whole, as
        llama-server evaluates it where it holds no context checkpoint within the common prefix."""
        if keep < len(self.held) and not self.llm._ctx.kv_cache_seq_rm(-1, keep, -1):
            return 0
        return keep

    def save(self, ids: list[int]) -> None:
        """The sequence's state after `ids` (what the context holds now) kept as a checkpoint."""
        lib, ctx = self.llama_cpp, self.llm._ctx.ctx
        size = lib.llama_state_seq_get_size(ctx, 0)
        state = (ctypes.c_uint8 * size)()
        lib.llama_state_seq_get_data(ctx, state, size, 0)
        self.checkpoints[tuple(ids)] = state
        while len(self.checkpoints) > CHECKPOINTS:
            self.checkpoints.popitem(last=False)

    def restored(self, ids: list[int], cuts: list[int]) -> int:
        """The longest checkpoint `ids` start with at one of the cut points `cuts` put back into the context; how many
        tokens it holds (0: none is kept, the context left as it is)."""
        for end in sorted(cuts, reverse=True):
            state = self.checkpoints.get(tuple(ids[:end]))
            if state is not None:
                self.checkpoints.move_to_end(tuple(ids[:end]))
                self.llm._ctx.kv_cache_clear()
                if self.llama_cpp.llama_state_seq_set_data(self.llm._ctx.ctx, state, len(state), 0) != len(state):
                    raise RuntimeError("llama.cpp refused a saved state")
                self.held = list(ids[:end])
                return end
        return 0

    def forget(self) -> None:
        """Nothing held: the context emptied and the checkpoints dropped (a reader that has seen no prompt)."""
        self.checkpoints.clear()
        self.held = []
        self.llm.n_tokens = 0
        self.llm._ctx.kv_cache_clear()

    def tokenize(self, text: str) -> list[int]:
        """`text` as llama.cpp's own tokenizer splits it (special tokens read as such, no BOS added)."""
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def tokens_evaluated(self) -> int:
        """Tokens evaluated so far."""
        return self.evaluated

    def system_info(self) -> str:
        """llama.cpp's system-info line: the instruction sets this build uses."""
        return self.llama_cpp.llama_print_system_info().decode()


class LlamaArm:
    """A llama.cpp peer answering System One bodies with blink's rendered prompts. Its LlamaReader computes in a
    child process of its own (isolated.Child, whose CPU time counts as the arm's), or in this one (isolated.Local)."""

    dtype = "q4_1"  # the stand-in's GGUF weights: no matmul probe of their own (held against float32's)

    def __init__(self, engine: blink.TorchEngine, reader: isolated.Child | isolated.Local, dtype: str | None = None):
        self.engine, self.reader = engine, reader
        self.dtype = dtype or self.dtype

    @property
    def evaluated(self) -> int:
        """Tokens the reader has evaluated so far."""
        return self.reader.call("tokens_evaluated")

    def computed_tokens(self) -> int:
        """Prompt tokens computed so far (those evaluated)."""
        return self.evaluated

    def elsewhere_cpu(self) -> float:
        """CPU seconds the reader's process has used, where it is a child process (0 in this one)."""
        return self.reader.cpu_seconds()

    def __call__(self, body: dict) -> dict:
        """A System One body {state, questions} answered in blink's shapes, at temperature 1."""
        request = blink.parse_request(body["state"], body["questions"], settings=self.engine.settings)
        prompts = self.engine.render(request)
        reads = [self.reader.call("read", p.ids, p.cand, tuple(p.cuts)) for p in prompts]
        readouts = blink.question_readouts(prompts, reads)
        return answers.of(request, readouts)


def context_size(engine: blink.TorchEngine) -> int:
    """llama.cpp's context length for the engine's model (capped at 32,768 tokens)."""
    return int(min(blink.context_length(engine.model.config), 32768))


def standin_gguf_as(kind: str, cache_dir: str) -> str:
    """The stand-in's GGUF file at `kind`: the shipped Q4_1 file, or one quantized from it once (in a child process,
    where llama.cpp's native code runs) and kept under cache_dir/gguf."""
    if kind == "q4_1":
        return checkpoints.standin_gguf()
    path = os.path.join(cache_dir, "gguf", blink.STANDIN_GGUF.replace("Q4_1", kind.upper()))
    return qwen_gguf.quantized(checkpoints.standin_gguf(), path, kind)


def engine_gguf(engine: blink.TorchEngine, kind: str) -> str | None:
    """The GGUF file at `kind` of the engine's weights: the stand-in's, or its Qwen3.5 checkpoint folder's (converted
    and quantized once, bench/lib/qwen_gguf.py); None for a model llama.cpp is not given here."""
    cache_dir = engine.settings.cache_dir
    if engine.model_id == blink.STANDIN_MODEL:
        return standin_gguf_as(kind, cache_dir)
    if qwen_gguf.is_qwen35(engine.source):
        return qwen_gguf.gguf_file(engine.source, kind, cache_dir)
    return None


def importable() -> bool:
    """Whether llama-cpp-python is installed here."""
    return importlib.util.find_spec("llama_cpp") is not None


def start(arm: Arm, ctx: PeerContext) -> LlamaArm | str:
    """A llama.cpp arm reading the engine's weights as GGUF at the arm's type (engine_gguf) in a child process of its
    own (stopped with ctx.stack), or why it cannot run here."""
    if not importable():
        return SKIP_NO_PACKAGE
    kind, reuse = ARMS[arm.name]
    try:
        gguf = engine_gguf(ctx.engine, kind)
    except RuntimeError as exc:  # llama.cpp's converter or quantizer refused the weights
        return str(exc)
    if gguf is None:
        return SKIP_MODEL
    try:
        reader = isolated.Child("llama.cpp", LlamaReader, gguf, context_size(ctx.engine), ctx.threads, reuse)
    except isolated.Crashed as exc:
        return f"{exc}; {SKIP_CRASHED}"
    ctx.stack.callback(reader.close)
    try:
        reader.call("read", ctx.engine.label_ids[:2], ctx.engine.label_ids[:1])  # a crashing build fails here
    except isolated.Crashed as exc:
        return f"{exc}; {SKIP_CRASHED}"
    return LlamaArm(ctx.engine, reader, kind)
