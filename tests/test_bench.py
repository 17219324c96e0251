"""The benchmark's peers compute what they claim, on the tiny Qwen3.5 model, and the model comparison grades what
blink answers, on the stand-in (no timing here: bench/ measures)."""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import blink
from bench import models, run, vllm_check
from bench.lib import answers, arms, grid, harness, report, servers, workloads
from bench.peers import decision as peers
from bench.peers import llamacpp, throughput
from bench.workers import isolated

STATE = "Ticket #1: the customer's router stopped working after an update and they asked for a replacement."
QUESTION = {
    "type": "choice",
    "instructions": "Which team should handle ticket #1?",
    "criteria": ["billing", "shipping", "technical support", "account security"],
}
LLAMA_QUESTIONS = {  # two choices and a noul: the llama.cpp arms' prompts share a prefix
    "q": QUESTION,
    "r": {**QUESTION, "instructions": "Which team owns routers?"},
    "n": {"type": "noul", "instructions": "Is the router broken?"},
}


def test_encode_pair_splits_as_lm_evaluation_harness(tiny_qwen):
    tok = tiny_qwen.tok
    ctx, cont = grid.encode_pair(tok, "the answer is ", "yes")
    assert ctx == tok("the answer is", add_special_tokens=False)["input_ids"]  # the trailing space moved over
    assert ctx + cont == tok("the answer is yes", add_special_tokens=False)["input_ids"]


def test_per_option_scores_are_continuation_log_likelihoods(tiny_qwen):
    # Cross-check against the model's own shifted cross-entropy over the continuation tokens.
    run_ = grid.per_option_one(tiny_qwen, STATE, "q", QUESTION)
    context, _ = grid.prompt_text(tiny_qwen, STATE, "q", QUESTION)
    scores = []
    with torch.no_grad():
        for option in QUESTION["criteria"]:
            ctx, cont = grid.encode_pair(tiny_qwen.tok, context, option)
            labels = torch.tensor([[-100] * len(ctx) + cont])
            loss = tiny_qwen.model(input_ids=torch.tensor([ctx + cont]), labels=labels).loss
            scores.append(-float(loss) * len(cont))
    assert max(abs(a - b) for a, b in zip(run_.extra["sum_logprobs"], scores)) < 1e-3
    assert run_.choices == {"q": QUESTION["criteria"][max(range(4), key=lambda i: (scores[i], -i))]}
    assert run_.prefill_tokens == sum(n for _, n in run_.extra["spans"])


def test_unbatched_reads_the_same_label_logits_as_blink(tiny_qwen):
    questions = {"q": QUESTION, "r": {**QUESTION, "instructions": "Which team owns routers?"}}
    blink_run = grid.blink_request(tiny_qwen, STATE, questions, prefix=False)
    for qkey, q in questions.items():
        by_hand = grid.unbatched_one(tiny_qwen, STATE, qkey, q)
        assert grid.label_logit_gap(by_hand.rows, {qkey: blink_run.rows[qkey]}) < 1e-4
        assert by_hand.choices[qkey] == blink_run.choices[qkey]


@pytest.mark.parametrize(
    ("reply", "label"),
    [("B) shipping", "B"), ("The answer is C.", "C"), ("I think D", "D"), ("no letter here", None), ("AB", None)],
)
def test_generated_reply_is_parsed_to_an_offered_label(reply, label):
    assert grid.parse_label(reply, ["A", "B", "C", "D"]) == label


def test_prefill_flops_count_every_key_of_every_computed_token(tiny_qwen):
    layers, width = blink.attention_shape(tiny_qwen.model.config)
    assert layers == 2  # the tiny model's two full-attention layers; its linear layers have no quadratic term
    spans = [(0, 5), (5, 3)]  # a 5-token prefix, then a 3-token tail against it
    keys = sum(range(1, 6)) + sum(range(6, 9))
    cost = tiny_qwen.prefill_cost
    assert cost.flops(spans) == cost.token_flops * 8 + 4 * layers * width * keys


def test_the_fbgemm_arm_gives_each_row_its_own_grid_whatever_rows_share_the_call():
    # drift --schemes' fbgemm arms: a per-tensor int8 kernel made per-token (rows scaled to max 1, a row of +1 and -1
    # appended), so a row's product does not depend on the rows beside it, and stays on the 7-bit grid's error
    from bench import drift

    torch.manual_seed(0)
    weight = torch.randn(48, 64) * 0.05
    layer = SimpleNamespace(smoothing=torch.ones(64), bias=None)
    drift.fbgemm_pack(layer, weight)
    rows = torch.randn(6, 64) * torch.tensor([0.01, 0.1, 1.0, 10.0, 100.0, 3.0])[:, None]  # scales far apart
    together = drift.fbgemm_forward(layer, rows)
    for i in range(len(rows)):
        alone = drift.fbgemm_forward(layer, rows[i : i + 1])[0]
        exact = rows[i] @ weight.T
        assert torch.allclose(alone, together[i], rtol=1e-5, atol=1e-6 * exact.abs().max())
        assert (alone - exact).abs().max() <= 0.1 * exact.abs().max()  # 7-bit inputs, int8 weights


def test_subsample_and_percentile_rules():
    assert run.ladder(64, 2100, 24000) == 8 and run.ladder(64, 330, 24000) == 64 and run.ladder(8, 9000, 1) == 1
    assert harness.percentile([1, 2, 3, 4], 50) == 2.5 and harness.percentile([7], 99) == 7
    assert list(workloads.questions(8, 4, 3)) == list(workloads.questions(64, 4, 3))[:8]  # nested question sets


def test_prefix_arm_shares_the_evidence_and_leaves_the_engine_as_it_was(tiny_qwen):
    before = tiny_qwen.settings
    doc = workloads.document(tiny_qwen.tok, 400)
    qs = workloads.questions(3, 4, workloads.ticket_count(doc))
    plain = grid.blink_request(tiny_qwen, doc, qs, prefix=False)
    shared = grid.blink_request(tiny_qwen, doc, qs, prefix=True)
    assert tiny_qwen.settings is before and before.prefix_cache  # on by default in float32
    assert plain.extra["shared_prefix_tokens"] == 0 and shared.extra["shared_prefix_tokens"] > 256
    prompts = tiny_qwen.render(grid.request(tiny_qwen, doc, qs))
    seqs = [p.ids for p in prompts]
    assert shared.prefill_tokens == sum(n for _, n in run.spans_of(tiny_qwen, prompts, True)) < plain.prefill_tokens
    assert plain.prefill_tokens == sum(map(len, seqs)) == sum(n for _, n in run.spans_of(tiny_qwen, prompts, False))
    assert grid.label_logit_gap(plain.rows, shared.rows) < 1e-4 and plain.choices == shared.choices


