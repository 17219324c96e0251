"""decide_many isolation and fallback; Batcher grouping, queue-full and worker-death behaviour."""

from __future__ import annotations

import threading

import pytest
from conftest import invariance_bar, wait_until

import blink

QS = {
    "pay": {"type": "noul", "instructions": "Has the customer paid?"},
    "tone": {"type": "choice", "instructions": "Tone of the message?", "criteria": ["calm", "angry", "happy"]},
}
STATES = [
    "Paid in full on Monday, thanks!",
    "Still waiting for the refund. This is unacceptable.",
    {"order": 17, "status": "unpaid", "note": "customer is delighted with the product"},
]


def answers_alone(dep: blink.Deployment, state) -> dict:
    """The answers decide() gives for one request on its own."""
    return dep.decide(state, QS)["answers"]


def close(a: dict, b: dict, engine: blink.TorchEngine) -> bool:
    """Two answer maps agree within the engine's dtype's rounding (invariance_bar)."""
    bar = invariance_bar(engine)
    return all(
        abs(x - y) < bar for q in a for x, y in zip(a[q]["probabilities"].values(), b[q]["probabilities"].values())
    )


@pytest.fixture()
def live(standin, served) -> blink.Deployment:
    """A deployment serving the loaded stand-in."""
    return served(standin)


@pytest.fixture(scope="module")
def short_context() -> blink.TorchEngine:
    """The stand-in loaded again with a per-question limit of 400 tokens (BLINK_MAX_INPUT_TOKENS=400)."""
    return blink.TorchEngine(blink.STANDIN_MODEL, settings=blink.Settings(max_input_tokens=400))


def test_decide_many_packs_and_keeps_each_request_its_own(live):
    bad = {"q": {"type": "score", "criteria": ["one"]}}
    out = live.decide_many([(STATES[0], QS), ("x", bad), (STATES[1], QS), (STATES[2], QS)])
    assert isinstance(out[1], blink.BlinkError) and "2 to 10 levels" in str(out[1])
    for i, state in ((0, STATES[0]), (2, STATES[1]), (3, STATES[2])):
        assert out[i]["meta"]["batched_requests"] == 3
        assert close(out[i]["answers"], answers_alone(live, state), live.engine())


def test_render_error_stays_with_its_request(live, short_context, served):
    long_state = "word " * 500
    out = served(short_context).decide_many([(long_state, QS), (STATES[0], QS)])
    assert isinstance(out[0], blink.BlinkError) and "over the maximum context length" in str(out[0])
    assert close(out[1]["answers"], answers_alone(live, STATES[0]), short_context)


def test_packed_failure_falls_back_to_one_request_at_a_time(live, monkeypatch):
    real = blink.TorchEngine._run_text
    calls = []

    def flaky(self, jobs):
        calls.append(len(jobs))
        if len(jobs) > 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(self, jobs)

    monkeypatch.setattr(blink.TorchEngine, "_run_text", flaky)
    out = live.decide_many([(s, QS) for s in STATES])
    assert calls == [3, 1, 1, 1]
    for state, res in zip(STATES, out):
        assert close(res["answers"], answers_alone(live, state), live.engine())


def test_decide_many_refuses_a_bad_temperature(live):
    with pytest.raises(blink.BlinkError, match="temperature"):
        live.decide_many([(STATES[0], QS)], temperature=float("nan"))


def held_batcher(dep: blink.Deployment) -> tuple[blink.Batcher, list[int], threading.Event, threading.Event]:
    """The deployment's Batcher with its first call of the model held until `release` is set: (batcher, the number
    of jobs of each call, entered (set once the first call holds), release)."""
    batcher = dep.batcher()
    real, sizes = batcher.run, []
    entered, release = threading.Event(), threading.Event()

    def held(jobs):
        sizes.append(len(jobs))
        if len(sizes) == 1:
            entered.set()
            assert release.wait(120)
        return real(jobs)

    batcher.run = held
    return batcher, sizes, entered, release


def test_requests_that_arrive_during_a_forward_join_the_next_one_together(live, standin, served):
    dep = served(standin, blink.Settings(batch_max_requests=4))  # continuous batching: no window
    batcher, sizes, entered, release = held_batcher(dep)
    results: dict = {}

    def call(i: int) -> None:
        results[i] = dep.submit(dep.request(STATES[i % len(STATES)], QS))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    threads[0].start()
    assert entered.wait(120)  # the worker runs the first request, alone, while the others have not arrived
    for t in threads[1:]:
        t.start()
    assert wait_until(lambda: batcher.q.qsize() == 3)  # they wait while the model is busy
    release.set()
    for t in threads:
        t.join(timeout=120)
    assert sizes == [1, 3]  # everything that waited, in one call
    assert [results[i]["meta"]["batched_requests"] for i in range(4)] == [1, 3, 3, 3]
    for i in range(4):
        assert close(results[i]["answers"], answers_alone(live, STATES[i % len(STATES)]), standin)


