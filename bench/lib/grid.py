"""The ways of getting a choice out of a causal LM that the benchmark runs side by side, on one loaded model.

blink (plain and shared-prefix) answers a whole request at once. The peers answer one question at a time, as their
users write them: one forward per question reading the label logits by hand, per-option continuation
log-likelihood (lm-evaluation-harness multiple choice, SGLang `select`), and generate-then-parse.
"""

from __future__ import annotations

import math
import os
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

import blink
from bench.lib import answers, harness


@dataclass
class Measured:
    """What one arm did on one question or one request."""

    wall_s: float
    cpu_s: float  # this process's CPU time, which waiting for a core does not inflate
    prefill_tokens: int
    choices: dict[str, str | None]  # question -> option key (None: the output named no offered option)
    peak_mb: float
    rows: dict[str, list[float]] = field(default_factory=dict)  # label logits, where the arm reads them
    extra: dict = field(default_factory=dict)


class PeakMemory:
    """Peak memory above the level at entry: CUDA allocator peak on a GPU, resident set size (sampled) on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.peak_mb = 0.0
        self._stop = threading.Event()

    @staticmethod
    def _rss() -> int:
        """Resident bytes of this process."""
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        """Poll the resident set size until stopped."""
        while not self._stop.wait(0.005):
            self._top = max(self._top, self._rss())

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.synchronize()
            self._base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            self._base = self._top = self._rss()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            top = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
            top = max(self._top, self._rss())
        self.peak_mb = max(0.0, (top - self._base) / 2**20)


_USER_MODELS: dict[int, torch.nn.Module] = {}


def user_model(engine: blink.TorchEngine) -> torch.nn.Module:
    """The engine's model as a user of the peers loads it: from_pretrained at its defaults (the checkpoint's dtype,
    torch's own kernels). The engine's own model where blink runs exactly that, else a second copy of the same
    weights, loaded once. blink's choices for a CPU (bfloat16 where it computes it natively, oneDNN for a float32
    model's linear layers, its own Gated DeltaNet path: BLINK_DTYPE, BLINK_CPU_MATMUL, BLINK_GATED_DELTA) are
    blink's, not the peers'."""
    if engine.key not in _USER_MODELS:
        from transformers import AutoModelForCausalLM

        dtype = checkpoint_dtype(engine)
        _USER_MODELS[engine.key] = (
            engine.model
            if engine.matmul == "torch" and engine.model.dtype == dtype and not engine.gated_delta_layers
            else blink.load_pretrained(
                AutoModelForCausalLM,
                engine.source,
                engine.revision,
                replace(engine.settings, dtype=blink.dtype_name(dtype)),
            ).eval()
        )
    return _USER_MODELS[engine.key]


def checkpoint_dtype(engine: blink.TorchEngine) -> torch.dtype:
    """The dtype from_pretrained loads the engine's checkpoint in when none is asked for (its config's; float32
    where the config names none)."""
    from transformers import AutoConfig

    dtype = AutoConfig.from_pretrained(engine.source, revision=engine.revision).dtype
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.float32


def prompt_text(engine: blink.TorchEngine, state, qkey: str, q: dict) -> tuple[str, list[str]]:
    """The exact prompt blink renders for one question (its single prompt: no permute or multi), and its option
    keys in shown order."""
    (row,) = blink.parse_question(qkey, q).rows
    user = blink.user_message(state, row, engine.labels[: len(row.shown)])
    return blink.wrap(engine.tok, user), [o.key for o in row.shown]


def request(engine: blink.TorchEngine, state, questions: dict) -> blink.Request:
    """A request parsed under the engine's own settings."""
    return blink.parse_request(state, questions, settings=engine.settings)


def render_ids(engine: blink.TorchEngine, state, questions: dict) -> list[list[int]]:
    """The token ids of every prompt blink renders for a request."""
    return [p.ids for p in engine.render(request(engine, state, questions))]


@contextmanager
def prefix_cache(engine: blink.TorchEngine, on: bool):
    """The engine with shared prefixes on or off (BLINK_PREFIX_CACHE) for the duration: one loaded model serves
    both arms, so its settings are swapped rather than the weights loaded twice."""
    before = engine.settings
    engine.settings = replace(before, prefix_cache=on)
    try:
        yield engine
    finally:
        engine.settings = before


# ---------------------------------------------------------------------------------------------------------------
# blink
# ---------------------------------------------------------------------------------------------------------------


def blink_request(engine: blink.TorchEngine, state, questions: dict, prefix: bool) -> Measured:
    """One blink request (all its questions), plain or with the shared prefix encoded once."""
    device = engine.model.lm_head.weight.device
    with prefix_cache(engine, prefix), PeakMemory(device) as mem:
        engine.prefixes.clear()  # cold: nothing kept from an earlier measurement

        def run() -> tuple:
            req = request(engine, state, questions)
            res = engine.forward(req)
            harness.sync(device)
            return req, res

        wall, cpu, (req, res) = harness.timed(run)
        settings = engine.settings
    answered = answers.of(req, res.readouts, settings.temperature)
    prompts = engine.render(req)
    shared = [
        n
        for _, n in blink.prefix_groups(
            [p.ids for p in prompts], [p.cuts for p in prompts], settings, engine.prefixes.keeps
        )
        if n
    ]
    rows = {k: r.logits[0] for k, r in res.readouts.items()}  # one prompt per question: no permute or multi here
    return Measured(
        wall,
        cpu,
        res.prefill_tokens,
        {k: a["choice"] for k, a in answered.items()},
        mem.peak_mb,
        rows,
        {"shared_prefix_tokens": shared[0] if shared else 0, "model_ms": res.model_ms},
    )