def test_system_one_form_is_what_transformers_accepts():
    got = workloads.system_one(
        "s",
        {
            "c": {"type": "choice", "criteria": ["a", 2], "permute": 2},
            "n": {"type": "noul", "instructions": "x?", "criteria": {"yes": "y", "no": None}},
            "s": {"type": "score", "criteria": ["lo", "hi"], "abstain": {"min_confidence": 0.5}},
        },
    )
    assert got == {
        "state": "s",
        "questions": {
            "c": {"type": "choice", "criteria": {"a": None, "2": None}},
            "n": {"type": "noul", "instructions": "x?", "criteria": {"true": "y", "false": None}},
            "s": {"type": "score", "criteria": ["lo", "hi"]},
        },
    }
    from transformers.decision import DecisionConfig
    from transformers.decision.template_utils import parse_questions

    assert [q.name for q in parse_questions(got["questions"], DecisionConfig())] == ["c", "n", "s"]


def test_decision_cases_time_both_sides_and_check_blink_against_unbatched(tiny_qwen):
    # The pipeline arm runs on blink's weights as from_pretrained loads them (torch's own kernels) with a tokenizer
    # of its own, one forward per question; blink at its defaults reads the document kept from the first case in
    # the second.
    from transformers.decision import DecisionConfig

    pipe = peers.decision_pipeline(tiny_qwen, DecisionConfig(labels={"noul": ["A", "B"]}))  # Yes/No: not one token
    assert pipe.model is grid.user_model(tiny_qwen) and pipe.tokenizer is not tiny_qwen.tok
    assert not any("forward" in vars(m) for m in pipe.model.modules())  # no layer runs blink's oneDNN forward
    assert torch.equal(pipe.model.lm_head.weight, tiny_qwen.model.lm_head.weight)
    forwards = []
    handle = pipe.model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        pipe(workloads.system_one("a log", workloads.questions(3, 4, 1)))
    finally:
        handle.remove()
    assert len(forwards) == 3
    assert "<|mark|>" not in tiny_qwen.tok.get_vocab()  # blink's tokenizer is untouched
    cfg = {"doc": 300, "questions": 3, "options": 4, "reps": 1, "short_per_rep": 2}
    rows = peers.decision_cases(tiny_qwen, cfg, {"pipeline": pipe})
    assert set(rows) == set(workloads.CASES)
    for row in rows.values():
        assert row["vs_unbatched"]["picks_differ"] == [] and row["vs_unbatched"]["max_prob_diff"] < 1e-4
        assert row["vs_unbatched"]["questions"] == row["questions"] * row["requests_per_rep"]
        arms_ = row["arms"]
        assert len(arms_["pipeline"]["wall_s"]) == len(arms_["blink"]["wall_s"]) == row["requests_per_rep"]
        # the ratio is the pipeline's time over blink's, each the sum of its timed runs
        assert arms_["pipeline"]["total_wall_s"] == pytest.approx(sum(arms_["pipeline"]["wall_s"]), abs=1e-3)
        assert row["vs_pipeline"]["wall"] == round(
            arms_["pipeline"]["total_wall_s"] / arms_["blink"]["total_wall_s"], 2
        )
        # blink says what it computed (its meta); a bare pipeline does not, so it has no utilisation
        assert arms_["blink"]["computed_tokens"] > 0 and arms_["blink"]["dtype"] == "float32"
        assert arms_["pipeline"]["computed_tokens"] is None and "model_gflop" not in arms_["pipeline"]
    assert rows["short"]["requests_per_rep"] == 2 and rows["document"]["requests_per_rep"] == 1
    again = rows["again"]
    assert again["cached_tokens"] > 0 and again["prefill_tokens"] + again["cached_tokens"] == again["prompt_tokens"]
    assert again["arms"]["blink"]["computed_tokens"] == again["prefill_tokens"]  # one request: its meta's count


def test_peers_load_the_checkpoint_as_a_user_does_and_a_same_dtype_pipeline_loads_its_own(tiny_qwen_dir, tiny_qwen):
    # blink in bfloat16 (its default on a CPU that computes it natively): the peers get from_pretrained's default
    # load, the float32 checkpoint, and pipeline_bfloat16 is the pipeline as a user runs it at bfloat16: its own
    # model and tokenizer loaded from the checkpoint, not blink's model (whose packed weights are blink's work)
    bf16 = blink.TorchEngine(tiny_qwen_dir, settings=blink.Settings(dtype="bfloat16"))
    assert grid.checkpoint_dtype(bf16) == torch.float32
    assert grid.user_model(bf16).dtype == torch.float32 and grid.user_model(bf16) is not bf16.model
    body = workloads.system_one(STATE, workloads.questions(3, 4, 1))
    with contextlib.ExitStack() as stack:
        pipes, skipped = peers.start_peers(peers.PeerContext(bf16, 1, "", stack), ["pipeline_bfloat16"])
        peer = pipes["pipeline_bfloat16"]
        assert skipped == [] and peer.model is not bf16.model and peer.model is not grid.user_model(bf16)
        assert peer.model.dtype == torch.bfloat16 and peer.dtype == "bfloat16"
        assert peer.pipe.tokenizer is not bf16.tok
        assert not any("forward" in vars(m) for m in peer.model.modules())  # torch's own layers, nothing of blink's
        name, weight = next((n, w) for n, w in grid.user_model(bf16).named_parameters() if "mlp" in n)
        assert torch.equal(dict(peer.model.named_parameters())[name], weight.to(torch.bfloat16))  # the checkpoint's
        # it counts the prompt tokens its model computes: every forward's input_ids (one prompt per question)
        prompts = peer.pipe.preprocess(body)["prompts"]
        peer(body)
        assert peer.computed_tokens() == sum(inputs["input_ids"].numel() for inputs, _ in prompts) > 0
        # in float32 there is no second pipeline; the peers share blink's model where blink runs torch's kernels too
        pipes, skipped = peers.start_peers(peers.PeerContext(tiny_qwen, 1, "", stack), ["pipeline_bfloat16"])
    assert pipes == {} and skipped == [
        {"target": "pipeline_bfloat16", "skipped": "blink computes in float32, the dtype the pipeline arm already runs"}
    ]
    peer(body)  # the stack closed: it no longer counts
    assert peer.computed_tokens() == sum(inputs["input_ids"].numel() for inputs, _ in prompts)
    assert grid.user_model(tiny_qwen).dtype == torch.float32
    assert tiny_qwen.gated_delta_layers  # blink's own Gated DeltaNet path: the peers load the model anew
    assert grid.user_model(tiny_qwen) is not tiny_qwen.model
    assert not any("forward" in vars(m) for m in grid.user_model(tiny_qwen).modules())


