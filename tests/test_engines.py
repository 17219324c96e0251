"""Engine selection, multi-model routing, replay keys and the labelled mock engine."""

from __future__ import annotations

import json

import pytest

import blink

QS = {"spam": {"type": "noul", "instructions": "Is this spam?"},
      "topic": {"type": "choice", "instructions": "Topic?", "criteria": ["sales", "support", "other"]}}


def write_recording(path, model: str, state, questions: dict, logits: dict) -> None:
    """A recording file in the layout `blink.py record` writes."""
    data = {"model": model, "revision": None, "hardware": "test bench CPU",
            "requests": {blink.request_key(state, questions): {"logits": logits, "input_tokens": 42,
                                                               "latency_ms": 12.5}}}
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("env, cuda, recorded, model, kind", [
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
])
def test_engine_kind_rules(monkeypatch, tmp_path, env, cuda, recorded, model, kind):
    monkeypatch.setattr(blink, "ENGINE", env)
    monkeypatch.setattr(blink, "_cuda", lambda: cuda)
    path = tmp_path / "replay.json"
    if recorded:
        write_recording(path, model, "x", QS, {"spam": [0.0, 0.0], "topic": [0.0, 0.0, 0.0]})
    monkeypatch.setattr(blink, "replay_path", lambda model_id=None: str(path))
    assert blink.engine_kind(model) == kind


def test_a_foreign_recording_counts_as_none_and_a_corrupt_one_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(blink, "ENGINE", "")
    monkeypatch.setattr(blink, "_cuda", lambda: False)
    path = tmp_path / "replay.json"
    monkeypatch.setattr(blink, "replay_path", lambda model_id=None: str(path))
    write_recording(path, "org/other", "x", QS, {"spam": [0.0, 0.0], "topic": [0.0, 0.0, 0.0]})
    assert blink.engine_kind("org/mine") == "torch"
    assert blink.engine_kind(blink.STANDIN_MODEL) == "torch"
    path.write_text("{truncated")
    with pytest.raises(blink.BlinkError, match="cannot be read"):
        blink.engine_kind("org/mine")


def test_unknown_engine_name_is_refused(monkeypatch):
    monkeypatch.setattr(blink, "ENGINE", "tpu")
    with pytest.raises(blink.BlinkError, match="BLINK_ENGINE must be"):
        blink.engine_kind("m")


def test_default_model_is_production_on_a_space_or_gpu(monkeypatch):
    monkeypatch.delenv("SPACE_ID", raising=False)
    monkeypatch.setattr(blink, "_cuda", lambda: False)
    assert blink.default_model() == blink.STANDIN_MODEL
    monkeypatch.setattr(blink, "_cuda", lambda: True)
    assert blink.default_model() == "thegovind/blink-4b"
    monkeypatch.setattr(blink, "_cuda", lambda: False)
    monkeypatch.setenv("SPACE_ID", "someone/blink")
    assert blink.default_model() == "thegovind/blink-4b"


def test_model_specs_parse_blink_models(monkeypatch):
    monkeypatch.setenv("BLINK_MODELS", " org/a@v2 , org/b ,, ")
    assert blink._model_specs() == [("org/a", "v2"), ("org/b", None)]
    monkeypatch.setenv("BLINK_MODELS", "")
    monkeypatch.setenv("BLINK_MODEL", "org/c")
    monkeypatch.setenv("BLINK_REVISION", "abc")
    assert blink._model_specs() == [("org/c", "abc")]


def test_replay_paths_per_model(monkeypatch):
    monkeypatch.setattr(blink, "MODEL_ID", "org/first")
    assert blink.replay_path("org/first") == blink.REPLAY_PATH
    assert blink.replay_path("org/second").endswith("replay-second.json")


def test_multi_model_routing_with_mock_engines(monkeypatch):
    monkeypatch.setattr(blink, "ENGINE", "mock")
    monkeypatch.setattr(blink, "MODEL_SPECS", [("org/a", None), ("org/b", "r1")])
    monkeypatch.setattr(blink, "MODEL_ID", "org/a")
    monkeypatch.setattr(blink, "_ENGINE", None)
    monkeypatch.setattr(blink, "_ENGINES", {})
    assert blink.models() == ["org/a", "org/b"]
    first = blink.decide("Buy cheap watches now", QS)
    second = blink.decide("Buy cheap watches now", QS, model="org/b")
    assert first["meta"]["model"] == "org/a" and second["meta"]["model"] == "org/b"
    assert first["answers"] != second["answers"]  # each served model has its own engine and numbers
    assert blink.engine("org/b") is blink.engine("org/b")
    with pytest.raises(blink.BlinkError, match="unknown model 'org/c'; this deployment serves org/a, org/b"):
        blink.decide("x", QS, model="org/c")


