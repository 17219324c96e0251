"""Isolation under load: concurrent callers through Batcher each get exactly their own request's answer."""

from __future__ import annotations

import statistics
import threading
import time

import blink

N_CALLERS = 32
TOPICS = ["billing", "shipping", "returns", "login", "warranty", "pricing", "privacy", "other"]


def request(i: int) -> tuple[str, dict]:
    """Caller i's own request: different evidence and different options."""
    topics = TOPICS[i % 5:] + TOPICS[: i % 5]
    state = f"Ticket {i}: the customer writes about {TOPICS[i % len(TOPICS)]} and order {1000 + i}."
    return state, {"topic": {"type": "choice", "instructions": "Which topic?", "criteria": topics[: 3 + i % 4]},
                   "urgent": {"type": "noul", "instructions": f"Is ticket {i} urgent?"}}


def test_concurrent_callers_through_the_batcher_get_their_own_answers(standin, served):
    served(standin)
    alone = [blink.decide(*request(i))["answers"] for i in range(N_CALLERS)]
    batcher = blink.Batcher(window_s=0.02, max_requests=16, max_queued=N_CALLERS)
    results: dict = {}
    latencies: list = []
    errors: list = []

    def caller(i: int) -> None:
        t0 = time.perf_counter()
        try:
            results[i] = batcher.submit(*request(i))
        except Exception as exc:  # noqa: BLE001 - counted and asserted below
            errors.append(exc)
        latencies.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(N_CALLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == N_CALLERS
    assert max(r["meta"]["batched_requests"] for r in results.values()) > 1  # batches really formed
    for i in range(N_CALLERS):
        got, want = results[i]["answers"], alone[i]
        assert list(got) == list(want)
        for q in want:
            assert list(got[q]["probabilities"]) == list(want[q]["probabilities"])
            assert max(abs(a - b) for a, b in zip(got[q]["probabilities"].values(),
                                                  want[q]["probabilities"].values())) < 1e-6
    latencies.sort()
    print(f"\nBatcher: {N_CALLERS} requests, {len(errors)} errors, p50 {statistics.median(latencies):.3f}s, "
          f"p99 {latencies[int(0.99 * (len(latencies) - 1))]:.3f}s")