def test_the_same_dtype_pipeline_is_what_pipeline_loads_from_the_checkpoint(standin):
    # on a causal LM such as the stand-in, pipeline("decision", model=<checkpoint>, dtype=...) loads the model the
    # arm loads: the same class, the same weights, at that dtype
    from transformers import pipeline

    theirs = pipeline("decision", model=standin.source, dtype=torch.bfloat16).model
    mine = peers.own_pipeline(standin, torch.bfloat16).model
    assert type(mine) is type(theirs) and mine.dtype == theirs.dtype == torch.bfloat16 and mine is not standin.model
    assert all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(), theirs.state_dict().values()))


def test_model_flop_utilisation_is_the_weights_flops_over_the_time_against_the_probe_at_its_dtype():
    assert harness.utilisation(2e11, 2.0, 200.0) == pytest.approx(0.5)  # 100 GFLOP/s of a 200 GFLOP/s probe
    assert harness.utilisation(1e9, 0.0, 200.0) is None and harness.utilisation(1e9, 1.0, 0.0) is None
    cost = blink.PrefillCost(token_flops=2e8, pair_flops=4e3)  # a model of 1e8 non-embedding weights
    work = peers.computed_work(cost, [300, 100], 2.0, "bfloat16")  # 400 tokens in 2 s: 80 GFLOP, 40 GFLOP/s
    assert work == {"computed_tokens": 400, "model_gflop": 80.0, "gflops": 40.0, "dtype": "bfloat16"}
    assert peers.computed_work(cost, [300, None], 2.0, "q4_1") == {"computed_tokens": None, "dtype": "q4_1"}
    # fabricated times and probes: each arm against the probe at the dtype it computes in (float32's where its
    # dtype has none of its own)
    decision = {
        "short": {
            "arms": {
                "blink": {**work, "total_wall_s": 2.0},
                "llama.cpp": {**peers.computed_work(cost, [200], 4.0, "q4_1"), "total_wall_s": 4.0},
                "pipeline": {"computed_tokens": None, "dtype": "float32", "total_wall_s": 1.0},
            }
        }
    }
    ran = harness.Run("run", ["--threads", "0"], "a test run")
    ran.device, ran.probes, ran.dtype_probes = torch.device("cpu"), [50.0, 40.0], {"bfloat16": [150.0, 160.0]}
    assert ran.matmul_probe("bfloat16") == ("bfloat16", 160.0) and ran.matmul_probe("q4_1") == ("float32", 50.0)
    peers.utilisation(decision, ran.matmul_probe)
    arms_ = decision["short"]["arms"]
    assert (arms_["blink"]["utilisation"], arms_["blink"]["probe_dtype"]) == (0.25, "bfloat16")  # 40 of 160
    assert (arms_["llama.cpp"]["utilisation"], arms_["llama.cpp"]["probe_dtype"]) == (0.2, "float32")  # 10 of 50
    assert "utilisation" not in arms_["pipeline"]


def test_settle_waits_until_a_peers_processes_go_idle():
    used = iter([0.0, 1.0, 2.0, 2.0])  # fabricated CPU seconds: busy for two intervals, then idle
    calls = []

    def cpu() -> float:
        calls.append(1)
        return next(used)

    assert harness.settle(cpu, interval_s=0.001) >= 0.002 and len(calls) == 4
    busy = iter(float(i) for i in range(10_000))  # never idle: given up at the cap
    assert harness.settle(lambda: next(busy), interval_s=0.001, cap_s=0.02) >= 0.02


def test_http_workloads_distinct_requests_are_all_new_and_repeated_ones_repeat(tiny_qwen):
    clients = [1, 2, 4]
    distinct = workloads.http_workload(tiny_qwen.tok, workloads.DISTINCT, clients, 4, 40)
    repeated = workloads.http_workload(tiny_qwen.tok, workloads.REPEATED, clients, 4, 40)

    def key(body: dict) -> str:
        return json.dumps(body, sort_keys=True)

    sent = [key(b) for level in distinct.levels.values() for b in level]
    assert list(distinct.levels) == clients and all(len(level) == 4 for level in distinct.levels.values())
    assert len(set(sent)) == len(sent) == 12 and distinct.primed == []  # every request new, at every level
    assert key(distinct.warm) not in sent  # the unclocked warm-up is none of the timed requests
    asked = [key(b) for b in repeated.primed]
    assert len(set(asked)) == len(asked) == 4
    for level in repeated.levels.values():  # every timed request was asked before: sent again
        assert [key(b) for b in level] == asked
    assert key(repeated.warm) not in asked and not set(asked) & set(sent)  # documents of its own
    with pytest.raises(ValueError, match="kind"):
        workloads.http_workload(tiny_qwen.tok, "mixed", clients, 4, 40)


def test_decision_targets_hold_blink_to_the_same_dtype_pipeline_vllm_and_the_float32_path():
    # fabricated ratios (only the targets' logic is checked): blink in bfloat16, both own-prompt pipelines, blink_vllm
    def case(ratio: float, gap: float) -> dict:
        vs = {"wall": ratio, "cpu": ratio, "picks_differ_from_blink": []}
        return {
            "questions": 1,
            "prompt_tokens": 100,
            "arms": {"blink": {"dtype": "bfloat16"}, "pipeline": {"dtype": "float32"}},
            **{f"vs_{p}": vs for p in ("pipeline", "blink_vllm")},
            "vs_pipeline_bfloat16": {**vs, "wall": ratio / 2, "cpu": ratio / 2},
            "vs_unbatched": {"questions": 1, "picks_differ": [], "max_prob_diff": gap},
        }

    decision = {c: case(3.0, 0.01) for c in workloads.CASES}
    for row in decision.values():
        row["arms"]["pipeline_bfloat16"] = {"dtype": "bfloat16"}
    got = {(t.get("case"), t.get("peer")): t for t in run.decision_targets(decision, quick=False)}
    assert [got[(c, "pipeline_bfloat16")]["threshold"] for c in workloads.CASES] == [2.0, 4.0, 1.2]
    assert [got[(c, "pipeline_bfloat16")]["met"] for c in workloads.CASES] == [False, False, True]  # 1.5x each
    assert all(got[(c, "blink_vllm")]["met"] for c in workloads.CASES) and (None, None) in got
    assert got[(None, None)]["met"] is True
    decision["short"]["vs_unbatched"]["max_prob_diff"] = 0.04  # no pick flipped, but too far from float32
    assert run.decision_targets(decision, quick=False)[-1]["met"] is False
    # blink in float32: the float32 pipeline is the same-dtype one; --quick evaluates nothing
    for row in decision.values():
        row["arms"]["blink"]["dtype"] = "float32"
        del row["arms"]["pipeline_bfloat16"]
    targets = run.decision_targets(decision, quick=True)
    assert {t.get("peer") for t in targets} == {"pipeline", "blink_vllm", None}
    assert all(t["met"] is None for t in targets if t["threshold"])


