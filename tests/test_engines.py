"""Engine selection, multi-model routing, replay keys and the labelled mock engine."""

from __future__ import annotations

import json
import math
import os

import pytest

import blink

QS = {
    "spam": {"type": "noul", "instructions": "Is this spam?"},
    "topic": {"type": "choice", "instructions": "Topic?", "criteria": ["sales", "support", "other"]},
}


def write_recording(path, model: str, state, questions: dict, logits: dict) -> None:
    """A recording file in the layout `blink.py record` writes."""
    data = {
        "model": model,
        "revision": None,
        "hardware": "test bench CPU",
        "requests": {blink.request_key(state, questions): {"logits": logits, "input_tokens": 42, "latency_ms": 12.5}},
    }
    path.write_text(json.dumps(data))


def kind_of(model: str, path, engine: str = "", gpu: bool = False) -> str:
    """The engine kind a fresh deployment serving `model` picks, with its recording at `path`."""
    settings = blink.Settings(engine=engine, gpu=gpu, models=((model, None),), replay_path=str(path))
    return blink.Deployment(settings).engine_kind()


@pytest.mark.parametrize(
    "env, cuda, recorded, model, kind",
    [
        ("mock", False, False, "m", "mock"),
        ("replay", True, True, "m", "replay"),
        ("torch", False, True, "m", "torch"),
        ("hybrid", False, False, "m", "hybrid"),
        ("", True, True, "m", "hybrid"),
        ("", True, False, "m", "torch"),
        ("", False, True, "m", "replay"),
        ("", False, False, "m", "torch"),
        ("", False, True, blink.STANDIN_MODEL, "hybrid"),  # the stand-in runs live on a CPU
        ("", False, False, blink.STANDIN_MODEL, "torch"),
    ],
)
def test_engine_kind_rules(tmp_path, env, cuda, recorded, model, kind):
    path = tmp_path / "replay.json"
    if recorded:
        write_recording(path, model, "x", QS, {"spam": [0.0, 0.0], "topic": [0.0, 0.0, 0.0]})
    assert kind_of(model, path, env, cuda) == kind


def test_a_foreign_recording_counts_as_none_and_a_corrupt_one_is_refused(tmp_path):
    path = tmp_path / "replay.json"
    write_recording(path, "org/other", "x", QS, {"spam": [0.0, 0.0], "topic": [0.0, 0.0, 0.0]})
    assert kind_of("org/mine", path) == "torch"
    assert kind_of(blink.STANDIN_MODEL, path) == "torch"
    path.write_text("{truncated")
    with pytest.raises(blink.BlinkError, match="cannot be read"):
        kind_of("org/mine", path)


def test_unknown_engine_name_is_refused():
    with pytest.raises(blink.BlinkError, match="BLINK_ENGINE must be"):
        blink.Settings.from_env({"BLINK_ENGINE": "tpu"}, gpu=False)


def test_default_model_is_production_on_a_space_or_gpu():
    assert blink.Settings.from_env({}, gpu=False).default_model == blink.STANDIN_MODEL
    assert blink.Settings.from_env({}, gpu=True).default_model == "thegovind/blink-4b"
    assert blink.Settings.from_env({"SPACE_ID": "someone/blink"}, gpu=False).default_model == "thegovind/blink-4b"
    assert blink.Settings().default_model == blink.STANDIN_MODEL  # defaults: a machine without a GPU
    assert (
        blink.Settings(gpu=True).default_model
        == blink.Settings(on_space=True).default_model
        == (blink.PRODUCTION_MODEL)
    )


def test_model_specs_parse_blink_models():
    env = {"BLINK_MODELS": " org/a@v2 , org/b ,, "}
    assert blink.Settings.from_env(env, gpu=False).models == (("org/a", "v2"), ("org/b", None))
    env = {"BLINK_MODELS": "", "BLINK_MODEL": "org/c", "BLINK_REVISION": "abc"}
    assert blink.Settings.from_env(env, gpu=False).models == (("org/c", "abc"),)


def test_replay_paths_per_model():
    settings = blink.Settings(models=(("org/first", None),))
    assert (
        settings.replay_path_for("org/first") == blink.Settings().replay_path == os.path.join(blink.HERE, "replay.json")
    )
    assert settings.replay_path_for("org/second").endswith("replay-second.json")


