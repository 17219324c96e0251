"""Isolation under load through the launched app: 32 gradio_client callers at once each get exactly their own
request's answer; when the queue or the Batcher is full the caller is told it is busy and to retry, never answered
wrongly.

The 32 callers run on the tiny Qwen3.5 model (the production architecture, with its linear-attention layers) served
by the real torch engine: on two CPU cores the stand-in needs about 1.3 s per request answered alone. The flood runs
on the stand-in. Probabilities must match the request answered alone within 1e-6 on the stand-in, and within 1e-5 on
the tiny model, whose linear-attention reference kernels give fp32 noise up to about 2e-6 between a batch of 16 and
one request (a request mixed with another would be off by orders of magnitude more)."""

from __future__ import annotations

from conftest import serving, wait_until
from gradio_client import Client
from gradio_client.exceptions import AppError
from gradio_client.utils import QueueError
from test_load import N_CALLERS, assert_same_answers, load_line, request, run_callers


def answered_alone(app, i: int) -> dict:
    """Caller i's request decided on its own, in process, by the engine the launched app serves."""
    return app.DEPLOYMENT.decide(*request(i))["answers"]


def test_32_callers_each_get_their_own_answer(launched, tiny_qwen):
    app, url = launched
    clients = [Client(url, verbose=False) for _ in range(N_CALLERS)]  # each caller its own connection and session
    with serving(app, tiny_qwen):
        results, errors, latencies = run_callers(
            lambda i: clients[i].submit(*request(i), api_name="/decide").result(timeout=300), timeout_s=320
        )
        print(load_line("/decide under load", results, errors, latencies))
        assert not errors and len(results) == N_CALLERS
        assert all(r["meta"]["engine"] == "torch" for r in results.values())
        assert max(r["meta"]["batched_requests"] for r in results.values()) > 1  # requests really shared forwards
        for i in range(N_CALLERS):
            assert_same_answers(results[i]["answers"], answered_alone(app, i), tolerance=1e-5)


def refused(jobs: list, kind: type) -> int:
    """How many of the jobs have ended with an error of this kind."""
    return sum(job.done() and isinstance(job.exception(), kind) for job in jobs)


def test_a_full_queue_says_busy_and_never_answers_wrongly(launched, crowded_app, crowd_gates):
    """12 callers at once against a queue of 2 events, 4 running, a Batcher holding one waiting request and a held
    model: each gets its own answer, the Batcher's busy error, or Gradio's queue-full error. The crowded app serves
    the stand-in as the launched app does, so the launched app's answers are the reference."""
    app, _ = launched
    url, _ = crowded_app
    client = Client(url, verbose=False)
    n = 12
    with crowd_gates.closed("admit", "forward"):
        jobs = [client.submit(*request(i), api_name="/decide") for i in range(n)]
        # nothing is admitted: Gradio runs 4 events and keeps 2 waiting, so the others find its queue full
        full = wait_until(lambda: crowd_gates.arrived("admit") >= 3 and refused(jobs, QueueError) >= 1)
        crowd_gates.open("admit")
        # the admitted requests reach the Batcher while the model is held: one runs, one waits, the rest are busy
        busy = wait_until(lambda: crowd_gates.arrived("forward") >= 1 and refused(jobs, AppError) >= 1)
    assert full and busy, (
        crowd_gates.arrived("admit"),
        crowd_gates.arrived("forward"),
        [job.status().code for job in jobs],
    )
    outcomes: dict = {"answer": [], "busy": [], "queue full": []}
    for i, job in enumerate(jobs):
        try:
            outcomes["answer"].append((i, job.result(timeout=300)))
        except AppError as exc:
            assert exc.title == "Busy", (exc.title, exc.message)
            assert exc.message.startswith("busy:") and "retry" in exc.message
            outcomes["busy"].append(i)
        except QueueError as exc:
            assert "try again" in str(exc).lower()
            outcomes["queue full"].append(i)
    print(
        f"\nflood of {n}: {len(outcomes['answer'])} answered, {len(outcomes['busy'])} told busy by the Batcher, "
        f"{len(outcomes['queue full'])} told the queue is full"
    )
    assert outcomes["answer"] and outcomes["busy"] and outcomes["queue full"]
    # within float32's batch-composition noise (test_load measured 1.8e-6), as the concurrent callers above
    for i, got in outcomes["answer"]:
        assert_same_answers(got["answers"], answered_alone(app, i), tolerance=1e-5)
    again = client.predict(*request(0), api_name="/decide")  # the crowd gone, a caller is served again
    assert_same_answers(again["answers"], answered_alone(app, 0), tolerance=1e-5)
