"""Shared fixtures: one launched Space (the real app on 127.0.0.1) for every test that talks to it."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def served():
    """The app module, launched once on loopback; yields (app module, local url)."""
    import app

    _, url, _ = app.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    yield app, url
    app.demo.close()


@pytest.fixture(scope="session")
def client(served):
    """A real gradio_client connected to the launched app."""
    from gradio_client import Client

    return Client(served[1], verbose=False)


@contextmanager
def serving(engine):
    """Serve the default model with another engine for the duration (a mock, or a replay-only host)."""
    import blink

    before = blink._ENGINE
    blink._ENGINE = engine
    try:
        yield engine
    finally:
        blink._ENGINE = before
