"""Shared prefixes: the template header and each request's evidence encoded once, kept across requests, and every
question's tail run against a copy (full-attention keys/values, and the linear-attention conv and recurrent states of
Qwen3.5). Same tokens, same positions: the answers equal the plain path's in fp32."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from conftest import serving_without_answer_cache

import blink

DOC = " ".join(
    f"Ticket {n}: the customer's {item} {problem}; they asked for {ask}, and the agent tagged it for {team}."
    for n, (item, problem, ask, team) in enumerate(
        [
            ("router", "stopped working after an update", "a replacement", "technical support"),
            ("invoice", "was charged twice", "a refund", "billing"),
            ("parcel", "never arrived", "a callback", "shipping"),
            ("password", "cannot be reset", "help", "account security"),
            ("laptop", "arrived damaged", "a replacement", "returns"),
            ("gift card", "shows the wrong price", "a refund", "billing"),
        ],
        start=1,
    )
)
QUESTIONS = {  # tails of different lengths and every question type
    "team": {
        "type": "choice",
        "instructions": "Which team handles ticket 2?",
        "criteria": ["billing", "shipping", "technical support", "account security"],
    },
    "refund": {"type": "noul", "instructions": "Does any customer ask for a refund?"},
    "severity": {
        "type": "score",
        "instructions": "How severe is the worst ticket for the business, given that "
        "a customer was charged twice and a parcel went missing?",
        "criteria": ["trivial", "minor", "serious", "critical"],
    },
}
NEW_QUESTIONS = {  # the same evidence asked again, other questions (one starts with punctuation, one is a permute)
    "first": {"type": "noul", "instructions": "(Quick check) Is ticket 1 about a router?"},
    "returns": {
        "type": "choice",
        "instructions": "Which team handles ticket 5?",
        "permute": 2,
        "criteria": {"returns": "Sends items back", "billing": "Money", "shipping": "Parcels"},
    },
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
    """The model with shared prefixes on, the short test document long enough to be kept, nothing kept yet."""
    on = variant(eng, **{"prefix_cache": True, "prefix_min_tokens": MIN_TOKENS, **changes})
    on.prefixes.clear()
    return on


def plain_engine(eng: blink.TorchEngine) -> blink.TorchEngine:
    """The model on the plain path: every prompt run whole (the reference)."""
    return variant(eng, prefix_cache=False)


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


def plain_readouts(eng: blink.TorchEngine, state=DOC, questions: dict = QUESTIONS) -> dict:
    """The plain path's readouts of a request, computed once per model."""
    key = (eng.model_id, state, tuple(questions))
    if key not in _PLAIN:
        result = plain_engine(eng).forward(req(state, questions))
        assert result.prefill_tokens == result.input_tokens and result.cached_tokens == 0  # every token, computed
        _PLAIN[key] = result.readouts
    return _PLAIN[key]


@pytest.fixture()
def spy(monkeypatch) -> dict:
    """Records each prefix a forward runs from (its length, tokens read from kept ones, tokens encoded) and the
    row count of every backbone forward."""
    seen = {"prefix": [], "rows": []}
    prefix = blink.PrefixStore.prefix

    def recording(store, engine, ids, points, header=0):
        cache, read, encoded = prefix(store, engine, ids, points, header)
        seen["prefix"].append((len(ids), read, encoded))
        return cache, read, encoded

    monkeypatch.setattr(blink.PrefixStore, "prefix", recording)
    return seen


def gap(a: dict, b: dict) -> float:
    """Largest difference between two readouts of the same questions: label logits and vocabulary log-sum-exp."""
    assert a.keys() == b.keys()
    return rows_gap(
        [(z, lse) for k in a for z, lse in zip(a[k].logits, a[k].lse)],
        [(z, lse) for k in b for z, lse in zip(b[k].logits, b[k].lse)],
    )


def rows_gap(a: list, b: list) -> float:
    """Largest difference between two lists of forward rows (label logits, vocabulary log-sum-exp)."""
    assert len(a) == len(b)
    return max(abs(x - y) for (za, la), (zb, lb) in zip(a, b) for x, y in zip([*za, la], [*zb, lb]))