# ---------------------------------------------------------------------------------------------------------------
# Peer: one forward per question, by hand
# ---------------------------------------------------------------------------------------------------------------


def unbatched_one(engine: blink.TorchEngine, state, qkey: str, q: dict) -> Measured:
    """model(ids).logits[0, -1] at the label ids: the loop a user writes by hand, one question at a time."""
    model, tok, device = user_model(engine), engine.tok, engine.model.lm_head.weight.device
    with PeakMemory(device) as mem, torch.no_grad():

        def run() -> tuple:
            text, keys = prompt_text(engine, state, qkey, q)
            ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
            last = model(input_ids=ids).logits[0, -1].float()
            row = last[torch.tensor(engine.label_ids[: len(keys)], device=device)].tolist()
            harness.sync(device)
            return keys, ids, row

        wall, cpu, (keys, ids, row) = harness.timed(run)
    return Measured(wall, cpu, ids.shape[1], {qkey: blink.top_key(keys, row)}, mem.peak_mb, {qkey: row})


# ---------------------------------------------------------------------------------------------------------------
# Peer: per-option continuation log-likelihood (lm-evaluation-harness multiple choice, SGLang select)
# ---------------------------------------------------------------------------------------------------------------


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's split: trailing spaces of the context move to the continuation, the whole string is
    encoded once and the continuation is what follows the context's own encoding."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    return ctx, whole[len(ctx) :]


def per_option_one(engine: blink.TorchEngine, state, qkey: str, q: dict) -> Measured:
    """Score every option's text as the assistant's continuation: one forward of (context + continuation)[:-1]
    per option, full-vocabulary log-softmax, the continuation tokens' log-probs summed (lm-eval `acc`), also
    divided by the continuation's characters (lm-eval `acc_norm`) and averaged per token (SGLang `select`'s
    default, token_length_normalized)."""
    model, tok, device = user_model(engine), engine.tok, engine.model.lm_head.weight.device
    (row,) = blink.parse_question(qkey, q).rows
    keys = [o.key for o in row.shown]
    sums, norms, means, spans = [], [], [], []
    with PeakMemory(device) as mem, torch.no_grad():

        def run() -> None:
            context, _ = prompt_text(engine, state, qkey, q)
            for display in (o.text for o in row.shown):
                ctx, cont = encode_pair(tok, context, display)
                inp = torch.tensor([(ctx + cont)[:-1]], device=device)
                logprobs = torch.log_softmax(model(input_ids=inp).logits[0].float(), dim=-1)
                picked = logprobs[len(ctx) - 1 :, :].gather(1, torch.tensor(cont, device=device)[:, None]).squeeze(1)
                total = float(picked.sum())
                sums.append(total)
                norms.append(total / max(1, len(display)))
                means.append(total / len(cont))
                spans.append((0, inp.shape[1]))
            harness.sync(device)

        wall, cpu, _ = harness.timed(run)
    extra = {
        "choice_acc_norm": blink.top_key(keys, norms),
        "choice_token_mean": blink.top_key(keys, means),
        "spans": spans,
        "sum_logprobs": sums,
    }
    return Measured(wall, cpu, sum(n for _, n in spans), {qkey: blink.top_key(keys, sums)}, mem.peak_mb, {}, extra)


# ---------------------------------------------------------------------------------------------------------------
# Peer: generate, then parse the letter
# ---------------------------------------------------------------------------------------------------------------

_LETTERS = re.compile(r"\b([A-Z]{1,2})\b")


def parse_label(text: str, labels: list[str]) -> str | None:
    """The first offered label that appears as a word in the generated text."""
    for match in _LETTERS.finditer(text):
        if match.group(1) in labels:
            return match.group(1)
    return None


def generate_one(engine: blink.TorchEngine, state, qkey: str, q: dict, max_new_tokens: int = 4) -> Measured:
    """model.generate (greedy, a few new tokens), then read the letter out of the text."""
    model, tok, device = user_model(engine), engine.tok, engine.model.lm_head.weight.device
    with PeakMemory(device) as mem, torch.no_grad():

        def run() -> tuple:
            text, keys = prompt_text(engine, state, qkey, q)
            ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=engine.pad_id,
            )
            reply = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            harness.sync(device)
            return keys, ids, out, reply

        wall, cpu, (keys, ids, out, reply) = harness.timed(run)
    labels = engine.labels[: len(keys)]
    label = parse_label(reply, labels)
    choice = keys[labels.index(label)] if label is not None else None
    return Measured(
        wall,
        cpu,
        ids.shape[1],
        {qkey: choice},
        mem.peak_mb,
        {},
        {"generated_tokens": int(out.shape[1] - ids.shape[1]), "reply": reply},
    )


def label_logit_gap(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    """Largest absolute difference between two arms' label logits over the questions both read."""
    gaps = [abs(x - y) for k in a.keys() & b.keys() for x, y in zip(a[k], b[k])]
    return max(gaps) if gaps else math.nan
