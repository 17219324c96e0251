"""The shared-prefix path: the system prompt and evidence encoded once, each question's tail run against copies of
that cache (full-attention keys/values, and the linear-attention conv and recurrent states of Qwen3.5)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

import blink

DOC = " ".join(
    f"Ticket {n}: the customer's {item} {problem}; they asked for {ask}, and the agent tagged it for {team}."
    for n, (item, problem, ask, team) in enumerate([
        ("router", "stopped working after an update", "a replacement", "technical support"),
        ("invoice", "was charged twice", "a refund", "billing"),
        ("parcel", "never arrived", "a callback", "shipping"),
        ("password", "cannot be reset", "help", "account security"),
        ("laptop", "arrived damaged", "a replacement", "returns"),
        ("gift card", "shows the wrong price", "a refund", "billing"),
    ], start=1))
QUESTIONS = {  # tails of different lengths and every question type
    "team": {"type": "choice", "instructions": "Which team handles ticket 2?",
             "criteria": ["billing", "shipping", "technical support", "account security"]},
    "refund": {"type": "noul", "instructions": "Does any customer ask for a refund?"},
    "severity": {"type": "score", "instructions": "How severe is the worst ticket for the business, given that "
                                                   "a customer was charged twice and a parcel went missing?",
                 "criteria": ["trivial", "minor", "serious", "critical"]},
}
OTHER_DOC = "Case log of the second shop. " + DOC.replace("Ticket", "Case")
MIN_TOKENS = 64  # a short document keeps these tests fast; the threshold itself is tested below
_VARIANTS: dict = {}


def variant(eng: blink.TorchEngine, **changes) -> blink.TorchEngine:
    """The same model loaded by the torch engine under other settings (each model and settings loaded once)."""
    settings = replace(eng.settings, **changes)
    if settings == eng.settings:
        return eng
    key = (eng.model_id, settings)
    if key not in _VARIANTS:
        _VARIANTS[key] = blink.TorchEngine(eng.model_id, eng.revision, settings)
    return _VARIANTS[key]


def prefix_on(eng: blink.TorchEngine, **changes) -> blink.TorchEngine:
    """The model with the prefix path on, the short test document long enough to take it."""
    return variant(eng, prefix_cache=True, prefix_min_tokens=MIN_TOKENS, **changes)


def req(state, questions: dict) -> blink.Request:
    """A request parsed at default settings."""
    return blink.parse_request(state, questions, settings=blink.Settings())


def render(eng: blink.TorchEngine, state, questions: dict) -> list[blink.Prompt]:
    """The engine's prompts of a request."""
    return eng.render(req(state, questions))


@pytest.fixture(scope="module", params=["standin", "tiny_qwen"])
def eng(request) -> blink.TorchEngine:
    """Each real model the prefix path must serve: the Llama stand-in and the tiny Qwen3.5 (linear attention)."""
    return request.getfixturevalue(request.param)


_PLAIN: dict = {}


def plain_logits(eng: blink.TorchEngine) -> dict:
    """The plain path's label logits for DOC/QUESTIONS, computed once per model."""
    assert not eng.settings.prefix_cache
    if eng.key not in _PLAIN:
        raw, prefill = run(eng, DOC, QUESTIONS)
        assert prefill == sum(len(p.ids) for p in render(eng, DOC, QUESTIONS))  # every prompt token, computed
        _PLAIN[eng.key] = raw
    return _PLAIN[eng.key]


@pytest.fixture(scope="module")
def plain(eng) -> dict:
    """The plain path's label logits of the parametrized model."""
    return plain_logits(eng)


@pytest.fixture()
def spy(monkeypatch) -> dict:
    """Records each call of the prefix path and the row count of every backbone forward."""
    seen = {"shared": [], "rows": []}
    shared = blink._forward_shared

    def recording(engine, seqs, cands, prefix_len, out):
        seen["shared"].append((len(seqs), prefix_len))
        return shared(engine, seqs, cands, prefix_len, out)

    monkeypatch.setattr(blink, "_forward_shared", recording)
    return seen


def run(eng: blink.TorchEngine, state, questions: dict) -> tuple[dict, int]:
    """Label logits and computed prefill tokens of one request, under the engine's own settings."""
    result = eng.forward(req(state, questions))
    return result.readouts, result.prefill_tokens