def count_rows(eng: blink.TorchEngine, seen: dict):
    """Record the batch size of every backbone forward while the returned hook handle lives."""
    return eng.backbone().register_forward_pre_hook(
        lambda module, args, kwargs: seen["rows"].append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )


# Attention free of cost: continuing a kept prefix always pays, so a test can take that path on any model.
ALWAYS_CONTINUE = blink.PrefillCost(token_flops=1.0, pair_flops=0.0)


def test_cut_points_end_the_shared_parts_whatever_follows(eng):
    # The header ends every prompt alike, whatever the evidence; the evidence cut ends every prompt over one piece of
    # evidence alike, whatever the question (even one that opens with punctuation, which some pre-tokenizers join
    # to the quote before it).
    states = [DOC, OTHER_DOC, {"ticket": 7, "text": "(urgent) refund"}, ".", "  spaced", 3, ["a", "b"]]
    by_state = {str(s): render(eng, s, {**QUESTIONS, **NEW_QUESTIONS}) for s in states}
    headers = {tuple(p.ids[: p.cuts[0]]) for prompts in by_state.values() for p in prompts}
    assert len(headers) == 1
    header = next(iter(headers))
    assert eng.tok.decode(list(header)).endswith('{"evidence":')
    for prompts in by_state.values():
        evidence = {tuple(p.ids[: p.cuts[1]]) for p in prompts}
        assert len(evidence) == 1 and eng.tok.decode(list(next(iter(evidence)))).endswith('"criterion":')
        assert all(len(header) < p.cuts[1] < len(p.ids) for p in prompts)


def test_prefix_logits_equal_plain_and_prefill_is_counted(eng, spy):
    prompts = render(eng, DOC, QUESTIONS)
    header, evidence = prompts[0].cuts
    assert evidence >= MIN_TOKENS  # the document is long enough to be kept
    result = prefix_on(eng).forward(req(DOC, QUESTIONS))
    encoded = evidence  # the header, then the evidence after it, or the evidence from nothing: no token twice
    assert spy["prefix"] == [(evidence, 0, encoded)]
    assert gap(result.readouts, plain_readouts(eng)) < 1e-4
    assert result.prefill_tokens == encoded + sum(len(p.ids) - evidence for p in prompts)
    # the first question computed the evidence; its siblings read it: cached for them
    assert result.cached_tokens == (len(prompts) - 1) * evidence == result.input_tokens - result.prefill_tokens


def test_evidence_seen_before_runs_only_the_new_questions_tails(eng, spy, served):
    # A person editing only the questions: the second request reads the whole evidence from the kept prefix.
    on = prefix_on(eng)
    dep = served(on)
    first = dep.decide(DOC, QUESTIONS)["meta"]
    again = dep.decide(DOC, NEW_QUESTIONS)
    prompts = render(eng, DOC, NEW_QUESTIONS)
    evidence = prompts[0].cuts[1]
    assert spy["prefix"][-1] == (evidence, evidence, 0)
    meta = again["meta"]
    assert meta["cached_tokens"] == len(prompts) * evidence
    assert meta["prefill_tokens"] == sum(len(p.ids) - evidence for p in prompts)
    assert meta["input_tokens"] == sum(len(p.ids) for p in prompts)
    assert first["cached_tokens"] == (len(QUESTIONS) - 1) * evidence  # read by the first request's other questions
    cold = served(plain_engine(eng)).decide(DOC, NEW_QUESTIONS)["answers"]
    assert again["answers"].keys() == cold.keys()
    for key, answer in again["answers"].items():
        assert answer["probabilities"] == pytest.approx(cold[key]["probabilities"], abs=1e-5)