class FakeLlama:
    """A stand-in for llama_cpp.Llama (fabricated: it lets the arm be checked exactly on the tiny model, which has no
    GGUF file), kept to what the arm relies on: eval() appends ids after the first n_tokens held (dropping the rest,
    as llama.cpp's KV cache does) and leaves the last position's logits, computed here by the tiny model over every
    id held. The real llama.cpp is checked on the stand-in below."""

    def __init__(self, model, **kwargs):
        self.model, self.kwargs = model, kwargs
        self.n_tokens, self.ids, self.evaluated = 0, [], 0
        self._ctx = SimpleNamespace(ctx=self, kv_cache_seq_rm=lambda seq, p0, p1: True)  # a KV cache: cut anywhere

    def n_vocab(self) -> int:
        return self.model.config.vocab_size

    def eval(self, tokens):
        self.ids = self.ids[: self.n_tokens] + list(tokens)
        self.n_tokens, self.evaluated = len(self.ids), self.evaluated + len(tokens)
        with torch.no_grad():
            last = self.model(input_ids=torch.tensor([self.ids])).logits[0, -1].float().tolist()
        self.buffer = (ctypes.c_float * len(last))(*last)


def fake_llama_cpp(model) -> SimpleNamespace:
    """The names of llama_cpp the arm uses, over FakeLlama (a model of full attention only: no recurrent layer)."""
    return SimpleNamespace(
        Llama=lambda **kwargs: FakeLlama(model, **kwargs),
        llama_get_logits_ith=lambda ctx, i: ctypes.cast(ctx.buffer, ctypes.POINTER(ctypes.c_float)),
        llama_model_is_recurrent=lambda model: False,
        llama_model_is_hybrid=lambda model: False,
    )


def test_llama_arms_read_blinks_prompt_ids_and_reuse_the_common_prefix(tiny_qwen):
    state, questions = STATE, LLAMA_QUESTIONS
    body = workloads.system_one(state, questions)
    want = blink.Deployment.serving(tiny_qwen).decide(state, questions)["answers"]
    prompts = tiny_qwen.render(blink.parse_request(state, body["questions"]))
    readers = [llamacpp.LlamaReader("model.gguf", 512, 1, r, fake_llama_cpp(tiny_qwen.model)) for r in (False, True)]
    plain, reuse = (llamacpp.LlamaArm(tiny_qwen, isolated.Local(reader)) for reader in readers)
    assert readers[0].llm.kwargs["n_threads"] == readers[0].llm.kwargs["n_threads_batch"] == 1
    for arm in (plain, reuse):
        got = arm(body)
        assert {k: answers.pick(a) for k, a in got.items()} == {k: answers.pick(a) for k, a in want.items()}
        for key, answer in got.items():
            mine = want[key]["probabilities"]
            assert max(abs(p - mine[k]) for k, p in answer["probabilities"].items()) < 1e-4
            assert abs(answer["label_mass"] - want[key]["label_mass"]) < 1e-4  # the full-vocabulary log-sum-exp
        assert arm.evaluated == arm.reader.held.llm.evaluated
    shared = sum(llamacpp.common_prefix(a.ids, b.ids) for a, b in zip(prompts, prompts[1:]))
    assert plain.evaluated == sum(len(p.ids) for p in prompts)
    assert reuse.evaluated == plain.evaluated - shared and shared > 0
    before = reuse.evaluated
    reuse(body)  # the same prompts again: each runs after the one before it, the first after the last
    assert reuse.evaluated - before == sum(
        len(b.ids) - llamacpp.common_prefix(a.ids, b.ids) for a, b in zip([prompts[-1], *prompts], prompts)
    )


def real_llama_cpp():
    """llama_cpp itself: a skip where it is not installed, a failure where CI says it must be (setup --tests)."""
    if importlib.util.find_spec("llama_cpp") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but llama-cpp-python is not installed (bash tools/setup.sh --tests installs it)")
        pytest.skip(llamacpp.SKIP_NO_PACKAGE)
    import llama_cpp

    return llama_cpp


def test_llama_arms_on_real_llama_cpp_answer_as_blink_does(standin):
    """The real llama.cpp on the stand-in's Q4_1 GGUF, fed blink's ids, picks as blink does on the weights
    de-quantized from that file (float32 here), within Q4 rounding (0.038 apart, measured); its prefix reuse
    changes nothing but the work."""
    real_llama_cpp()
    state, questions = STATE, LLAMA_QUESTIONS
    body = workloads.system_one(state, questions)
    want = blink.Deployment.serving(standin).decide(state, questions)["answers"]
    with contextlib.ExitStack() as stack:  # the readers' child processes end with it
        pipes, skipped = peers.start_peers(peers.PeerContext(standin, 1, "", stack), ["llama.cpp", "llama.cpp_reuse"])
        assert skipped == [] and set(pipes) == {"llama.cpp", "llama.cpp_reuse"}
        plain, reuse = pipes["llama.cpp"], pipes["llama.cpp_reuse"]
        got = {name: arm(body) for name, arm in pipes.items()}
        for answered in got.values():
            assert answers.compare(want, answered)["picks_differ"] == []
            assert answers.compare(want, answered)["max_prob_diff"] < 0.08
        # the same computation, less of it (0.0 apart, measured)
        assert answers.compare(got["llama.cpp"], got["llama.cpp_reuse"])["max_prob_diff"] < 1e-3
        assert 0 < reuse.evaluated < plain.evaluated
        assert "AMX_INT8 = 1" not in plain.reader.call("system_info")  # setup builds it without AMX
        for arm in pipes.values():
            assert arm.elsewhere_cpu() > 0  # it computed in a child process of its own