def test_mock_is_deterministic_and_labelled_fabricated(served):
    served(blink.MockEngine("org/a"))
    a = blink.decide("Buy cheap watches now", QS)
    b = blink.decide("Buy cheap watches now", QS)
    assert a["answers"] == b["answers"]
    assert a["meta"]["engine"] == "mock" and a["meta"]["fabricated"] is True
    assert "fabricated" in a["meta"]["notice"]
    shaped = blink.decide("Buy cheap watches now", QS, bias={"topic": {"other": 50.0}})
    assert shaped["answers"]["topic"]["choice"] == "other"


def test_replay_serves_the_recording_and_misses_clearly(tmp_path, served):
    path = tmp_path / "replay.json"
    write_recording(path, "org/a", "hello", QS, {"spam": [2.0, 0.0], "topic": [0.0, 1.0, 0.0]})
    served(blink.ReplayEngine(str(path), model_id="org/a"))
    out = blink.decide(" hello\r\n", QS, temperature=0.5)  # the key normalises line ends and outer space
    assert out["meta"]["engine"] == "replay" and out["meta"]["recorded_on"] == "test bench CPU"
    assert out["meta"]["latency_ms"] == 12.5 and out["meta"]["input_tokens"] == 42
    assert out["answers"]["spam"]["noul"] == pytest.approx(blink.softmax([2.0, 0.0], 0.5)[0])
    assert out["answers"]["topic"]["choice"] == "support"
    with pytest.raises(blink.ReplayMiss, match="Edited input"):
        blink.decide("hello, edited", QS)


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


def test_hybrid_uses_a_recording_only_from_the_same_model(tmp_path, monkeypatch, standin):
    path = tmp_path / "replay.json"
    write_recording(path, "org/other", "hello", QS, {"spam": [2.0, 0.0], "topic": [0.0, 1.0, 0.0]})
    monkeypatch.setattr(blink, "replay_path", lambda model_id=None: str(path))
    assert blink._matching_replay(blink.STANDIN_MODEL) is None
    write_recording(path, blink.STANDIN_MODEL, "hello", QS, {"spam": [2.0, 0.0], "topic": [0.0, 1.0, 0.0]})
    assert blink._matching_replay(blink.STANDIN_MODEL) is not None


def test_hybrid_serves_saved_runs_only_when_asked(tmp_path, standin, served):
    path = tmp_path / "replay.json"
    write_recording(path, blink.STANDIN_MODEL, "hello", QS, {"spam": [5.0, 0.0], "topic": [0.0, 1.0, 0.0]})
    served(blink.HybridEngine(blink.ReplayEngine(str(path)), standin))
    saved = blink.decide("hello", QS, prefer="saved")
    live = blink.decide("hello", QS)
    edited = blink.decide("hello!", QS, prefer="saved")
    assert saved["meta"]["engine"] == "replay" and "recorded_on" in saved["meta"]
    assert live["meta"]["engine"] == "torch" and edited["meta"]["engine"] == "torch"
    assert saved["answers"]["spam"]["noul"] == pytest.approx(blink.softmax([5.0, 0.0], 1.0)[0])
    assert "model_ms" in live["meta"] and "model_ms" not in saved["meta"]


def test_gpu_decorator_is_plain_off_zero_gpu_and_sized_to_the_work(monkeypatch):
    def f(key, seqs, cands):
        return key

    assert blink._gpu(10)(f) is f and blink._gpu(blink._gpu_seconds)(f) is f
    assert blink._gpu_seconds(0, [[1] * 100], [[1]]) == 11
    assert blink._gpu_seconds(0, [[1] * 100_000] * 2, [[1]] * 2) == 50
    assert blink._gpu_seconds(0, [[1] * 131_072] * 512, [[1]] * 512) == blink.GPU_DURATION


def test_engine_call_meta_is_kept_per_thread(standin, served):
    import threading

    standin.last_model_ms = 1.0
    seen = []
    worker = threading.Thread(target=lambda: seen.append(standin.last_model_ms))
    worker.start()
    worker.join()
    assert seen == [None] and standin.last_model_ms == 1.0
    served(standin)
    states = ["short note", "a much longer note " * 40]
    results: dict = {}

    def call(i: int) -> None:
        for _ in range(3):
            results.setdefault(i, []).append(blink.decide(states[i], QS)["meta"])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for metas in results.values():  # each caller's meta counts its own tokens, never the other caller's
        assert all(m["prefill_tokens"] == m["input_tokens"] for m in metas)
    assert results[0][0]["input_tokens"] != results[1][0]["input_tokens"]