def test_the_header_is_encoded_once_per_engine(tiny_qwen, spy):
    # A short document is not kept, but every prompt starts from the kept template header.
    on = prefix_on(tiny_qwen, prefix_min_tokens=10_000)
    short = {"team": QUESTIONS["team"]}
    first = on.forward(req("Ticket 1: a router.", short))
    second = on.forward(req("Ticket 2: an invoice.", short))
    header = render(tiny_qwen, "x", short)[0].cuts[0]
    assert (first.cached_tokens, second.cached_tokens) == (0, header)
    assert spy["prefix"] == [(header, 0, header), (header, header, 0)]
    assert second.prefill_tokens == second.input_tokens - header
    assert gap(second.readouts, plain_readouts(tiny_qwen, "Ticket 2: an invoice.", short)) < 1e-4
    assert len(on.prefixes) == 1


def test_kept_prefixes_stay_within_the_memory_budget(tiny_qwen, monkeypatch):
    on = prefix_on(tiny_qwen)
    monkeypatch.setattr(on, "prefill_cost", ALWAYS_CONTINUE)  # the evidence continues the header: both kept
    on.forward(req(DOC, QUESTIONS))
    header_and_doc = on.prefixes.held_bytes()
    assert len(on.prefixes) == 2 and header_and_doc > 0
    # room for about two of these: the least recently used is dropped, the header (used by every request) stays
    small = prefix_on(tiny_qwen, prefix_cache_mb=1)
    monkeypatch.setattr(small, "prefill_cost", ALWAYS_CONTINUE)
    small.prefixes.budget = int(header_and_doc * 1.6)
    small.forward(req(DOC, QUESTIONS))
    small.forward(req(OTHER_DOC, QUESTIONS))
    assert small.prefixes.held_bytes() <= small.prefixes.budget and len(small.prefixes) == 2
    third = small.forward(req(DOC, QUESTIONS))  # DOC was dropped: encoded again from the kept header
    header, evidence = render(tiny_qwen, DOC, QUESTIONS)[0].cuts
    assert third.cached_tokens == header + (len(QUESTIONS) - 1) * evidence
    assert gap(third.readouts, plain_readouts(tiny_qwen)) < 1e-4
    small.prefixes.budget = 1  # a snapshot larger than the whole budget is never kept
    small.prefixes.clear()
    small.forward(req(DOC, QUESTIONS))
    assert len(small.prefixes) == 0 and small.prefixes.held_bytes() == 0


def test_without_a_store_only_prompts_of_one_request_share(tiny_qwen, spy):
    # BLINK_PREFIX_CACHE_MB=0 (the ZeroGPU default): nothing outlives the call; a lone prompt runs whole.
    off = prefix_on(tiny_qwen, prefix_cache_mb=0)
    assert not off.prefixes.keeps
    lone = off.forward(req(DOC, {"team": QUESTIONS["team"]}))
    assert spy["prefix"] == [] and lone.prefill_tokens == lone.input_tokens
    shared = off.forward(req(DOC, QUESTIONS))
    evidence = render(tiny_qwen, DOC, QUESTIONS)[0].cuts[1]
    assert spy["prefix"] == [(evidence, 0, evidence)] and len(off.prefixes) == 0
    assert shared.cached_tokens == (len(QUESTIONS) - 1) * evidence  # the first question computed it for the others
    assert gap(shared.readouts, plain_readouts(tiny_qwen)) < 1e-4


def test_concurrent_callers_on_one_engine_get_their_own_answers(tiny_qwen):
    # The Batcher's worker and direct decide() calls run forwards on one engine at once, reading and filling one
    # store: every answer equals the cold, one-at-a-time path.
    on = prefix_on(tiny_qwen)
    dep = serving_without_answer_cache(on, replace(on.settings, batch_window_ms=5.0))
    work = [(doc, qs) for doc in (DOC, OTHER_DOC, DOC + " Ticket 7: a lamp.") for qs in (QUESTIONS, NEW_QUESTIONS)] * 2
    results: dict = {}

    def call(i: int) -> None:
        state, questions = work[i]
        if i % 2:
            results[i] = dep.submit(dep.request(state, questions))
        else:
            results[i] = on.forward(req(state, questions))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == len(work)
    for i, (state, questions) in enumerate(work):
        ref = plain_readouts(tiny_qwen, state, questions)
        got = results[i]
        if isinstance(got, dict):
            for key, answer in got["answers"].items():
                probs = blink.assemble(req(state, questions), ref, {q: 1.0 for q in questions})[key]["probabilities"]
                assert answer["probabilities"] == pytest.approx(probs, abs=1e-5)
        else:
            assert gap(got.readouts, ref) < 1e-4
    assert on.prefixes.held_bytes() <= on.prefixes.budget