def test_a_callers_requests_are_taken_together(live, standin, served):
    dep = served(standin)
    batcher, sizes, entered, release = held_batcher(dep)
    release.set()  # nothing held: the worker is idle when the caller's three requests arrive
    out = dep.submit_many([dep.request(s, QS) for s in STATES])
    assert sizes == [3] and all(r["meta"]["batched_requests"] == 3 for r in out)


def test_batcher_refuses_bad_input_before_queueing(live):
    batcher = live.batcher()
    with pytest.raises(blink.BlinkError, match="questions must be a non-empty object"):
        live.submit(live.request("x", {}))
    with pytest.raises(blink.ImageError, match="this model reads text only"):  # refused by the engine's prepare
        live.submit(live.request("x", QS, images=["data:image/png;base64,AAAA"]))
    assert batcher.q.qsize() == 0 and live.batcher() is batcher
    with pytest.raises(ValueError, match="batch window"):
        blink.Batcher(blink.run_jobs, window_s=2.0)
    with pytest.raises(ValueError, match="max_requests"):
        blink.Batcher(blink.run_jobs, window_s=0.1, max_requests=0)
    with pytest.raises(ValueError, match="max_queued"):
        blink.Batcher(blink.run_jobs, window_s=0.1, max_queued=0)


def test_batcher_queue_full_says_busy(live):
    release, entered = threading.Event(), threading.Event()
    eng = live.engine()

    def held(jobs):
        entered.set()
        assert release.wait(120)
        return [blink.Forward({}, 0, "test", blink.LIVE) for _ in jobs]

    batcher = blink.Batcher(held, window_s=0.0, max_requests=1, max_queued=1)
    jobs = [eng.prepare(live.request(s, QS)) for s in "abc"]
    first = threading.Thread(target=batcher.submit, args=(jobs[0],))
    first.start()
    assert entered.wait(120)  # the worker has taken the first request and holds it
    second = threading.Thread(target=batcher.submit, args=(jobs[1],))
    second.start()
    assert wait_until(lambda: batcher.q.qsize() == 1)  # the second one waits in the queue
    with pytest.raises(blink.BlinkBusy, match="busy: 1 requests are already waiting; retry shortly"):
        batcher.submit(jobs[2])
    release.set()
    first.join(120)
    second.join(120)
    assert not first.is_alive() and not second.is_alive()
    # submit_all answers the job that found room and keeps the refusal in the refused job's place
    release.clear()
    entered.clear()
    first = threading.Thread(target=batcher.submit, args=(jobs[0],))
    first.start()
    assert entered.wait(120)
    tried: list = []  # what submit_all put in the queue, or tried to
    put = batcher.q.put_nowait

    def counted(item):
        try:
            put(item)
        finally:  # counted once the queue took it or refused it
            tried.append(item)

    batcher.q.put_nowait = counted
    out: list = []
    both = threading.Thread(target=lambda: out.extend(batcher.submit_all([jobs[1], jobs[2]])))
    both.start()
    assert wait_until(lambda: len(tried) == 2)  # both offered while the model still holds the first: one refused
    release.set()
    both.join(120)
    first.join(120)
    waiting, refused = out
    assert isinstance(waiting, blink.Forward) and isinstance(refused, blink.BlinkBusy)
    assert not first.is_alive()


def test_dead_worker_fails_its_callers_then_restarts(live, monkeypatch):
    class Crash(BaseException):
        """Something that kills the worker thread outright."""

    state = {"crash": True}

    def dying(jobs):
        if state["crash"]:
            state["crash"] = False
            raise Crash()
        return blink.run_jobs(jobs)

    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the dying thread's report is expected
    batcher = blink.Batcher(dying, window_s=0.0)
    job = live.engine().prepare(live.request(STATES[0], QS))
    worker = batcher.worker
    with pytest.raises(RuntimeError, match="the batching worker stopped"):
        batcher.submit(job)
    batcher.worker.join(5)
    assert batcher.worker is worker and not batcher.alive() and batcher.restarts == 0  # dead until the next submit
    out = batcher.submit(job)
    assert batcher.worker is not worker
    assert batcher.restarts == 1 and batcher.alive()
    assert close(live.answer(job, out, 0.0)["answers"], answers_alone(live, STATES[0]), live.engine())
