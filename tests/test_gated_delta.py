"""blink's CPU path for Qwen3.5's linear-attention layers (blink.gated_delta_rule) against transformers' own: the rule
alone, and the tiny Qwen3.5 answering through the real engine, tails padded and unpadded alike."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from test_torch import DOC, SMALL
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

import blink

DEFAULTS = blink.Settings()
# The questions' tails differ in length, so the engine's batch of tails is right-padded; one question alone runs
# unpadded.
EVIDENCE, QUESTIONS = DOC, SMALL


def inputs(rows: int, length: int, key_heads: int = 2, heads: int = 4, dim: int = 16, seed: int = 0):
    """Random q, k, v, g (log decay, negative), beta and a starting state, in float64."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = rand(rows, length, key_heads, dim), rand(rows, length, key_heads, dim), rand(rows, length, heads, dim)
    k[:, 1:] = k[:, :1] + 0.05 * k[:, 1:]  # keys nearly parallel: the chunks' triangular systems are hard ones
    g = -torch.rand(rows, length, heads, generator=gen, dtype=torch.float64)
    beta = torch.rand(rows, length, heads, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, 0.1 * rand(rows, heads, dim, dim)


@pytest.mark.parametrize("length", [1, 5, 48, 64, 80, 96, 100, 112, 700])  # last chunks of 16, 32, 36, 48, 60 too
@pytest.mark.parametrize("decay", [1.0, 0.01])
def test_the_rule_equals_transformers_in_float32(length, decay):
    # transformers' reference in float64 is the truth; blink's rule runs in float32, from a state and from nothing.
    q, k, v, g, beta, state = inputs(2, length)
    for start in (state, None):
        want, want_state = torch_chunk_gated_delta_rule(
            q, k, v, g * decay, beta, initial_state=start, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        got, got_state = blink.gated_delta_rule(
            *(x.float() for x in (q, k, v, g * decay, beta)), None if start is None else start.float()
        )
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert (got.double() - want).abs().max() < 1e-5
        assert (got_state.double() - want_state).abs().max() < 1e-5


@pytest.mark.parametrize("size", [1, 2, 4])
def test_the_convolution_equals_torchs_across_its_blocks(size, monkeypatch):
    # causal_conv sums the taps a block of tokens at a time, each block reading the tokens before it from the last;
    # blocks of 7 tokens over 50, a kernel of one tap (no tokens before) to Qwen3.5's four, against torch's own
    # causal convolution and SiLU in float64 (causal_conv sums in float32).
    monkeypatch.setattr(blink, "CONV_BLOCK_BYTES", 4 * 2 * 8 * 7)
    conv = torch.nn.Conv1d(8, 8, size, groups=8, padding=size - 1).double().requires_grad_(False)
    x = torch.randn(2, 50, 8, generator=torch.Generator().manual_seed(size), dtype=torch.float64)
    want = torch.nn.functional.silu(conv(x.transpose(1, 2))[..., :50]).transpose(1, 2)
    assert (blink.causal_conv(conv, x, None, 0) - want).abs().max() < 1e-5


def test_the_rule_leaves_the_state_it_continues_as_it_was():
    q, k, v, g, beta, state = (x.float() for x in inputs(1, 70))
    kept = state.clone()
    blink.gated_delta_rule(q, k, v, g, beta, state)
    assert torch.equal(state, kept)


def test_padded_rows_run_their_real_tokens_alone():
    # Right-padded rows with NaN in their padding: each row's output and state are those of its real tokens run alone
    # (the same bits), and the padding's output is zero. Computing any padded position would put NaN there.
    lengths = (70, 5, 64, 33)
    q, k, v, g, beta, state = (x.float() for x in inputs(len(lengths), max(lengths)))
    for r, n in enumerate(lengths):
        for x in (q, k, v, g, beta):
            x[r, n:] = float("nan")
    out, held = blink.gated_delta_rows(q, k, v, g, beta, state, lengths)
    for r, n in enumerate(lengths):
        alone, alone_state = blink.gated_delta_rule(*(x[r : r + 1, :n] for x in (q, k, v, g, beta)), state[r : r + 1])
        assert torch.equal(out[r : r + 1, :n], alone) and torch.equal(held[r : r + 1], alone_state)
        assert not out[r, n:].any()


def test_a_padded_batch_of_tails_runs_the_recurrence_on_real_tokens(tiny_qwen_dir, monkeypatch):
    # The engine's batch of tails (right-padded: the tails differ) hands each linear-attention layer's recurrence
    # the real tokens of each row alone: what it ran adds up to the tails' tokens, layer by layer.
    engine = blink.TorchEngine(tiny_qwen_dir, settings=DEFAULTS)
    request = blink.parse_request(EVIDENCE, QUESTIONS, settings=DEFAULTS)
    prompts = engine.render(request)
    ran, rule = [], blink.gated_delta_rule

    def spy(q, *args):
        ran.append((*q.shape[:2], blink._REAL_TOKENS.get() is not None))  # rows, tokens, in a padded batch
        return rule(q, *args)

    monkeypatch.setattr(blink, "gated_delta_rule", spy)
    engine.forward(request)
    lengths = sorted(n for rows, n, padded in ran if padded)
    cut = max(len(p.ids) for p in prompts) - lengths[-1]  # the kept prefix the tails ran from
    tails = [len(p.ids) - cut for p in prompts]
    assert len(set(tails)) > 1  # the tails differ: their batch is padded
    assert lengths == sorted(tails * engine.gated_delta_layers)  # each row its own length, not the batch's
    assert all(rows == 1 for rows, n, padded in ran if padded)


def own_logits(model, prompt: blink.Prompt) -> list[float]:
    """transformers' own model (its own linear-attention code) on one prompt alone: the label logits."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt.ids])).logits[0, -1]
    return logits[prompt.cand].tolist()


def test_the_engine_answers_as_transformers_own_layers_do(tiny_qwen_dir):
    ours = blink.TorchEngine(tiny_qwen_dir, settings=DEFAULTS)
    theirs = blink.TorchEngine(tiny_qwen_dir, settings=replace(DEFAULTS, gated_delta="transformers"))
    assert ours.gated_delta_layers == 2 and theirs.gated_delta_layers == 0  # the tiny model's two linear layers
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32).eval()
    for questions in (QUESTIONS, {"late": QUESTIONS["late"]}):
        request = blink.parse_request(EVIDENCE, questions, settings=DEFAULTS)
        prompts = ours.render(request)
        if len(questions) > 1:
            assert len({len(p.ids) for p in prompts}) == len(prompts)  # the tails differ: the batch is padded
        got, ref = ours.forward(request).readouts, theirs.forward(request).readouts
        for p in prompts:
            assert max(abs(a - b) for a, b in zip(got[p.qkey].logits[0], ref[p.qkey].logits[0])) < 1e-4
            assert max(abs(a - b) for a, b in zip(got[p.qkey].logits[0], own_logits(model, p))) < 1e-4


def test_the_engine_keeps_transformers_layers_off_a_cpu_or_when_told():
    layer, other = (type("Qwen3_5GatedDeltaNet", (torch.nn.Module,), {"activation": a})() for a in ("silu", "gelu"))
    model = torch.nn.Sequential(layer, other)
    model.get_output_embeddings = lambda: torch.nn.Linear(2, 2)
    assert blink.use_gated_delta(model, "transformers") == 0 and "forward" not in vars(layer)
    assert blink.use_gated_delta(model, "blink") == 1 and vars(layer)["forward"].__func__ is blink._gated_delta_forward
    assert "forward" not in vars(other)  # its convolution's activation is not the SiLU blink's path applies


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_continues_its_cache_as_transformers_own_does(tiny_qwen_dir, dtype):
    # One linear-attention layer, blink's forward against the layer's own in float64: a first prompt (shorter than
    # the convolution's kernel, or longer than a chunk), then tokens continuing its cache (conv state and recurrent
    # state). Outputs and the states they leave agree, relative to the largest value, within 1e-4 in float32 or a
    # tenth in bfloat16. Both bounds are relative because the CPU's kernels set the rounding: on one CPU transformers'
    # own layer in float32 was off by 1.6e-4 of an output of 10 (1.6e-5 of it), in bfloat16 by up to 4% of it.
    from transformers import DynamicCache

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float64).eval()
    truth = next(m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet")
    layer = copy.deepcopy(truth).to(dtype)
    gen = torch.Generator().manual_seed(1)
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    for first, then in ((2, 1), (70, 3), (5, 66)):
        caches = DynamicCache(config=model.config), DynamicCache(config=model.config)
        for length in (first, then):
            x = torch.randn(2, length, model.config.hidden_size, generator=gen, dtype=torch.float64)
            with torch.no_grad():
                want = type(truth).forward(truth, x, cache=caches[0])
                got = blink._gated_delta_forward(layer, x.to(dtype), cache=caches[1])
            scale = want.abs().max()
            assert got.dtype == dtype and (got.double() - want).abs().max() < tolerance * scale
            i = layer.layer_idx
            assert caches[1].get_seq_length(i) == caches[0].get_seq_length(i)  # positions read the tokens it counts
            for state in ("get_recurrent_state", "get_conv_state"):
                theirs, ours = (getattr(c, state)(i, state_idx=0).double() for c in caches)
                scale = theirs.abs().max()
                assert ours.shape == theirs.shape and (ours - theirs).abs().max() < tolerance * scale, state