# The row cap and the threshold are model-agnostic logic: they run on the tiny model, which is fast.


@pytest.mark.parametrize("in_place", [False, True])
def test_kv_token_cap_bounds_the_copies_held_at_once(tiny_qwen, spy, monkeypatch, in_place):
    prompts = render(tiny_qwen, DOC, QUESTIONS)
    evidence = prompts[0].cuts[1]
    longest_tail = max(len(p.ids) for p in prompts) - evidence
    assert blink.reads_in_place(torch.device("cpu"))
    if not in_place:  # the prefix joined to every row, as on a GPU
        monkeypatch.setattr(blink, "reads_in_place", lambda device: False)
    eng = prefix_on(tiny_qwen, prefix_kv_tokens=2 * (evidence + longest_tail))  # two copies of the prefix
    handle = count_rows(eng, spy)
    try:
        result = eng.forward(req(DOC, QUESTIONS))
    finally:
        handle.remove()
    # the evidence (from nothing: cheaper than after the header on this model), then the three tails: two at a time
    # where each holds a copy, else all at once
    assert not tiny_qwen.prefill_cost.continuing_pays(prompts[0].cuts[0], evidence - prompts[0].cuts[0])
    assert spy["rows"] == ([1, 3] if in_place else [1, 2, 1])
    assert gap(result.readouts, plain_readouts(tiny_qwen)) < 1e-4


def test_evidence_shorter_than_min_tokens_runs_from_the_header(tiny_qwen, spy):
    prompts = render(tiny_qwen, DOC, QUESTIONS)
    header, evidence = prompts[0].cuts
    result = prefix_on(tiny_qwen, prefix_min_tokens=evidence + 1).forward(req(DOC, QUESTIONS))
    assert spy["prefix"] == [(header, 0, header)]
    assert result.prefill_tokens == sum(len(p.ids) for p in prompts) - (len(prompts) - 1) * header
    # exactly at the threshold: the evidence is encoded once and kept
    prefix_on(tiny_qwen, prefix_min_tokens=evidence).forward(req(DOC, QUESTIONS))
    assert spy["prefix"][-1] == (evidence, 0, evidence)


def test_short_evidence_runs_from_the_header_every_time_it_is_asked(eng, spy):
    # Where a prompt is cut depends on its own tokens alone: evidence under prefix_min_tokens runs from the header on
    # every ask, never from keys an earlier pass left behind, so asking it again gives the same answers.
    prompts = render(eng, DOC, QUESTIONS)
    header, evidence = prompts[0].cuts
    on = prefix_on(eng, prefix_min_tokens=evidence + 1)
    first = on.forward(req(DOC, QUESTIONS))
    again = on.forward(req(DOC, QUESTIONS))
    assert spy["prefix"] == [(header, 0, header), (header, header, 0)]
    assert not on.prefixes.holds(tuple(prompts[0].ids[:evidence]))
    assert again.prefill_tokens == sum(len(p.ids) - header for p in prompts)
    assert gap(again.readouts, first.readouts) == 0.0


def test_a_kept_prefix_is_continued_only_where_that_costs_fewer_flops(standin):
    cost = standin.prefill_cost
    layers, width = blink.attention_shape(standin.model.config)
    body = standin.model.model
    weights = sum(p.numel() for p in body.parameters()) - body.get_input_embeddings().weight.numel()
    assert (cost.token_flops, cost.pair_flops) == (2 * weights, 4 * layers * width) and (layers, width) == (30, 576)
    # a 40-token header before 2,053 tokens of evidence: the masked rectangle costs more than the 40 tokens saved
    assert not cost.continuing_pays(40, 2053) and cost.continuing_pays(40, 200)
    assert all(cost.continuing_pays(n, n) for n in (1, 100, 10_000))  # a past as long as what follows always pays
    assert blink.encode_plan(cost, 0, [40, 2093]) == [(0, 2093)]  # the header alone is not encoded first
    assert blink.encode_plan(cost, 0, [40, 240]) == [(0, 40), (40, 240)]
    assert blink.encode_plan(cost, 40, [2093]) == [(0, 2093)]
    assert blink.encode_plan(cost, 40, [240, 300]) == [(40, 240), (240, 300)]
    assert blink.encode_plan(ALWAYS_CONTINUE, 40, [2093]) == [(40, 2093)]


