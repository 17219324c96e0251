"""Shared fixtures: one loaded stand-in engine, tiny Qwen3.5 models, and one launched Space per test session."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
# Answers are compared with float32 references throughout, so every process the tests start (the launched app, the
# apps and CLI runs in subprocesses) runs the exact path; the default dtype rule is tested on its own
# (test_torch.py: test_one_dtype_rule_for_every_backend_on_every_device, test_the_default_dtype_answers_and_says_so).
os.environ.setdefault("BLINK_DTYPE", "float32")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import blink  # noqa: E402


DEFAULTS = blink.Settings()  # every setting at its default, on a machine without a GPU


@pytest.fixture(scope="session")
def standin() -> blink.TorchEngine:
    """The embedded stand-in (SmolLM2-135M-Instruct), loaded once by the real torch engine at default settings."""
    return blink.TorchEngine(blink.STANDIN_MODEL, settings=DEFAULTS)


@pytest.fixture()
def served():
    """A deployment that serves one ready engine as its only model: served(engine) -> blink.Deployment."""
    return blink.Deployment.serving


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory) -> str:
    """A tiny random-weight Qwen3.5 text model saved to a folder (fp32)."""
    import tiny_models

    return tiny_models.build_qwen35_text(tmp_path_factory.mktemp("qwen35") / "tiny-qwen3.5")


@pytest.fixture(scope="session")
def tiny_qwen(tiny_qwen_dir) -> blink.TorchEngine:
    """The tiny Qwen3.5 text model loaded by the real torch engine."""
    return blink.TorchEngine(tiny_qwen_dir, settings=DEFAULTS)


@pytest.fixture(scope="module")
def mock_served() -> blink.Deployment:
    """A deployment serving the mock engine (fast, fabricated numbers)."""
    return blink.Deployment.serving(blink.MockEngine("org/mock"))


@pytest.fixture(scope="session")
def launched():
    """The app module, launched once on loopback; yields (app module, local url)."""
    import app

    _, url, _ = app.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    yield app, url
    app.demo.close()


@pytest.fixture(scope="session")
def client(launched):
    """A real gradio_client connected to the launched app."""
    from gradio_client import Client

    return Client(launched[1], verbose=False)


@contextmanager
def serving(app, engine):
    """Serve the launched app's default model with another engine for the duration (a mock, a replay-only host,
    another loaded model)."""
    before = app.DEPLOYMENT.install(engine, app.DEPLOYMENT.default_model)
    try:
        yield engine
    finally:
        app.DEPLOYMENT.install(before, app.DEPLOYMENT.default_model)


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def app_process(env: dict, prelude: str = "", tmp_dir: str | None = None, timeout_s: float = 240):
    """The app started in a process of its own on a free loopback port, with extra environment and Python run
    before `import app` (e.g. to slow the model down); yields (url, path of its combined stdout/stderr log)."""
    import pathlib
    import subprocess
    import tempfile
    import time

    import httpx

    port = free_port()
    code = f"{prelude}\nimport app\napp.launch(server_name='127.0.0.1', server_port={port}, quiet=True)\n"
    log_path = os.path.join(tmp_dir or tempfile.mkdtemp(), f"app-{port}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", **env})
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, pathlib.Path(log_path).read_text()[-3000:]
            assert time.monotonic() < deadline, "the app did not come up in time"
            try:
                if httpx.get(url + "gradio_api/info", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield url, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


SECRET = "hf_SECRETtokenValue1234567890"  # set as HF_TOKEN in the crowded app: it must never come back out
# Forward passes made slow (0.5 s each) so a handful of callers overflow a tiny queue and a one-request Batcher.
SLOW_FORWARD = ("import time, blink\n_forward = blink._forward\n"
                "def _slow(*args):\n    time.sleep(0.5)\n    return _forward(*args)\n"
                "blink._forward = _slow\n")


@pytest.fixture(scope="session")
def crowded_app(tmp_path_factory):
    """A second app on the stand-in with a tiny Gradio queue, a one-request Batcher and a slowed forward, launched
    in its own process with HF_TOKEN set; yields (url, log path)."""
    env = {"BLINK_QUEUE_SIZE": "2", "BLINK_CONCURRENCY": "4", "BLINK_BATCH_WINDOW_MS": "0",
           "BLINK_BATCH_MAX_REQUESTS": "1", "BLINK_BATCH_MAX_QUEUED": "1",
           "HF_TOKEN": SECRET, "HUGGING_FACE_HUB_TOKEN": SECRET}
    with app_process(env, SLOW_FORWARD, str(tmp_path_factory.mktemp("crowded"))) as served_app:
        yield served_app