def test_shape4b_interleaved_asks_each_case_of_every_arm_in_turn(tiny_qwen_dir):
    """shape4b --interleave's rounds over two real blink arms on the tiny Qwen3.5: every case asked of both before
    the next, a new document each round (the kept prefixes dropped before "short" and "document", kept for
    "again"), and both arms computing the same tokens."""
    from bench import shape4b

    calls = []

    class Logged:
        def __init__(self, name: str, arm):
            self.name, self.arm = name, arm

        def start(self) -> None:
            calls.append((self.name, "start"))
            self.arm.start()

        def ask(self, case: str) -> dict:
            calls.append((self.name, case))
            return self.arm.ask(case)

    threads = torch.get_num_threads()
    arms = {
        name: Logged(name, shape4b.BlinkArm(tiny_qwen_dir, shape4b.BLINK_ARMS[name], threads, 300))
        for name in ("blink", "blink_w8a8_prefix")
    }
    got = shape4b.run_rounds(arms, 2)
    one_round = []
    for case in shape4b.CASES:
        for name in arms:
            one_round += [(name, "start")] * (case != "again") + [(name, case)]
    assert calls == one_round * 2
    for case in shape4b.CASES:
        assert [len(got[name][case]["wall_s"]) for name in arms] == [2, 2]
        assert got["blink"][case]["computed_tokens"] == got["blink_w8a8_prefix"][case]["computed_tokens"] > 0
    assert got["blink"]["again"]["computed_tokens"] < got["blink"]["document"]["computed_tokens"]  # the log kept


def test_a_native_peer_that_crashes_is_an_error_naming_it_and_the_signal():
    # A segfault in the child (here: reading address 0 while it builds its object) ends the child, not this run.
    with pytest.raises(isolated.Crashed, match=r"^native lib died in its child process: SIGSEGV \(signal 11\)$"):
        isolated.Child("native lib", ctypes.string_at, 0)
    # A child that dies between calls (killed by SIGSEGV from outside, as a crash in its kernel would end it)
    child = isolated.Child("native lib", dict, a=1)
    assert child.call("get", "a") == 1
    os.kill(child.process.pid, 11)
    with pytest.raises(isolated.Crashed, match="SIGSEGV"):
        child.call("get", "a")
    child.close()
    child = isolated.Child("dict", dict)
    with pytest.raises(RuntimeError, match="KeyError"):  # an exception inside the child is raised here, not a crash
        child.call("__getitem__", "missing")
    child.close()


def test_llama_arms_say_why_they_cannot_run_here(tiny_qwen):
    with contextlib.ExitStack() as stack:
        started, skipped = peers.start_peers(peers.PeerContext(tiny_qwen, 1, "", stack), ["llama.cpp"])
    assert started == {} and len(skipped) == 1 and skipped[0]["target"] == "llama.cpp"
    reason = skipped[0]["skipped"]
    if importlib.util.find_spec("llama_cpp") is None:
        assert reason == llamacpp.SKIP_NO_PACKAGE
    else:  # the tiny model has no GGUF file, and its test tokenizer's pre-tokenizer is none llama.cpp's converter knows
        assert "BPE pre-tokenizer was not recognized" in reason


def test_http_arm_drives_transformers_serve_and_says_why_a_side_is_missing(tiny_qwen, tmp_path):
    rows = peers.http_rows(tiny_qwen, {"doc": 40, "clients": [2], "per_level": 2}, 1, None, str(tmp_path))
    assert {r.get("workload") for r in rows if "skipped" not in r} == {workloads.DISTINCT}
    serve = [r for r in rows if r["target"] == "transformers serve /v1/systemone"]
    assert serve and serve[-1]["completed"] == 2 and serve[-1]["errors"] == [] and serve[-1]["requests_per_s"] > 0
    own = [r for r in rows if r["target"] == "blink /v1/systemone"]
    assert own and "skipped" not in own[-1], own  # blink's own app served the route: the comparison has two sides
    assert own[-1]["completed"] == 2 and own[-1]["errors"] == [] and own[-1]["requests_per_s"] > 0


def test_export_arm_is_skipped_with_the_reason_when_blink_has_no_export(tmp_path, monkeypatch):
    monkeypatch.setattr(servers, "ROOT", str(tmp_path))  # a blink.py that does not exist: the command fails
    why = peers.export_config(blink.STANDIN_MODEL, str(tmp_path / "out"))
    assert why and "python blink.py export" in why


def test_throughput_runs_answer_every_request(tiny_qwen, monkeypatch):
    docs = [workloads.document(tiny_qwen.tok, 40, seed=100 + i) for i in range(5)]
    requests = [(d, workloads.questions(1, 4, workloads.ticket_count(d))) for d in docs]
    serial = throughput.serial_run(tiny_qwen, requests, 2, 2, prefix=False)
    packed: list[int] = []  # requests per forward call, as the Batcher packed them
    run = tiny_qwen.run
    monkeypatch.setattr(tiny_qwen, "run", lambda jobs: packed.append(len(jobs)) or run(jobs))
    batched = throughput.batcher_run(tiny_qwen, requests, 20, 2, 2, prefix=False)
    for row in (serial, batched):
        assert row["completed"] == row["requests"] == 4 and row["errors"] == []
    assert batched["target"] == "Batcher" and batched["window_ms"] == 20
    timed = packed[1:]  # after the warm-up request
    assert sum(timed) == 4  # each request in exactly one forward call
    # each request reports the size of the forward it shared: the mean over requests of that size
    assert batched["mean_batched_requests"] == round(sum(n * n for n in timed) / sum(timed), 2)


def test_clear_cut_set_puts_the_correct_option_at_every_position_alike():
    items = models.labelled(models.CLEARCUT, blink.Settings())
    positions: dict[int, Counter] = {}
    for request, labels in items:
        for q in request.questions:
            if q.type == "choice":
                positions.setdefault(len(q.options), Counter())[q.keys.index(labels[q.key])] += 1
    for n, seen in positions.items():
        counts = [seen[i] for i in range(n)]
        assert max(counts) - min(counts) <= 1, (n, counts)  # "always pick A" scores chance, not more
    yes_no = Counter(labels[q.key] for request, labels in items for q in request.questions if q.type == "noul")
    assert yes_no["yes"] == yes_no["no"] > 10
    ((document, labels),) = models.labelled(models.INCIDENT, blink.Settings())
    assert len(labels) == len(document.questions) == 8