def test_evidence_after_a_kept_header_is_encoded_from_nothing_where_cheaper(tiny_qwen, spy):
    on = prefix_on(tiny_qwen)
    prompt = render(tiny_qwen, DOC, QUESTIONS)[0]
    header, evidence = prompt.cuts
    assert not on.prefill_cost.continuing_pays(header, evidence - header)  # the tiny model's attention dominates
    on.forward(req("Ticket 1: a router.", {"team": QUESTIONS["team"]}))  # another request keeps the header
    assert on.prefixes.get(tuple(prompt.ids[:header])) is not None
    result = on.forward(req(DOC, QUESTIONS))
    assert spy["prefix"][-1] == (evidence, 0, evidence) and result.cached_tokens == (len(QUESTIONS) - 1) * evidence
    assert gap(result.readouts, plain_readouts(tiny_qwen)) < 1e-4
    assert on.prefixes.get(tuple(prompt.ids[:evidence])) is not None  # kept for the next request all the same


def test_packed_requests_each_keep_their_own_prefix(tiny_qwen, spy, monkeypatch):
    # decide_many and the Batcher pack several requests into one forward: each request's questions still share
    # that request's evidence, while the requests share only the header.
    first, second = render(tiny_qwen, DOC, QUESTIONS), render(tiny_qwen, OTHER_DOC, QUESTIONS)
    own = [work[0].cuts[1] for work in (first, second)]
    eng = prefix_on(tiny_qwen)
    monkeypatch.setattr(eng, "prefill_cost", ALWAYS_CONTINUE)  # the second request's evidence continues the header
    jobs = [eng.prepare(req(DOC, QUESTIONS)), eng.prepare(req(OTHER_DOC, QUESTIONS))]
    assert [[p.ids for p in job.work] for job in jobs] == [[p.ids for p in work] for work in (first, second)]
    packed = eng.run(jobs)
    header = first[0].cuts[0]
    assert sorted(spy["prefix"]) == sorted([(own[0], 0, own[0]), (own[1], header, own[1] - header)])
    computed = sum(len(p.ids) for p in first + second) - sum((len(QUESTIONS) - 1) * n for n in own) - header
    assert sum(r.prefill_tokens for r in packed) == computed and [r.batched_requests for r in packed] == [2, 2]
    # each request's first question computed its evidence (the second's after the header the first computed)
    assert [r.cached_tokens for r in packed] == [(len(QUESTIONS) - 1) * own[0], header + (len(QUESTIONS) - 1) * own[1]]
    assert all(r.input_tokens - r.cached_tokens == r.prefill_tokens for r in packed)
    assert gap(packed[0].readouts, plain_readouts(tiny_qwen)) < 1e-4
    assert gap(packed[1].readouts, plain_readouts(tiny_qwen, OTHER_DOC)) < 1e-4


def one_token_tails(eng: blink.TorchEngine) -> tuple[list[list[int]], list[list[int]], list[tuple[int, ...]]]:
    """Three prompts that differ only in their last token: each tail is one token, right after the prefix."""
    base = render(eng, DOC, {"team": QUESTIONS["team"]})[0]
    seqs = [base.ids[:-1] + [t] for t in (base.ids[-1], eng.label_ids[0], eng.label_ids[1])]
    cut = len(base.ids) - 1
    return seqs, [base.cand] * len(seqs), [(base.cuts[0], cut)] * len(seqs)