def common_prefix(seqs: list[list[int]]) -> int:
    """Reference: the common token prefix of all sequences, leaving each at least one token of its own."""
    return min(len(os.path.commonprefix(seqs)), min(len(s) for s in seqs) - 1)


def gap(a: dict, b: dict) -> float:
    """Largest difference between two readouts of the same questions: label logits and vocabulary log-sum-exp."""
    assert a.keys() == b.keys()
    return rows_gap([(z, lse) for k in a for z, lse in zip(a[k].logits, a[k].lse)],
                    [(z, lse) for k in b for z, lse in zip(b[k].logits, b[k].lse)])


def rows_gap(a: list, b: list) -> float:
    """Largest difference between two lists of forward rows (label logits, vocabulary log-sum-exp)."""
    assert len(a) == len(b)
    return max(abs(x - y) for (za, la), (zb, lb) in zip(a, b) for x, y in zip([*za, la], [*zb, lb]))


def count_rows(eng: blink.TorchEngine, seen: dict):
    """Record the batch size of every backbone forward while the returned hook handle lives."""
    return eng.backbone().register_forward_pre_hook(
        lambda module, args, kwargs: seen["rows"].append(kwargs["input_ids"].shape[0]), with_kwargs=True)


def test_prefix_logits_equal_plain_and_prefill_is_counted(eng, plain, spy):
    seqs = [p.ids for p in render(eng, DOC, QUESTIONS)]
    shared = common_prefix(seqs)
    assert shared >= MIN_TOKENS  # the document is long enough for the prefix path to run
    raw, prefill = run(prefix_on(eng), DOC, QUESTIONS)
    assert spy["shared"] == [(len(seqs), shared)]
    assert gap(raw, plain) < 1e-4
    assert prefill == sum(map(len, seqs)) - (len(seqs) - 1) * shared


# The row cap and the threshold are model-agnostic logic: they run on the tiny model, which is fast.


def test_kv_token_cap_bounds_the_copies_held_at_once(tiny_qwen, spy):
    seqs = [p.ids for p in render(tiny_qwen, DOC, QUESTIONS)]
    shared = common_prefix(seqs)
    longest_tail = max(len(s) for s in seqs) - shared
    eng = prefix_on(tiny_qwen, prefix_kv_tokens=2 * (shared + longest_tail))  # two copies of the prefix
    handle = count_rows(eng, spy)
    try:
        raw, _ = run(eng, DOC, QUESTIONS)
    finally:
        handle.remove()
    assert spy["rows"] == [1, 2, 1]  # the prefix once, then the three tails two at a time
    assert gap(raw, plain_logits(tiny_qwen)) < 1e-4


def test_prefix_shorter_than_min_tokens_runs_the_plain_path(tiny_qwen, spy):
    seqs = [p.ids for p in render(tiny_qwen, DOC, QUESTIONS)]
    raw, prefill = run(variant(tiny_qwen, prefix_cache=True, prefix_min_tokens=common_prefix(seqs) + 1), DOC,
                       QUESTIONS)
    assert spy["shared"] == []
    assert prefill == sum(map(len, seqs))
    # exactly at the threshold: it runs
    run(variant(tiny_qwen, prefix_cache=True, prefix_min_tokens=common_prefix(seqs)), DOC, QUESTIONS)
    assert spy["shared"] == [(len(seqs), common_prefix(seqs))]


def test_packed_requests_each_keep_their_own_prefix(tiny_qwen, spy):
    # decide_many and the Batcher pack several requests into one forward: each request's questions still share
    # that request's evidence, while the requests share only the system prompt.
    first, second = render(tiny_qwen, DOC, QUESTIONS), render(tiny_qwen, OTHER_DOC, QUESTIONS)
    own = [common_prefix([p.ids for p in work]) for work in (first, second)]
    across = common_prefix([first[0].ids, second[0].ids])
    assert across < min(own)
    eng = variant(tiny_qwen, prefix_cache=True, prefix_min_tokens=across + 1)
    jobs = [eng.prepare(req(DOC, QUESTIONS)), eng.prepare(req(OTHER_DOC, QUESTIONS))]
    assert [[p.ids for p in job.work] for job in jobs] == [[p.ids for p in work] for work in (first, second)]
    packed = eng.run(jobs)
    assert sorted(spy["shared"]) == sorted([(len(first), own[0]), (len(second), own[1])])
    computed = sum(len(p.ids) for p in first + second) - sum((len(QUESTIONS) - 1) * n for n in own)
    assert [(r.prefill_tokens, r.batched_requests) for r in packed] == [(computed, 2), (computed, 2)]
    assert gap(packed[0].readouts, plain_logits(tiny_qwen)) < 1e-4
    assert gap(packed[1].readouts, run(tiny_qwen, OTHER_DOC, QUESTIONS)[0]) < 1e-4


