"""decide_many isolation and fallback; Batcher grouping, queue-full and worker-death behaviour."""

from __future__ import annotations

import threading
import time

import pytest

import blink

QS = {"pay": {"type": "noul", "instructions": "Has the customer paid?"},
      "tone": {"type": "choice", "instructions": "Tone of the message?", "criteria": ["calm", "angry", "happy"]}}
STATES = ["Paid in full on Monday, thanks!", "Still waiting for the refund. This is unacceptable.",
          {"order": 17, "status": "unpaid", "note": "customer is delighted with the product"}]


def answers_alone(state) -> dict:
    """The answers decide() gives for one request on its own."""
    return blink.decide(state, QS)["answers"]


def close(a: dict, b: dict) -> bool:
    """Two answer maps agree to within float noise."""
    return all(abs(x - y) < 1e-6 for q in a for x, y in zip(a[q]["probabilities"].values(),
                                                              b[q]["probabilities"].values()))


@pytest.fixture()
def live(standin, served):
    served(standin)
    return standin


def test_decide_many_packs_and_keeps_each_request_its_own(live):
    bad = {"q": {"type": "score", "criteria": ["one"]}}
    out = blink.decide_many([(STATES[0], QS), ("x", bad), (STATES[1], QS), (STATES[2], QS)])
    assert isinstance(out[1], blink.BlinkError) and "2 to 10 levels" in str(out[1])
    for i, state in ((0, STATES[0]), (2, STATES[1]), (3, STATES[2])):
        assert out[i]["meta"]["batched_requests"] == 3
        assert close(out[i]["answers"], answers_alone(state))


def test_render_error_stays_with_its_request(live, monkeypatch):
    monkeypatch.setattr(blink, "MAX_INPUT_TOKENS", 400)
    long_state = "word " * 500
    out = blink.decide_many([(long_state, QS), (STATES[0], QS)])
    assert isinstance(out[0], blink.BlinkError) and "over the maximum context length" in str(out[0])
    assert close(out[1]["answers"], answers_alone(STATES[0]))


def test_packed_failure_falls_back_to_one_request_at_a_time(live, monkeypatch):
    real = blink.TorchEngine.logits_rendered
    calls = []

    def flaky(self, works):
        calls.append(len(works))
        if len(works) > 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(self, works)

    monkeypatch.setattr(blink.TorchEngine, "logits_rendered", flaky)
    out = blink.decide_many([(s, QS) for s in STATES])
    assert calls == [3, 1, 1, 1]
    for state, res in zip(STATES, out):
        assert close(res["answers"], answers_alone(state))


def test_decide_many_refuses_a_bad_temperature(live):
    with pytest.raises(blink.BlinkError, match="temperature"):
        blink.decide_many([(STATES[0], QS)], temperature=float("nan"))


def test_batcher_groups_concurrent_requests(live):
    batcher = blink.Batcher(window_s=0.3, max_requests=8)
    results: dict = {}

    def call(i: int) -> None:
        results[i] = batcher.submit(STATES[i], QS)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert max(r["meta"]["batched_requests"] for r in results.values()) > 1
    for i, state in enumerate(STATES):
        assert close(results[i]["answers"], answers_alone(state))


def test_batcher_refuses_bad_input_before_queueing(live):
    batcher = blink.Batcher(window_s=0.01)
    with pytest.raises(blink.BlinkError, match="questions must be a non-empty object"):
        batcher.submit("x", {})
    assert batcher.q.qsize() == 0
    with pytest.raises(ValueError, match="batch window"):
        blink.Batcher(window_s=2.0)
    with pytest.raises(ValueError, match="max_requests"):
        blink.Batcher(window_s=0.1, max_requests=0)


def test_batcher_queue_full_says_busy(live, monkeypatch):
    release = threading.Event()

    def slow(requests, temperature=None, model=None):
        release.wait(10)
        return [{"answers": {}, "meta": {}} for _ in requests]

    monkeypatch.setattr(blink, "decide_many", slow)
    batcher = blink.Batcher(window_s=0.0, max_requests=1, max_queued=1)
    first = threading.Thread(target=batcher.submit, args=("a", QS))
    first.start()
    deadline = time.monotonic() + 5
    while batcher.q.qsize() and time.monotonic() < deadline:  # the worker has taken the first request
        time.sleep(0.01)
    second = threading.Thread(target=batcher.submit, args=("b", QS))
    second.start()
    while not batcher.q.qsize() and time.monotonic() < deadline:  # the second one waits in the queue
        time.sleep(0.01)
    with pytest.raises(blink.BlinkBusy, match="busy: 1 requests are already waiting; retry shortly"):
        batcher.submit("c", QS)
    release.set()
    first.join(5)
    second.join(5)
    assert not first.is_alive() and not second.is_alive()


def test_dead_worker_fails_its_callers_then_restarts(live, monkeypatch):
    class Crash(BaseException):
        """Something that kills the worker thread outright."""

    real = blink.decide_many
    state = {"crash": True}

    def dying(requests, temperature=None, model=None):
        if state["crash"]:
            state["crash"] = False
            raise Crash()
        return real(requests, temperature, model)

    monkeypatch.setattr(blink, "decide_many", dying)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the dying thread's report is expected
    batcher = blink.Batcher(window_s=0.0)
    with pytest.raises(RuntimeError, match="the batching worker stopped"):
        batcher.submit(STATES[0], QS)
    batcher.worker.join(5)
    assert not batcher.alive()
    out = batcher.submit(STATES[0], QS)
    assert batcher.restarts == 1 and batcher.alive()
    assert close(out["answers"], answers_alone(STATES[0]))