def test_model_comparison_grades_what_decide_answers(standin, served):
    items = models.labelled(models.CLEARCUT, blink.Settings())
    pair = next(
        i
        for i in items
        if len(i[0].questions[0].options) == 2 and i[0].questions[0].keys[0] != i[1][i[0].questions[0].key]
    )  # a two-option choice whose correct option is shown second
    few = [pair] + [next(i for i in items if i[0].questions[0].type == t) for t in ("noul", "score")]
    out = models.compare({"stand-in": standin}, few, few[1], few[1], (1, 1))["stand-in"]
    answers = out["quality"]["answers"]
    decided = served(standin).decide_many([[r.state, r.spec] for r, _ in few], temperature=1.0)
    for a, result in zip(answers, decided, strict=True):
        probs = result["answers"][a["key"]]["probabilities"]  # in request order: max() keeps the earlier on a tie
        assert (
            a["pick"] == max(probs, key=probs.get)
            and abs(a["label_mass"] - result["answers"][a["key"]]["label_mass"]) < 1e-5
            and a["p_correct"] == pytest.approx(probs[a["label"]], abs=1e-5)
        )
    written = out["quality"]["as_written"]
    assert written["correct"] == sum(a["pick"] == a["label"] for a in answers) and written["choice_first_correct"] == 0
    assert out["document"]["correct"] == (answers[1]["pick"] == answers[1]["label"])  # timed run, graded alike
    (g,) = out["quality"]["order_answers"]  # only the choice question is asked again: once per order
    assert sorted(shown[0] for shown in g["shown"]) == sorted(g["shown"][0]) and len(g["picks"]) == 2
    orders = out["quality"]["every_order"]
    last = next(pick for shown, pick in zip(g["shown"], g["picks"]) if shown[-1] == g["label"])
    assert orders["accuracy_correct_last"] == (last == g["label"]) and orders["first_fair_share"] == 0.5
    assert out["speed"]["short"]["cpu_ms"] > 0 and out["speed"]["short"]["prompt_tokens"] > 50
    tables = "\n".join(models.quality_table({"stand-in": out}) + models.speed_table({"stand-in": out}))
    assert f"| stand-in | {100 * written['accuracy']:.0f}% ({written['correct']}/3) |" in tables


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
BENCH_README = os.path.join(os.path.dirname(RESULTS), "README.md")


# Results files written before the current header (a `python -m bench NAME` command): they print as generic tables.
OLD_FORMAT = {"batch.json", "budget.json", "full.json", "gpu.json", "memory.json", "models.json", "overhead.json"}


def test_report_prints_every_results_file_whole_with_its_own_tables():
    files = sorted(p for p in glob.glob(os.path.join(RESULTS, "*.json")) if not p.endswith("-quick.json"))
    kinds = {}
    for path in files:
        with open(path, encoding="utf-8") as fh:
            res = json.load(fh)
        kinds[os.path.basename(path)] = which = report.kind(res)
        out = "\n" + report.report(res)
        assert out.count("\n|") >= 2, path  # a table with at least one row
        assert "..." not in out and "…" not in out, path  # nothing elided
        shown = set(report.HEADER) | set(report.tables_of(which)[1] if which != "generic" else ())
        for key in res.keys() - shown:  # every field the tables leave out prints after them
            assert f"\n- {key}: " in out or f"\n{key}:\n" in out, (path, key)
    runs = {name: "run" for name in kinds if name.startswith("decision-")}  # e.g. decision-2threads.json (--name)
    assert kinds == {
        **runs,
        **dict.fromkeys(OLD_FORMAT, "generic"),
        "decision.json": "run",
        "drift.json": "drift",
        "engine_ab-1f50df1.json": "engine_ab",
        "engine_ab-1f50df1-float32.json": "engine_ab",
        "engine_ab-7947525-float32.json": "engine_ab",
        "engine_ab-7947525-float32-4b-8l.json": "engine_ab",
        "engine_ab-5fa73e8-float32-4b-8l.json": "engine_ab",
        "engine_ab-7b2947f-float32-4b-8l.json": "engine_ab",
        "engine_ab-5fa73e8-float32.json": "engine_ab",
        "engine_ab-63107a3-float32-4b-8l-w8a8-prefix.json": "engine_ab",
        "engine_ab-2e9ff95-float32-options.json": "engine_ab",
        "engine_ab-2e9ff95-float32-4b-8l-document-again.json": "engine_ab",
        "engine_ab-2e9ff95-float32-4b-8l-document.json": "engine_ab",
        "engine_ab-777ede6-float32-4b-8l-document.json": "engine_ab",
        "engine_ab-24456f4-4b-8l-document.json": "engine_ab",
        "engine_ab-15e917e-4b-8l-document-short-again.json": "engine_ab",
        "engine_ab-1b9138a-4b-8l-document-again.json": "engine_ab",
        "jevbench.json": "jevbench",
        "krite.json": "krite",
        "quantfloor.json": "drift",  # written by `python -m bench quantfloor`, now `drift --schemes`
        "quantfloor-fbgemm.json": "drift",
        "quantfloor-prefix.json": "drift",
        "route_sim.json": "route_sim",
        "serve.json": "serve",
        "serve-default.json": "serve",
        "shape4b.json": "shape4b",
        "shape4b-8l.json": "shape4b",
        "shape4b-8l-interleaved.json": "shape4b",
        "shape4b-8l-interleaved-amx.json": "shape4b",
        "shape4b-8l-interleaved-amx-513e071.json": "shape4b",
        "shape4b-8l-interleaved-amx-cbc9215.json": "shape4b",
        "shape4b-amx.json": "shape4b",
        "shape4b-amx-fed3846.json": "shape4b",
        "shape4b-load-amx.json": "shape4b",
        "shape4b-load.json": "shape4b",
        "vllm-cpu.json": "vllm_check",
    }