def test_multi_model_routing_with_mock_engines():
    dep = blink.Deployment(blink.Settings(engine="mock", models=(("org/a", None), ("org/b", "r1"))))
    assert dep.models() == ["org/a", "org/b"]
    first = dep.decide("Buy cheap watches now", QS)
    second = dep.decide("Buy cheap watches now", QS, model="org/b")
    assert first["meta"]["model"] == "org/a" and second["meta"]["model"] == "org/b"
    assert first["answers"] != second["answers"]  # each served model has its own engine and numbers
    assert dep.engine("org/b") is dep.engine("org/b")
    with pytest.raises(blink.BlinkError, match="unknown model 'org/c'; this deployment serves org/a, org/b"):
        dep.decide("x", QS, model="org/c")


def test_mock_is_deterministic_and_labelled_fabricated(served):
    dep = served(blink.MockEngine("org/a"))
    a = dep.decide("Buy cheap watches now", QS)
    b = dep.decide("Buy cheap watches now", QS)
    assert a["answers"] == b["answers"]
    assert a["meta"]["engine"] == "mock" and a["meta"]["fabricated"] is True
    assert "fabricated" in a["meta"]["notice"]
    # the demo's `bias` adds to one option's label logit before blink's own softmax: the answer moves exactly so
    shaped = dep.decide("Buy cheap watches now", QS, bias={"topic": {"other": 2.0}})
    plain = a["answers"]["topic"]["probabilities"]
    raised = {k: math.log(p) + (2.0 if k == "other" else 0.0) for k, p in plain.items()}
    total = sum(math.exp(v) for v in raised.values())
    assert shaped["answers"]["topic"]["probabilities"] == pytest.approx(
        {k: math.exp(v) / total for k, v in raised.items()}, abs=1e-9
    )
    assert shaped["answers"]["spam"] == a["answers"]["spam"]  # a bias for one question leaves the others alone


def test_replay_serves_the_recording_and_misses_clearly(tmp_path, served):
    path = tmp_path / "replay.json"
    write_recording(path, "org/a", "hello", QS, {"spam": [2.0, 0.0], "topic": [0.0, 1.0, 0.0]})
    dep = served(blink.ReplayEngine(str(path), model_id="org/a"))
    out = dep.decide(" hello\r\n", QS, temperature=0.5)  # the key normalises line ends and outer space
    assert out["meta"]["engine"] == "replay" and out["meta"]["recorded_on"] == "test bench CPU"
    assert out["meta"]["latency_ms"] == 12.5 and out["meta"]["input_tokens"] == 42
    assert out["answers"]["spam"]["noul"] == pytest.approx(blink.softmax([2.0, 0.0], 0.5)[0])
    assert out["answers"]["topic"]["choice"] == "support"
    with pytest.raises(blink.ReplayMiss, match="Edited input"):
        dep.decide("hello, edited", QS)


def test_foreign_or_corrupt_recording_is_refused(tmp_path):
    path = tmp_path / "replay.json"
    write_recording(path, "org/other", "hello", QS, {"spam": [2.0, 0.0], "topic": [0.0, 1.0, 0.0]})
    with pytest.raises(blink.BlinkError, match="made by org/other, not by the served model org/a"):
        blink.ReplayEngine(str(path), model_id="org/a")
    path.write_text("{not json")
    with pytest.raises(blink.BlinkError, match="cannot be read"):
        blink.ReplayEngine(str(path))
    path.write_text(json.dumps({"model": "org/a", "requests": {"k": {"logits": {"q": ["x"]}}}}))
    with pytest.raises(blink.BlinkError, match="malformed entry 'k'"):
        blink.ReplayEngine(str(path))
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(blink.BlinkError, match="not a blink recording"):
        blink.ReplayEngine(str(path))


def test_hybrid_uses_a_recording_only_from_the_same_model(tmp_path):
    path = tmp_path / "replay.json"
    settings = blink.Settings(models=((blink.STANDIN_MODEL, None),), replay_path=str(path))
    write_recording(path, "org/other", "hello", QS, {"spam": [2.0, 0.0], "topic": [0.0, 1.0, 0.0]})
    assert blink.Deployment(settings).recording(blink.STANDIN_MODEL) is None
    write_recording(path, blink.STANDIN_MODEL, "hello", QS, {"spam": [2.0, 0.0], "topic": [0.0, 1.0, 0.0]})
    rec = blink.Deployment(settings).recording(blink.STANDIN_MODEL)
    assert rec is not None and rec.model == blink.STANDIN_MODEL and rec.path == str(path)
    assert rec.has(blink.parse_request("hello", QS, settings=settings))


