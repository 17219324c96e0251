"""The answer cache: an exact repeat of a live request is answered from what the model returned the first time,
never across models, engines, images or other requests, and at any temperature as a fresh run would be."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import blink

QS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "tone": {"type": "choice", "instructions": "Tone of the message?", "criteria": ["calm", "angry", "happy"]},
}
STATE = "Order 4417: I was charged twice for the same order and want my money back."


@pytest.fixture()
def runs(monkeypatch) -> list[int]:
    """How many jobs each call of a torch engine's run() was given (the model running)."""
    calls: list[int] = []
    real = blink.TorchEngine.run

    def counted(self, jobs):
        calls.append(len(jobs))
        return real(self, jobs)

    monkeypatch.setattr(blink.TorchEngine, "run", counted)
    return calls


def cached(engine: blink.Engine, **settings) -> blink.Deployment:
    """A deployment serving `engine` alone with its answer cache at the default size unless told."""
    return blink.Deployment.serving(engine, replace(engine.settings, **settings))


def probabilities(result: dict) -> dict:
    """Every question's probabilities."""
    return {k: a["probabilities"] for k, a in result["answers"].items()}


def test_an_exact_repeat_is_answered_from_the_cache_and_says_so(standin, runs):
    dep = cached(standin)
    assert dep.settings.answer_cache_mb == 64 and dep.answers() is not None
    first = dep.decide(STATE, QS)
    again = dep.decide(STATE, QS)
    assert runs == [1]  # the model ran for the first call only
    assert first["meta"]["answer_cache"] is False and again["meta"]["answer_cache"] is True
    assert again["answers"] == first["answers"]
    meta = again["meta"]
    assert meta["engine"] == "torch" and meta["backend"] == "torch" and meta["dtype"] == first["meta"]["dtype"]
    assert meta["input_tokens"] == first["meta"]["input_tokens"]
    assert (meta["prefill_tokens"], meta["cached_tokens"]) == (0, meta["input_tokens"])  # nothing computed
    assert meta["model_ms"] == 0.0 and meta["batched_requests"] == 0
    assert first["meta"]["prefill_tokens"] > 0 and first["meta"]["model_ms"] > 0
    assert dep.instant(dep.request(STATE, QS))  # a repeat needs no model


@pytest.mark.parametrize(
    "state, questions",
    [
        (STATE + " Thanks.", QS),  # other evidence
        (STATE, {"refund": QS["refund"]}),  # fewer questions
        (STATE, {"tone": QS["tone"], "refund": QS["refund"]}),  # the same questions in another order
        (STATE, {**QS, "tone": {**QS["tone"], "criteria": ["calm", "happy", "angry"]}}),  # options reordered
        (STATE, {**QS, "tone": {**QS["tone"], "permute": 3}}),  # an opt-in feature
    ],
)
def test_any_other_request_runs_the_model(standin, runs, state, questions):
    dep = cached(standin)
    dep.decide(STATE, QS)
    other = dep.decide(state, questions)
    assert runs == [1, 1] and other["meta"]["answer_cache"] is False
    assert dep.decide(state, questions)["meta"]["answer_cache"] is True and runs == [1, 1]


def test_a_repeat_at_another_temperature_answers_as_a_fresh_run_does(standin, served, runs):
    dep = cached(standin)
    dep.decide(STATE, QS, temperature=1.0)
    warm = dep.decide(STATE, QS, temperature=0.5)
    assert warm["meta"]["answer_cache"] is True and warm["meta"]["temperature"] == 0.5 and runs == [1]
    fresh = served(standin).decide(STATE, QS, temperature=0.5)
    assert fresh["meta"]["answer_cache"] is False and runs == [1, 1]
    for key, probs in probabilities(fresh).items():
        assert probabilities(warm)[key] == pytest.approx(probs, abs=1e-6)
    assert probabilities(warm) != probabilities(dep.decide(STATE, QS, temperature=1.0))


def test_each_served_model_keeps_its_own_answers(standin, tiny_qwen, runs):
    models = ((blink.STANDIN_MODEL, None), (tiny_qwen.model_id, None))
    dep = blink.Deployment(
        replace(standin.settings, models=models), {m: e for (m, _), e in zip(models, (standin, tiny_qwen))}
    )
    smol = dep.decide(STATE, QS)
    tiny = dep.decide(STATE, QS, model=tiny_qwen.model_id)
    assert runs == [1, 1] and tiny["meta"]["answer_cache"] is False and tiny["meta"]["model"] == tiny_qwen.model_id
    assert probabilities(tiny) != probabilities(smol)
    assert dep.decide(STATE, QS, model=tiny_qwen.model_id)["answers"] == tiny["answers"]
    assert dep.decide(STATE, QS)["answers"] == smol["answers"] and runs == [1, 1]


