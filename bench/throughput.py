"""Serving throughput: N concurrent clients against blink.Batcher (and, optionally, against the Gradio app)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import arms

import blink


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


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between samples."""
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


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
            t0 = time.perf_counter()
            try:
                result = call(c, r)
            except Exception as exc:  # noqa: BLE001 - counted and reported, never hidden
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                continue
            with lock:
                latencies.append(time.perf_counter() - t0)
                batched.append(int(result.get("meta", {}).get("batched_requests", 1)))

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    load0 = os.getloadavg()[0]
    start.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
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
        "p50_ms": round(1000 * percentile(latencies, 50), 1) if done else None,
        "p99_ms": round(1000 * percentile(latencies, 99), 1) if done else None,
        "mean_batched_requests": round(statistics.mean(batched), 2) if batched else None,
    }


def batcher_run(
    engine: blink.TorchEngine, requests: list, window_ms: float, clients: int, per_client: int, prefix: bool
) -> dict:
    """Clients submitting through one Batcher with the given window; request (c, r) is requests[c * per_client + r]."""
    dep = serving(engine, window_ms, min(blink.Batcher.MAX_REQUESTS, max(1, clients)), max(64, clients))
    with arms.prefix_cache(engine, prefix):
        dep.submit(dep.request(*requests[0]))  # the worker is up and warm before the clock starts
        row = drive(lambda c, r: dep.submit(dep.request(*requests[c * per_client + r])), clients, per_client)
    return {"target": "Batcher", "window_ms": window_ms, "prefix_cache": prefix, **row}


def serial_run(engine: blink.TorchEngine, requests: list, clients: int, per_client: int, prefix: bool) -> dict:
    """The reference without a Batcher: the same requests one after another through decide."""
    dep = serving(engine)
    with arms.prefix_cache(engine, prefix):
        dep.decide(*requests[0])  # warm, as the Batcher runs are
        load0 = os.getloadavg()[0]
        t0, c0 = time.perf_counter(), time.process_time()
        latencies = []
        for state, questions in requests[: clients * per_client]:
            t1 = time.perf_counter()
            dep.decide(state, questions)
            latencies.append(time.perf_counter() - t1)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "target": "decide, one at a time",
        "window_ms": None,
        "prefix_cache": prefix,
        "clients": 1,
        "requests": len(latencies),
        "completed": len(latencies),
        "errors": [],
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "load_avg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "requests_per_s": round(len(latencies) / wall, 3),
        "p50_ms": round(1000 * percentile(latencies, 50), 1),
        "p99_ms": round(1000 * percentile(latencies, 99), 1),
        "mean_batched_requests": 1.0,
    }


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_runs(
    engine: blink.TorchEngine, requests: list, windows_ms: list[float], clients: int, per_client: int
) -> list[dict]:
    """Clients calling the app's /decide endpoint through gradio_client, one app launch per batch window.
    Skipped (with the reason) when app.py is not importable here."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if importlib.util.find_spec("gradio_client") is None or not os.path.exists(os.path.join(root, "app.py")):
        return [{"target": "app", "skipped": "app.py or gradio_client is not available"}]
    rows = []
    with arms.prefix_cache(engine, False):
        for window in windows_ms:
            sys.modules.pop("app", None)
            try:
                # app.py serves this process's deployment and builds its models at import: the loaded engine answers
                # for its default model, so nothing is loaded twice
                process = blink.deployment()
                process.install(engine, process.default_model)
                from gradio_client import Client

                import app  # noqa: PLC0415 - imported per window: a fresh page and queue for each launch
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - report why the app arm could not run
                return rows + [{"target": "app", "skipped": f"import app failed: {type(exc).__name__}: {exc}"}]
            # this launch's deployment: the loaded engine as the only model, its Batcher with this window
            app.DEPLOYMENT = serving(
                engine, window, engine.settings.batch_max_requests, engine.settings.batch_max_queued
            )
            port = free_port()
            app.demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
            try:
                url = f"http://127.0.0.1:{port}/"
                conns = [Client(url, verbose=False) for _ in range(clients)]

                def call(c: int, r: int) -> dict:
                    state, questions = requests[c * per_client + r]
                    return conns[c].predict(state, json.dumps(questions), api_name="/decide")  # noqa: B023 (called at once)

                try:
                    call(0, 0)  # the app answers at all, and is warm, before the clock starts
                except Exception as exc:  # noqa: BLE001 - the app's own failure, reported instead of the row
                    return rows + [{"target": "app", "skipped": f"/decide failed: {type(exc).__name__}: {exc}"}]
                rows.append(
                    {
                        "target": "app /decide (gradio_client)",
                        "window_ms": window,
                        "prefix_cache": False,
                        **drive(call, clients, per_client),
                    }
                )
            finally:
                app.demo.close()
    return rows