def forward_rows(eng: blink.TorchEngine, seqs, cands, cuts, prefix: bool) -> list:
    """blink's forward over raw prompts, with shared prefixes on or off."""
    return blink._forward((prefix_on(eng) if prefix else plain_engine(eng)).key, seqs, cands, cuts)[0]


def test_one_token_tails(eng, spy):
    # Tails of a single token take the models' one-step paths (Qwen3.5 updates its conv state in place).
    seqs, cands, cuts = one_token_tails(eng)
    shared_rows = forward_rows(eng, seqs, cands, cuts, prefix=True)
    assert spy["prefix"] == [(len(seqs[0]) - 1, 0, len(seqs[0]) - 1)]
    assert rows_gap(shared_rows, forward_rows(eng, seqs, cands, cuts, prefix=False)) < 1e-4


@pytest.mark.parametrize("state", ["conv_states", "recurrent_states"])
def test_linear_attention_states_carry_the_prefix(tiny_qwen, monkeypatch, state):
    # The parity above can fail: a tail run against a cache whose linear-attention state was reset reads other
    # logits, so both states must be copied along the batch axis, not only the keys and values.
    seqs, cands, cuts = one_token_tails(tiny_qwen)
    copy_cache = blink._copy_cache

    def reset(cache, repeats=1, keep=True, **options):
        cache = copy_cache(cache, repeats, keep, **options)
        for layer in cache.layers:
            for held in (getattr(layer, state, None) or {}).values():
                held.zero_()
        return cache

    monkeypatch.setattr(blink, "_copy_cache", reset)
    broken = forward_rows(tiny_qwen, seqs, cands, cuts, prefix=True)
    assert rows_gap(broken, forward_rows(tiny_qwen, seqs, cands, cuts, prefix=False)) > 1e-3


def test_copy_cache_copies_every_state(tiny_qwen):
    ids = torch.tensor([render(tiny_qwen, DOC, {"team": QUESTIONS["team"]})[0].ids])
    with torch.no_grad():
        cache = tiny_qwen.backbone()(input_ids=ids, use_cache=True).cache
    for repeats in (1, 3):
        big = blink._copy_cache(cache, repeats)
        kinds = set()
        for small, large in zip(cache.layers, big.layers):
            for name in ("keys", "values"):
                if torch.is_tensor(getattr(small, name, None)) and getattr(small, name).numel():
                    kinds.add(name)
                    # a view, never written: the forward joins new keys into a new tensor (next test)
                    assert torch.equal(getattr(large, name), getattr(small, name).expand(repeats, -1, -1, -1))
            for name in ("conv_states", "recurrent_states"):
                for k, v in (getattr(small, name, None) or {}).items():
                    kinds.add(name)
                    got = getattr(large, name)[k]
                    assert got.shape[0] == repeats and torch.equal(got, v.expand(repeats, *v.shape[1:]))
                    assert got.data_ptr() != v.data_ptr()  # a copy: the forward writes into it
            for name in ("has_previous_state", "is_conv_states_initialized"):
                if isinstance(getattr(small, name, None), dict):
                    assert getattr(large, name) == getattr(small, name)
                    assert getattr(large, name) is not getattr(small, name)  # the forward sets these flags too
        assert kinds == {"keys", "values", "conv_states", "recurrent_states"}
    assert (
        blink.cache_bytes(cache)
        == sum(t.numel() * t.element_size() for layer in cache.layers for t in blink._state_tensors(layer))
        > 0
    )  # no views: the tensors' bytes
    sliced = blink._copy_cache(cache)
    sliced.layers[1].keys = cache.layers[1].keys[..., :1, :]  # a view keeps its whole base alive
    assert blink.cache_bytes(sliced) == blink.cache_bytes(cache)


