"""Shared fixtures: one loaded stand-in engine, tiny Qwen3.5 models, and one launched Space per test session."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import blink  # noqa: E402


@pytest.fixture(scope="session")
def standin() -> blink.TorchEngine:
    """The embedded stand-in (SmolLM2-135M-Instruct), loaded once by the real torch engine."""
    return blink.TorchEngine(blink.STANDIN_MODEL)


@pytest.fixture()
def served(monkeypatch):
    """Let a test install engines for blink.decide() without leaking them into other tests."""
    monkeypatch.setattr(blink, "_ENGINE", None)
    monkeypatch.setattr(blink, "_ENGINES", {})

    def install(eng, model_id: str | None = None) -> None:
        model_id = model_id or eng.model_id
        monkeypatch.setattr(blink, "MODEL_ID", model_id)
        monkeypatch.setattr(blink, "MODEL_SPECS", [(model_id, None)])
        monkeypatch.setattr(blink, "_ENGINE", eng)

    return install


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory) -> str:
    """A tiny random-weight Qwen3.5 text model saved to a folder (fp32)."""
    import tiny_models

    return tiny_models.build_qwen35_text(tmp_path_factory.mktemp("qwen35") / "tiny-qwen3.5")


@pytest.fixture(scope="session")
def tiny_qwen(tiny_qwen_dir) -> blink.TorchEngine:
    """The tiny Qwen3.5 text model loaded by the real torch engine."""
    return blink.TorchEngine(tiny_qwen_dir)


@pytest.fixture(scope="module")
def mock_served():
    """The mock engine as the served engine for a whole module (fast, fabricated numbers)."""
    saved = (blink._ENGINE, blink.MODEL_ID, blink.MODEL_SPECS)
    blink._ENGINE = blink.MockEngine("org/mock")
    blink.MODEL_ID, blink.MODEL_SPECS = "org/mock", [("org/mock", None)]
    yield blink._ENGINE
    blink._ENGINE, blink.MODEL_ID, blink.MODEL_SPECS = saved


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
def serving(engine):
    """Serve the default model with another engine for the duration (a mock, or a replay-only host)."""
    before = blink._ENGINE
    blink._ENGINE = engine
    try:
        yield engine
    finally:
        blink._ENGINE = before