def test_report_reads_every_benchmark_without_torch():
    # every benchmark module imports for its tables without loading torch (each loads it where it runs)
    code = (
        "import contextlib, io, sys\n"
        "from bench import __main__ as entry\n"
        "from bench.lib import report\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    report.main([])\n"
        "assert all(report.tables_of(name) for name in entry.BENCHMARKS)\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


def test_report_prints_the_vllm_results_whole():
    with open(os.path.join(RESULTS, "vllm-cpu.json"), encoding="utf-8") as fh:
        res = json.load(fh)
    out = report.report(res)
    for name, row in res["answers"]["arms"].items():  # every arm's answers against the reference
        title = arms.title("vllm_check", name)
        assert f"| {title} | {row['max_prob_diff']:.2g} | {len(row['picks_differ'])} of {row['questions']} |" in out
    for row in res["http"]["rows"]:  # every HTTP row, with its latencies
        title = arms.title("vllm_check", row["target"])
        assert (
            f"| {title} | {row['workload']} | {row['clients']} | {row['completed']} | {row['requests_per_s']:.2f} | "
            f"{row['p50_ms']:.0f} | {row['p99_ms']:.0f} |" in out
        )
    assert res["vllm_own_route"] in out


def test_report_prints_the_utilisation_column_and_the_two_http_workloads():
    # the committed files with the new fields added (fabricated numbers: only the printing is checked)
    with open(os.path.join(RESULTS, "decision.json"), encoding="utf-8") as fh:
        res = json.load(fh)
    res["matmul_gflops_by_dtype"] = {"bfloat16": [180.0, 170.0]}
    blink_arm = res["decision"]["short"]["arms"]["blink"]
    blink_arm.update(computed_tokens=1234, model_gflop=300.0, gflops=41.7, dtype="bfloat16", probe_dtype="bfloat16")
    blink_arm.update(matmul_gflops=180.0, utilisation=0.232)
    for row in res["http"]:
        row["workload"] = workloads.DISTINCT
    out = report.report(res)
    assert "| one short yes/no question | blink | bfloat16 | 1,234 | 42 | 180 (bfloat16) | 23% |" in out
    assert ", bfloat16 180," in out  # the probe at blink's dtype, beside the float32 one
    row = res["http"][0]
    assert f"| {row['target']} | distinct | {row['clients']} | {row['completed']} |" in out

    with open(os.path.join(RESULTS, "vllm-cpu.json"), encoding="utf-8") as fh:
        res = json.load(fh)
    pair = ["blink torch bfloat16", "blink vLLM bfloat16"]
    rows = [r for r in res["http"]["rows"] if r["target"] in pair]
    res["http"].update(pair=pair, workloads={"distinct": "every request new", "repeated": "sent again"})
    res["http"]["rows"] = [{**r, "workload": w} for w in ("distinct", "repeated") for r in rows]
    res.update(quick=False, duration_s=60.0)
    res["targets"] = vllm_check.serving_targets(res["http"]["rows"], *pair, exact=True)
    out = report.report(res)
    by = {(r["target"], r["workload"], r["clients"]): r for r in res["http"]["rows"]}
    for w in ("distinct", "repeated"):
        for clients in res["http"]["clients"]:
            mine, theirs = by[(pair[0], w, clients)], by[(pair[1], w, clients)]
            ratio = mine["requests_per_s"] / theirs["requests_per_s"]
            assert (
                f"| {w} ({res['http']['workloads'][w]}) | {clients} | {mine['requests_per_s']:.2f} | "
                f"{theirs['requests_per_s']:.2f} | {ratio:.2f}× |" in out
            )
            assert f"| torch bfloat16 | {w} | {clients} | {mine['completed']} |" in out
    assert len(res["targets"]) == 6 and all(f"- {t['target']}: {t['value']:.2f}x" in out for t in res["targets"])
    eight = by[(pair[0], "repeated", 8)]["requests_per_s"] / by[(pair[1], "repeated", 8)]["requests_per_s"]
    assert f"repeated x{eight:.2f} at 8 client(s) ({'met' if eight >= 1 else 'MISSED'})" in vllm_check.vllm_summary(
        res, "vllm-cpu.json"
    )


def test_python_m_bench_lists_every_benchmark_and_each_has_a_main():
    import importlib

    from bench import __main__ as entry

    done = subprocess.run(
        [sys.executable, "-m", "bench", "--list"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    listed = [line.split()[0] for line in done.stdout.splitlines()]
    on_disk = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "bench", "[!_]*.py"))}
    assert listed == [*entry.BENCHMARKS, "report"] and set(entry.BENCHMARKS) == on_disk  # the top level: benchmarks
    for name in entry.BENCHMARKS:
        assert callable(importlib.import_module(f"bench.{name}").main)


def test_a_run_writes_its_header_and_results_to_its_file(tmp_path):
    before = torch.get_num_threads()
    try:
        ran = harness.Run("drift", ["--quick", "--threads", "1", "--out", str(tmp_path)], "a test run")
        assert ran.quick and ran.threads == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    ran.probes = [200.0]  # as if probed at its start: the end is probed when it writes
    path = ran.write({"rows": [1, 2]})
    assert path == str(tmp_path / "drift-quick.json")
    with open(path, encoding="utf-8") as fh:
        res = json.load(fh)
    assert res["command"] == "python -m bench drift --quick --threads 1 --out " + str(tmp_path)
    assert res["rows"] == [1, 2] and res["quick"] is True and res["threads"] == 1
    assert res["hardware"] == blink.hardware() and res["torch"] == torch.__version__
    assert res["matmul_gflops_start_end"][0] == 200.0 and len(ran.probes) == 2
    assert res["unsteady"] == (abs(200.0 - ran.probes[1]) / max(200.0, ran.probes[1]) > 0.10)
    assert set(res["load_average"]) == {"start", "end"} and res["duration_s"] >= 0
    assert report.kind(res) == "drift" and ran.written == res


def test_one_answer_comparison_reads_every_shape():
    # blink's own shapes (a noul with its distribution), System One's (p(yes) alone) and a score without a choice
    reference = {
        "n": {"type": "noul", "noul": 0.7, "probabilities": {"yes": 0.7, "no": 0.3}},
        "c": {"type": "choice", "choice": "a", "probabilities": {"a": 0.6, "b": 0.4}},
        "s": {"type": "score", "probabilities": {"1": 0.5, "2": 0.5}},
    }
    other = {
        "n": {"type": "noul", "noul": 0.45},
        "c": {"type": "choice", "choice": "a", "probabilities": {"a": 0.58, "b": 0.42}},
        "s": {"type": "score", "probabilities": {"1": 0.5, "2": 0.5}},
        "x": {"type": "noul", "noul": 0.1},  # a question the reference did not ask: left out
    }
    assert answers.pick(reference["s"]) == "1"  # a tie goes to the earlier option, as blink breaks it
    got = answers.compare(reference, other)
    assert got["questions"] == 3 and got["picks_differ"] == ["n"]
    assert got["max_prob_diff"] == pytest.approx(0.25, abs=1e-12)
    assert got["reference_margins"] == {"n": 0.4}
    assert answers.compare(reference, reference) == {
        "questions": 3,
        "max_prob_diff": 0.0,
        "picks_differ": [],
        "reference_margins": {},
    }
    assert answers.flat([{"q": 1}, {"q": 2}]) == {"0/q": 1, "1/q": 2}


def test_report_of_an_unknown_kind_prints_its_fields_as_tables():
    res = {
        "command": "python bench/new_arm.py --requests 8",
        "hardware": "a GPU",
        "rows": [{"backend": "vllm", "requests_per_s": 12.345678}, {"backend": "torch", "requests_per_s": 4.5}],
        "arms": {"a": {"ms": 1}, "b": {"ms": 2}},
    }
    out = report.report(res)
    assert report.kind(res) == "generic"  # no `python -m bench NAME` command: generic tables
    assert "- hardware: a GPU" in out and "| 0 | vllm | 12.35 |" in out and "| b | 2 |" in out