@pytest.mark.parametrize("keep", [True, False])
def test_a_forward_on_a_copy_leaves_the_prefix_as_it_was(tiny_qwen, keep):
    # Tails run against views of the prefix's keys: every tensor of the kept snapshot stays as it was, and a copy
    # that keeps nothing (keep=False, the tails' path) still holds the prefix alone afterwards.
    prompt = render(tiny_qwen, DOC, {"team": QUESTIONS["team"]})[0]
    cut = prompt.cuts[-1]
    with torch.no_grad():
        cache = tiny_qwen.backbone()(input_ids=torch.tensor([prompt.ids[:cut]]), use_cache=True).cache
        before = [t.clone() for layer in cache.layers for t in blink._state_tensors(layer)]
        tail = torch.tensor([prompt.ids[cut:]] * 2)
        past = blink._copy_cache(cache, 2, keep=keep)
        tiny_qwen.backbone()(input_ids=tail, cache=past, use_cache=True)
    after = [t for layer in cache.layers for t in blink._state_tensors(layer)]
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and len(before) == len(after)
    held = {layer.keys.shape[-2] for layer in past.layers if blink._joins_keys(layer)}
    assert held == {len(prompt.ids) if keep else cut}


def test_defaults_follow_the_hardware():
    cpu = blink.Settings()
    assert (cpu.prefix_cache, cpu.token_budget, cpu.prefix_kv_tokens, cpu.prefix_cache_mb) == (True, 4096, 8192, 1024)
    gpu = blink.Settings(gpu=True)
    assert gpu.compute_dtype == "bfloat16" and (gpu.token_budget, gpu.prefix_kv_tokens) == (32768, 131072)
    assert gpu.prefix_cache_mb == 1024
    assert gpu.prefix_cache is True  # bfloat16, the GPU default: on, as bench/drift.py measured it safe
    assert blink.Settings(gpu=True, zero_gpu=True).prefix_cache_mb == 0  # a forked worker's memory never returns
    assert blink.Settings(dtype="float16").prefix_cache is False  # float16 is not measured: the plain path
    assert blink.Settings(dtype="bfloat16").prefix_cache is True and blink.Settings(dtype="float32").prefix_cache
    env = blink.Settings.from_env(
        {"BLINK_PREFIX_CACHE": "off", "BLINK_TOKEN_BUDGET": "512", "BLINK_PREFIX_CACHE_MB": "0"}, gpu=False
    )
    assert (env.prefix_cache, env.token_budget, env.prefix_cache_mb) == (False, 512, 0)
    with pytest.raises(blink.BlinkError, match="BLINK_PREFIX_CACHE_MB must be a whole number"):
        blink.Settings.from_env({"BLINK_PREFIX_CACHE_MB": "-1"}, gpu=False)


def joined_attention(query, prefix_k, prefix_v, new_k, new_v):
    """The reference: the prefix joined to each row's new keys, repeated per query head, under the causal mask that
    ends at the bottom right, in float64."""
    rows, heads, length, _ = query.shape
    per, past = heads // prefix_k.shape[1], prefix_k.shape[-2]
    k = torch.cat([prefix_k.expand(rows, -1, -1, -1), new_k], -2).repeat_interleave(per, 1).double()
    v = torch.cat([prefix_v.expand(rows, -1, -1, -1), new_v], -2).repeat_interleave(per, 1).double()
    allowed = torch.ones(length, past + length, dtype=torch.bool).tril(past)
    return torch.nn.functional.scaled_dot_product_attention(query.double(), k, v, attn_mask=allowed)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows, length, past, heads, groups", [(1, 5, 40, 9, 3), (4, 17, 300, 9, 3), (3, 70, 64, 4, 4)])
