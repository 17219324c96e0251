"""Serving throughput: N concurrent clients against blink.Batcher, against decide() one request at a time, and
against the Gradio app's /decide through gradio_client."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
from collections.abc import Callable
from dataclasses import replace

import blink
from bench.lib import grid, harness, servers


def serving(
    engine: blink.TorchEngine, window_ms: float = 0.0, max_requests: int = 1, max_queued: int | None = None
) -> blink.Deployment:
    """A deployment whose only model is the loaded engine, its Batcher gathering up to `max_requests` requests
    within `window_ms` (BLINK_BATCH_WINDOW_MS, BLINK_BATCH_MAX_REQUESTS, BLINK_BATCH_MAX_QUEUED), and every request
    running the model (no answer cache: the warm-up request comes again in the timed ones)."""
    settings = replace(
        engine.settings,
        batch_window_ms=window_ms,
        batch_max_requests=max_requests,
        batch_max_queued=max_queued or engine.settings.batch_max_queued,
        answer_cache_mb=0,
    )
    return blink.Deployment.serving(engine, settings)


def drive(call: Callable[[int, int], dict], clients: int, per_client: int) -> dict:
    """Run `clients` threads, each making `per_client` calls back to back; requests/s and latency percentiles."""
    latencies: list[float] = []
    batched: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def client(c: int) -> None:
        start.wait()
        for r in range(per_client):
            try:
                wall, _, result = harness.timed(lambda: call(c, r))  # noqa: B023 (called at once)
            except Exception as exc:  # noqa: BLE001 - counted and reported, never hidden
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                continue
            with lock:
                latencies.append(wall)
                batched.append(int(result.get("meta", {}).get("batched_requests", 1)))

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    load0 = os.getloadavg()[0]
    start.wait()
    wall, cpu, _ = harness.timed(lambda: [t.join() for t in threads])
    done = len(latencies)
    return {
        "clients": clients,
        "requests": clients * per_client,
        "completed": done,
        "errors": errors[:5],
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "load_avg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "requests_per_s": round(done / wall, 3) if done else 0.0,
        "p50_ms": round(1000 * harness.percentile(latencies, 50), 1) if done else None,
        "p99_ms": round(1000 * harness.percentile(latencies, 99), 1) if done else None,
        "mean_batched_requests": round(statistics.mean(batched), 2) if batched else None,
    }


def batcher_run(
    engine: blink.TorchEngine, requests: list, window_ms: float, clients: int, per_client: int, prefix: bool
) -> dict:
    """Clients submitting through one Batcher with the given window; request (c, r) is requests[c * per_client + r]."""
    dep = serving(engine, window_ms, min(blink.Batcher.MAX_REQUESTS, max(1, clients)), max(64, clients))
    with grid.prefix_cache(engine, prefix):
        dep.submit(dep.request(*requests[0]))  # the worker is up and warm before the clock starts
        row = drive(lambda c, r: dep.submit(dep.request(*requests[c * per_client + r])), clients, per_client)
    return {"target": "Batcher", "window_ms": window_ms, "prefix_cache": prefix, **row}


def serial_run(engine: blink.TorchEngine, requests: list, clients: int, per_client: int, prefix: bool) -> dict:
    """The reference without a Batcher: the same requests one after another through decide, by one client."""
    dep = serving(engine)
    with grid.prefix_cache(engine, prefix):
        dep.decide(*requests[0])  # warm, as the Batcher runs are
        row = drive(lambda c, r: dep.decide(*requests[r]), 1, clients * per_client)
    return {"target": "decide, one at a time", "window_ms": None, "prefix_cache": prefix, **row}


def app_runs(
    engine: blink.TorchEngine, requests: list, windows_ms: list[float], clients: int, per_client: int, threads: int
) -> list[dict]:
    """Clients calling the app's /decide endpoint through gradio_client: `python app.py` on the engine's model and
    settings (shared prefixes off), started once per batch window."""
    settings = engine.settings
    rows = []
    for window in windows_ms:
        env = {
            "BLINK_MODEL": engine.model_id,
            "BLINK_DTYPE": settings.compute_dtype,
            "BLINK_CPU_MATMUL": engine.matmul,
            "BLINK_TOKEN_BUDGET": str(settings.token_budget),
            "BLINK_PREFIX_KV_TOKENS": str(settings.prefix_kv_tokens),
            "BLINK_PREFIX_CACHE": "0",
            "BLINK_BATCH_WINDOW_MS": str(window),
        }
        with tempfile.TemporaryDirectory() as logs, servers.app(env, logs, servers.bench_env(threads)) as app:
            if app.down:
                return rows + [{"target": "app", "skipped": f"the app did not start: {app.down}"}]
            from gradio_client import Client

            conns = [Client(app.url, verbose=False) for _ in range(clients)]

            def call(c: int, r: int) -> dict:
                state, questions = requests[c * per_client + r]
                return conns[c].predict(state, json.dumps(questions), api_name="/decide")  # noqa: B023 (called at once)

            try:
                call(0, 0)  # the app answers at all, and is warm, before the clock starts
            except Exception as exc:  # noqa: BLE001 - the app's own failure, reported instead of the row
                return rows + [{"target": "app", "skipped": f"/decide failed: {type(exc).__name__}: {exc}"}]
            row = drive(call, clients, per_client)
            rows.append({"target": "app /decide (gradio_client)", "window_ms": window, "prefix_cache": False, **row})
    return rows