def test_the_bench_readme_tables_are_what_report_prints():
    """Every row of the tables bench/README.md quotes is printed from the committed results by the tables of the
    benchmark that wrote them (a file without the current header by that benchmark's table function directly)."""
    with open(BENCH_README, encoding="utf-8") as fh:
        readme = fh.read()
    quoted = {
        "decision.json": ("run", None),
        "drift.json": ("drift", None),
        "budget.json": ("budget", None),
        "overhead.json": ("overhead", None),
        "batch.json": ("batch", None),
        "models.json": ("models", None),
        "gpu.json": ("gpu", None),
        "memory.json": ("memory", None),
        "vllm-cpu.json": ("vllm_check", None),
        "serve.json": ("serve", None),
        "serve-default.json": ("serve", None),
        "krite.json": ("krite", None),
        "shape4b.json": ("shape4b", None),
        "shape4b-8l.json": ("shape4b", None),
        "shape4b-8l-interleaved.json": ("shape4b", None),
        "quantfloor.json": ("drift", None),
        "quantfloor-fbgemm.json": ("drift", None),
        "quantfloor-prefix.json": ("drift", None),
        "route_sim.json": ("route_sim", None),
        "full.json": ("run", "Time per request"),
    }  # full: the grid's tables
    for name, (which, start) in quoted.items():
        with open(os.path.join(RESULTS, name), encoding="utf-8") as fh:
            res = json.load(fh)
        if name in OLD_FORMAT:
            out = "\n".join(report.tables_of(which)[0](res))
        else:
            assert report.kind(res) == which, name
            out = report.report(res).split("\nOther fields:")[0]  # the tables of its kind
        out = out[out.index(start) :] if start else out
        rows = [line for line in out.splitlines() if line.startswith("| ")]
        missing = [line for line in rows if line not in readme]
        assert rows and not missing, (name, missing[:3])


def test_a_run_is_flagged_unsteady_when_its_matmul_probes_differ_by_more_than_the_threshold():
    assert harness.steadiness(242.0, 197.0)["unsteady"] and harness.steadiness(197.0, 242.0)["unsteady"]
    assert not harness.steadiness(100.0, 90.0)["unsteady"]  # 10% apart: at the threshold, not over it
    assert harness.steadiness(100.0, 89.9)["unsteady"] and harness.steadiness(100.0, 89.9)["matmul_change"] == 0.101
    with open(os.path.join(RESULTS, "full.json"), encoding="utf-8") as fh:
        full = json.load(fh)
    with open(os.path.join(RESULTS, "decision.json"), encoding="utf-8") as fh:
        decision = json.load(fh)
    assert report.steadiness_line(full).startswith("**Unsteady machine:** matmul probe 242 GFLOP/s")
    assert report.steadiness_line(decision).startswith("Steady machine")


def test_serve_draws_report_each_draw_and_the_spread_over_them():
    from bench import serve as serve_bench

    def rows(draw: int, evidence: float, pow2: float, hot_p99: float) -> list[dict]:
        figures = {"one_replica": 1.0, "pow2": pow2, "prefix_tree": 1.0, "evidence": evidence}
        out = [
            {"workload": "reask", "arm": arm, "draw": draw, "req_per_s": rate, "p50_s": 1.0, "p99_s": 2.0}
            | {"cached_share": 0.7 if arm != "pow2" else 0.5, "documents_split": 0, "documents_asked_again": 8}
            for arm, rate in figures.items()
        ]
        out += [
            {"workload": "hot", "arm": arm, "draw": draw, "req_per_s": 1.0, "p50_s": 1.0, "p99_s": p99}
            | {"cached_share": 0.4, "documents_split": 1, "documents_asked_again": 1}
            for arm, p99 in (("pow2", 10.0), ("evidence", hot_p99))
        ]
        return out

    draws = [rows(1, 2.0, 1.0, 9.0), rows(2, 1.5, 1.25, 13.0), rows(3, 1.8, 1.2, 11.0)]
    by_draw = [serve_bench.targets(d) for d in draws]
    over = {t["target"]: t for t in serve_bench.targets_over(by_draw)}
    pow2 = over["re-ask req/s at least 1.3x pow2's"]
    assert pow2["values"] == [2.0, 1.2, 1.5] and pow2["value"] == 1.5 and (pow2["min"], pow2["max"]) == (1.2, 2.0)
    assert pow2["met_in"] == 2 and not pow2["met"]  # met only where every draw meets it
    one = over["re-ask req/s at least 1.6x one_replica's"]
    assert one["values"] == [2.0, 1.5, 1.8] and one["met_in"] == 2
    hot = over["hot p99 at most 1.2x pow2's"]
    assert hot["values"] == [0.9, 1.3, 1.1] and hot["met_in"] == 2
    assert over["re-ask cached share within 5 points of one replica's"]["met"]
    spread = {(r["workload"], r["arm"]): r for r in serve_bench.spread([r for d in draws for r in d])}
    assert spread[("reask", "evidence")]["req_per_s"] == {"min": 1.5, "median": 1.8, "max": 2.0}
    assert spread[("hot", "evidence")]["p99_s"] == {"min": 9.0, "median": 11.0, "max": 13.0}
    assert spread[("reask", "pow2")]["draws"] == 3 and spread[("hot", "pow2")]["documents_split"] == [1, 1, 1]
    only = workloads.serving_workloads({**serve_bench.CONFIGS["quick"], "workloads": ["reask", "hot"]})
    assert list(only) == ["reask", "hot"]


@pytest.mark.parametrize("config", ["quick", "full"])
def test_serve_workloads_never_repeat_a_request_and_keep_their_documents_apart(config):
    from bench import serve as serve_bench

    work = workloads.serving_workloads(serve_bench.CONFIGS[config])
    documents = {name: {doc for doc, _, _ in requests} for name, (requests, _) in work.items()}
    assert not (documents["reask"] & documents["distinct"] or documents["reask"] & documents["hot"])
    assert not documents["distinct"] & documents["hot"]
    every = [(state, json.dumps(qs, sort_keys=True)) for requests, _ in work.values() for _, state, qs in requests]
    assert len(set(every)) == len(every)  # no exact repeat: the answer cache never answers, the prefix cache may
    reask, _ = work["reask"]
    cfg = serve_bench.CONFIGS[config]
    assert Counter(doc for doc, _, _ in reask) == {doc: cfg["asks"] for doc in documents["reask"]}
    assert [doc for doc, _, _ in reask[: cfg["docs"]]] == sorted(
        documents["reask"]
    )  # interleaved: all first asks first
    hot, _ = work["hot"]
    top, count = Counter(doc for doc, _, _ in hot).most_common(1)[0]
    assert count == len(hot) // 2 and all(n == 1 for doc, n in Counter(d for d, _, _ in hot).items() if doc != top)