def test_tail_attention_reads_the_prefix_once_and_equals_the_joined(
    dtype, tolerance, rows, length, past, heads, groups
):
    torch.manual_seed(rows * 1000 + past)
    query = torch.randn(rows, heads, length, 16, dtype=dtype)
    prefix_k, prefix_v = (torch.randn(1, groups, past, 16, dtype=dtype) for _ in range(2))
    new_k, new_v = (torch.randn(rows, groups, length, 16, dtype=dtype) for _ in range(2))
    want = joined_attention(query, prefix_k, prefix_v, new_k, new_v)
    got = blink._tail_attention(query, prefix_k, prefix_v, new_k, new_v, 16**-0.5)
    assert got.shape == query.shape and got.dtype == dtype
    assert (got.double() - want).abs().max() < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tails_attention_is_its_own_whatever_runs_beside_it(dtype, monkeypatch):
    # The same row alone, beside other rows, padded to a longer length, and split into blocks of rows and of queries
    # gives the same numbers, bit for bit: no sum over keys depends on the batch.
    torch.manual_seed(7)
    rows, heads, groups, past, length, pad = 5, 9, 3, 90, 37, 50
    query = torch.randn(rows, heads, length + pad, 16, dtype=dtype)
    prefix_k, prefix_v = (torch.randn(1, groups, past, 16, dtype=dtype) for _ in range(2))
    new_k, new_v = (torch.randn(rows, groups, length + pad, 16, dtype=dtype) for _ in range(2))
    first = (query[:1, :, :length], prefix_k, prefix_v, new_k[:1, :, :length], new_v[:1, :, :length], None)
    alone = blink._tail_attention(*first)
    padded = blink._tail_attention(query, prefix_k, prefix_v, new_k, new_v, None)
    assert torch.equal(padded[:1, :, :length], alone)
    monkeypatch.setattr(blink, "TAIL_ATTENTION_SCORES", heads * (past + 128) * 8)  # blocks of 8 queries, one row each
    assert torch.equal(blink._tail_attention(query, prefix_k, prefix_v, new_k, new_v, None), padded)


@pytest.mark.parametrize("scores", [2**22, 9 * (90 + 128) * 8])  # rows folded in blocks; one row, 8 queries a block
def test_a_tails_padding_is_not_attended(scores, monkeypatch):
    # Queries past a row's real length are NaN here: each row's real queries answer as the row alone (within rounding:
    # a one-token row alone takes another product kernel), and the padding is left zero. Computing a padded query
    # would put NaN in its output.
    monkeypatch.setattr(blink, "TAIL_ATTENTION_SCORES", scores)
    torch.manual_seed(8)
    lengths, heads, groups, past = (37, 12, 50, 1), 9, 3, 90
    query = torch.randn(len(lengths), heads, max(lengths), 16)
    prefix_k, prefix_v = (torch.randn(1, groups, past, 16) for _ in range(2))
    new_k, new_v = (torch.randn(len(lengths), groups, max(lengths), 16) for _ in range(2))
    for r, n in enumerate(lengths):
        query[r, :, n:] = float("nan")
    got = blink._tail_attention(query, prefix_k, prefix_v, new_k, new_v, None, lengths)
    for r, n in enumerate(lengths):
        alone = (query[r : r + 1, :, :n], prefix_k, prefix_v, new_k[r : r + 1, :, :n], new_v[r : r + 1, :, :n], None)
        assert (got[r : r + 1, :, :n] - blink._tail_attention(*alone)).abs().max() < 1e-5
        if scores < 2**22:  # one row a block: nothing past its length is computed
            assert not got[r, :, n:].any()
    assert got.isnan().any() == (scores == 2**22)  # folded blocks run to their longest row


def test_long_prefixes_are_read_in_place_and_answer_as_when_joined(eng, monkeypatch):
    # On a CPU the tails of one request read its evidence in place, once for every row (_tail_attention); the same
    # forward with the prefix joined to every row (a GPU's path) and the plain path give the same numbers.
    prompts = render(eng, DOC, QUESTIONS)
    seqs, cands, cuts = [p.ids for p in prompts], [p.cand for p in prompts], [p.cuts for p in prompts]
    calls = []
    tail = blink._tail_attention
    monkeypatch.setattr(blink, "_tail_attention", lambda *args: calls.append(1) or tail(*args))
    read_once = forward_rows(eng, seqs, cands, cuts, prefix=True)
    assert calls  # the evidence was read in place
    monkeypatch.setattr(blink, "reads_in_place", lambda device: False)
    count = len(calls)
    joined = forward_rows(eng, seqs, cands, cuts, prefix=True)  # torch's kernel under the bottom-right mask
    assert len(calls) == count  # every tail joined to the prefix
    assert rows_gap(read_once, joined) < 1e-4
    assert rows_gap(read_once, forward_rows(eng, seqs, cands, cuts, prefix=False)) < 1e-4