def test_a_new_engine_starts_with_no_answers(standin, runs):
    dep = cached(standin)
    dep.decide(STATE, QS)
    other = blink.TorchEngine(blink.STANDIN_MODEL, settings=replace(standin.settings, dtype="bfloat16"))
    dep.install(other)  # the same model on another dtype gives other numbers: nothing carries over
    again = dep.decide(STATE, QS)
    assert runs == [1, 1] and again["meta"]["answer_cache"] is False and again["meta"]["dtype"] == "bfloat16"


def test_listed_images_are_part_of_what_a_repeat_must_share():
    request = blink.parse_request(STATE, QS, images=["data:image/png;base64,AAAA"])
    other = blink.parse_request(STATE, QS, images=["data:image/png;base64,AAAB"])
    assert request.key == other.key  # the recording key leaves the images list out
    assert blink.answer_key(request) != blink.answer_key(other) != blink.answer_key(blink.parse_request(STATE, QS))


def test_through_the_batcher_a_repeat_never_waits_for_the_model(standin, runs):
    dep = cached(standin)
    first = dep.submit(dep.request(STATE, QS))
    batcher = dep.batcher()
    batcher.run = None  # the worker cannot run anything now: a repeat must not reach it
    again = dep.submit(dep.request(STATE, QS))
    assert runs == [1] and again["meta"]["answer_cache"] is True and again["answers"] == first["answers"]


def test_refusals_and_saved_examples_are_never_kept(standin, tmp_path, runs):
    path = tmp_path / "replay.json"
    entry = {"logits": {"refund": [4.0, 0.0]}, "input_tokens": 42, "latency_ms": 12.5}
    questions = {"refund": QS["refund"]}
    path.write_text(
        json.dumps({"model": blink.STANDIN_MODEL, "requests": {blink.request_key(STATE, questions): entry}})
    )
    dep = cached(blink.HybridEngine(blink.ReplayEngine(str(path)), standin))
    live = dep.decide(STATE, questions)
    saved = dep.decide(STATE, questions, prefer="saved")  # the recording answers when asked for, not the cache
    assert saved["meta"]["engine"] == "replay" and "answer_cache" not in saved["meta"]
    assert dep.decide(STATE, questions)["answers"] == live["answers"] and runs == [1]
    for _ in range(2):  # refused by the engine itself, each time
        with pytest.raises(blink.ImageError, match="reads text only"):
            dep.decide(STATE, questions, images=["data:image/png;base64,AAAA"])
    assert len(dep.answers().kept) == 1


def test_the_cache_holds_its_budget_and_drops_the_least_recently_used(standin, runs):
    dep = cached(standin)
    answers = dep.answers()
    states = [f"{STATE} ({i})" for i in range(3)]
    dep.decide(states[0], QS)
    one = answers.kept.held_bytes()
    assert len(answers.kept) == 1 and one > 0
    answers.kept.budget = 2 * one + one // 2  # room for two answers of this size
    dep.decide(states[1], QS)
    dep.decide(states[0], QS)  # a hit: states[0] becomes the most recently used
    dep.decide(states[2], QS)  # drops states[1]
    assert len(answers.kept) == 2 and answers.kept.held_bytes() <= answers.kept.budget and runs == [1, 1, 1]
    assert dep.decide(states[0], QS)["meta"]["answer_cache"] is True
    assert dep.decide(states[1], QS)["meta"]["answer_cache"] is False and runs == [1, 1, 1, 1]
    answers.kept.budget = one // 2  # an answer larger than the whole budget is not kept
    answers.kept.clear()
    dep.decide(states[2], QS)
    assert len(answers.kept) == 0


def test_off_when_told(standin):
    assert blink.Settings.from_env({"BLINK_ANSWER_CACHE_MB": "0"}, gpu=False).answer_cache_mb == 0
    assert cached(standin, answer_cache_mb=0).answers() is None
    assert blink.Deployment.serving(blink.MockEngine("org/mock")).answers() is None  # an engine that runs no model


def test_the_page_says_a_repeat_came_from_the_answer_cache(standin):
    import app

    dep = cached(standin)
    first = app.render_meta(dep.decide(STATE, QS)["meta"])
    again = app.render_meta(dep.decide(STATE, QS)["meta"])
    assert "the model ran on this input" in first and "ms model" in first
    assert "answered from the answer cache, no model call" in again and "ms model" not in again