def one_token_tails(eng: blink.TorchEngine) -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts that differ only in their last token: each tail is one token, right after the prefix."""
    base = render(eng, DOC, {"team": QUESTIONS["team"]})[0]
    seqs = [base.ids[:-1] + [t] for t in (base.ids[-1], eng.label_ids[0], eng.label_ids[1])]
    return seqs, [base.cand] * len(seqs)


def forward_rows(eng: blink.TorchEngine, seqs: list[list[int]], cands: list[list[int]], prefix: bool) -> list:
    """blink's forward over raw prompts, with the prefix path on or off."""
    return blink._forward((prefix_on(eng) if prefix else eng).key, seqs, cands)[0]


def test_one_token_tails(eng, spy):
    # Tails of a single token take the models' one-step paths (Qwen3.5 updates its conv state in place).
    seqs, cands = one_token_tails(eng)
    shared_rows = forward_rows(eng, seqs, cands, prefix=True)
    assert spy["shared"] == [(3, len(seqs[0]) - 1)]
    assert rows_gap(shared_rows, forward_rows(eng, seqs, cands, prefix=False)) < 1e-4


@pytest.mark.parametrize("state", ["conv_states", "recurrent_states"])
def test_linear_attention_states_carry_the_prefix(tiny_qwen, monkeypatch, state):
    # The parity above can fail: a tail run against a cache whose linear-attention state was reset reads other
    # logits, so both states must be copied along the batch axis, not only the keys and values.
    seqs, cands = one_token_tails(tiny_qwen)
    expand = blink._expand_cache

    def reset(cache, repeats):
        cache = expand(cache, repeats)
        for layer in cache.layers:
            for held in (getattr(layer, state, None) or {}).values():
                held.zero_()
        return cache

    monkeypatch.setattr(blink, "_expand_cache", reset)
    broken = forward_rows(tiny_qwen, seqs, cands, prefix=True)
    assert rows_gap(broken, forward_rows(tiny_qwen, seqs, cands, prefix=False)) > 1e-3


def test_decide_reports_prefill_tokens(tiny_qwen, served):
    dep = served(prefix_on(tiny_qwen))
    seqs = [p.ids for p in render(tiny_qwen, DOC, QUESTIONS)]
    meta = dep.decide(DOC, QUESTIONS)["meta"]
    assert meta["input_tokens"] == sum(map(len, seqs))
    assert meta["prefill_tokens"] == sum(map(len, seqs)) - (len(seqs) - 1) * common_prefix(seqs)


def test_expand_cache_copies_every_state(tiny_qwen):
    ids = torch.tensor([render(tiny_qwen, DOC, {"team": QUESTIONS["team"]})[0].ids])
    with torch.no_grad():
        cache = tiny_qwen.backbone()(input_ids=ids, use_cache=True).cache
    big = blink._expand_cache(cache, 3)
    kinds = set()
    for small, large in zip(cache.layers, big.layers):
        for name in ("keys", "values"):
            if torch.is_tensor(getattr(small, name, None)) and getattr(small, name).numel():
                kinds.add(name)
                assert torch.equal(getattr(large, name), getattr(small, name).expand(3, -1, -1, -1))
        for name in ("conv_states", "recurrent_states"):
            for k, v in (getattr(small, name, None) or {}).items():
                kinds.add(name)
                got = getattr(large, name)[k]
                assert got.shape[0] == 3 and torch.equal(got, v.expand(3, *v.shape[1:]))
                assert got.data_ptr() != v.data_ptr()  # a copy: the forward writes into it
    assert kinds == {"keys", "values", "conv_states", "recurrent_states"}