def test_hybrid_serves_saved_runs_only_when_asked(tmp_path, standin, served):
    path = tmp_path / "replay.json"
    write_recording(path, blink.STANDIN_MODEL, "hello", QS, {"spam": [5.0, 0.0], "topic": [0.0, 1.0, 0.0]})
    dep = served(blink.HybridEngine(blink.ReplayEngine(str(path)), standin))
    saved = dep.decide("hello", QS, prefer="saved")
    live = dep.decide("hello", QS)
    edited = dep.decide("hello!", QS, prefer="saved")
    assert saved["meta"]["engine"] == "replay" and "recorded_on" in saved["meta"]
    assert live["meta"]["engine"] == "torch" and edited["meta"]["engine"] == "torch"
    assert saved["answers"]["spam"]["noul"] == pytest.approx(blink.softmax([5.0, 0.0], 1.0)[0])
    assert "model_ms" in live["meta"] and "model_ms" not in saved["meta"]


def test_gpu_decorator_is_plain_off_zero_gpu_and_sized_to_the_work(standin):
    def f(key, seqs, cands):
        return key

    assert blink._gpu(10)(f) is f and blink._gpu(blink._gpu_seconds)(f) is f
    # sized by the tokens of the call, at most the engine's gpu_duration (BLINK_GPU_DURATION)
    key, most = standin.key, standin.settings.gpu_duration
    assert most == blink.Settings().gpu_duration == 60
    assert blink._gpu_seconds(key, [[1] * 100], [[1]]) == 11
    assert blink._gpu_seconds(key, [[1] * 100_000] * 2, [[1]] * 2) == 50
    assert blink._gpu_seconds(key, [[1] * 131_072] * 512, [[1]] * 512) == most
    assert blink._gpu_limit(key, None, None, []) == most


def tokens(res: blink.Forward) -> tuple[int, int, int]:
    """A live call's prompt tokens, tokens computed and tokens read from kept prefixes."""
    return res.input_tokens, res.prefill_tokens, res.cached_tokens


def test_concurrent_calls_on_one_engine_each_get_their_own_meta(tmp_path, standin, served):
    # Engines keep no per-call state: every call returns its own Forward (model time, tokens, where the numbers
    # came from), so concurrent callers never see each other's meta.
    import threading

    assert not hasattr(standin, "last_model_ms") and not hasattr(standin, "last_prefill_tokens")
    states = ["short note", "a much longer note " * 40]
    path = tmp_path / "replay.json"
    write_recording(path, blink.STANDIN_MODEL, states[0], QS, {"spam": [5.0, 0.0], "topic": [0.0, 1.0, 0.0]})
    dep = served(blink.HybridEngine(blink.ReplayEngine(str(path)), standin))
    for (
        state
    ) in states:  # the template header, and each evidence (the stand-in is all full attention), kept from here on
        standin.forward(dep.request(state, QS))
    # each state's (prompt tokens, computed, read from kept prefixes) when it runs alone
    alone = [tokens(standin.forward(dep.request(s, QS))) for s in states]
    assert alone[0][0] != alone[1][0] and all(t[2] > 0 for t in alone)
    forwards: dict = {}
    metas: dict = {}
    start = threading.Barrier(3)

    def call(i: int) -> None:
        start.wait()
        for _ in range(3):
            if i == 2:  # the recorded example, asked for from its recording, between the live calls
                metas.setdefault(i, []).append(dep.decide(states[0], QS, prefer="saved")["meta"])
                continue
            forwards.setdefault(i, []).append(standin.forward(dep.request(states[i], QS)))
            metas.setdefault(i, []).append(dep.decide(states[i], QS)["meta"])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(metas) == [0, 1, 2] and all(len(m) == 3 for m in metas.values())
    for i in (0, 1):  # each caller's numbers count its own tokens, never the other caller's
        for res in forwards[i]:
            assert res.source == "live" and res.engine == "torch" and res.batched_requests == 1
            assert tokens(res) == alone[i] and res.model_ms > 0
        for m in metas[i]:
            assert m["engine"] == "torch" and (m["input_tokens"], m["prefill_tokens"], m["cached_tokens"]) == alone[i]
            assert m["model_ms"] > 0 and m["batched_requests"] == 1 and "recorded_on" not in m
    for m in metas[2]:  # the recorded answer keeps the recording's own numbers while live calls run beside it
        assert m["engine"] == "replay" and m["recorded_on"] == "test bench CPU"
        assert m["input_tokens"] == 42 and m["latency_ms"] == 12.5
        assert "model_ms" not in m and "prefill_tokens" not in m
