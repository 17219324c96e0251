"""Shared fixtures: one loaded stand-in engine, tiny Qwen3.5 models, and one launched Space per test session."""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import replace

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
# Answers are compared with float32 references throughout, so every process the tests start (the launched app, the
# apps and CLI runs in subprocesses) runs the exact path; the default dtype rule is tested on its own
# (test_torch.py: test_one_dtype_rule_for_every_backend_on_every_device, test_the_default_dtype_answers_and_says_so).
os.environ.setdefault("BLINK_DTYPE", "float32")
# and every request they send runs the model, so two runs of one request can be compared (the answer cache, on by
# default, is tested on its own in test_answer_cache.py; in-process deployments turn it off in `served`)
os.environ.setdefault("BLINK_ANSWER_CACHE_MB", "0")

# What libraries keep in the temp folder by default and leave there (Gradio's uploads and cached files in
# <temp>/gradio; the folder torch makes for its compiler's cache, <temp>/torchinductor_<user>, when transformers loads
# a model; vLLM's sockets) goes to a folder of this session's instead, for the suite and every process it starts, and
# is removed when the session ends (pytest_sessionfinish).
SESSION_TEMP = tempfile.mkdtemp(prefix="blink-tests-")
os.environ.setdefault("GRADIO_TEMP_DIR", os.path.join(SESSION_TEMP, "gradio"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(SESSION_TEMP, "torchinductor"))
# vLLM's engine sockets (<temp>/<uuid>, left behind when a server is stopped) likewise
os.makedirs(os.path.join(SESSION_TEMP, "vllm"))
os.environ.setdefault("VLLM_RPC_BASE_PATH", os.path.join(SESSION_TEMP, "vllm"))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import blink  # noqa: E402
from bench.lib import servers  # noqa: E402

DEFAULTS = blink.Settings()  # every setting at its default, on a machine without a GPU


def pytest_sessionfinish(session, exitstatus) -> None:
    """The session's temp folder goes with it."""
    shutil.rmtree(SESSION_TEMP, ignore_errors=True)


def invariance_bar(engine: blink.TorchEngine) -> float:
    """The bar for one answer asked two ways (alone, packed, beside other questions): krite-bench's, 1e-5 in float32
    and 1e-3 in bfloat16/float16, where the engine's linear layers give a row the same bits at every batch size. Where
    they do not (rows_alone: oneDNN's bfloat16 product on an Intel Xeon with AMX at 2 threads gave a row other bits
    at 60 to 513 rows than at 16 or 1,024, and a stand-in answer moved by up to 0.0097), the bound bfloat16 is held
    to against float32, 0.03: a question mixed with another request's moves by far more."""
    import torch

    if engine.model.dtype == torch.float32:
        return 1e-5
    return 1e-3 if rows_alone(engine) else 0.03


@functools.cache
def rows_alone(engine: blink.TorchEngine) -> bool:
    """Whether the engine's first MLP product gives each row the same bits at 16, 60, 200, 513 and 1024 rows."""
    import torch

    layer = engine.backbone().layers[0].mlp.gate_proj
    width = engine.model.config.hidden_size
    x = torch.randn(1024, width, generator=torch.Generator().manual_seed(0)).to(engine.model.dtype)
    with torch.no_grad():
        whole = layer(x)
        return all(torch.equal(layer(x[:m]), whole[:m]) for m in (16, 60, 200, 513))


@pytest.fixture(scope="session")
def standin() -> blink.TorchEngine:
    """The embedded stand-in (SmolLM2-135M-Instruct), loaded once by the real torch engine at default settings."""
    return blink.TorchEngine(blink.STANDIN_MODEL, settings=DEFAULTS)


def serving_without_answer_cache(engine: blink.Engine, settings: blink.Settings | None = None) -> blink.Deployment:
    """A deployment that serves one ready engine as its only model, its answer cache off: a request asked twice runs
    the model twice (the tests compare such runs; tests/test_answer_cache.py serves with the cache on)."""
    return blink.Deployment.serving(engine, replace(settings or engine.settings, answer_cache_mb=0))


@pytest.fixture()
def served():
    """served(engine[, settings]) -> a blink.Deployment serving that engine alone (serving_without_answer_cache)."""
    return serving_without_answer_cache


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


free_port = servers.free_port


@contextmanager
def app_process(env: dict, tmp_dir: str, prelude: str = "", timeout_s: float = 600):
    """The app started in a process of its own on a free loopback port, with extra environment and Python run
    before `import app` (e.g. to gate the model), its log in `tmp_dir` (a test's tmp_path: pytest removes it); yields
    (url, path of its combined stdout/stderr log). The deadline
    only stops a start that hangs (a start that fails ends the wait at once, with its log)."""
    proc, url, log_path = start_app(env, tmp_dir, prelude)
    try:
        wait_up(proc, url, log_path, timeout_s)
        yield url, log_path
    finally:
        servers.stop(proc)


def start_app(env: dict, tmp_dir: str, prelude: str = "", python: str = sys.executable, as_script: bool = False):
    """Start the app on a free loopback port without waiting for it, as bench/lib/servers.py starts it: `import app`
    after `prelude` in `python`, or as_script: `python app.py` itself. This environment (BLINK_DTYPE=float32 and all)
    plus `env`, its log in `tmp_dir`. Returns (process, url, log path); the process leads a process group of its own
    (servers.stop ends it and whatever it started)."""
    port = free_port()
    log_path = os.path.join(tmp_dir, f"app-{port}.log")
    cmd = servers.app_command(python, None if as_script else prelude)
    proc = servers.start(cmd, log_path, {**os.environ, **servers.app_env(port, env)})
    return proc, f"http://127.0.0.1:{port}/", log_path


def wait_up(proc, url: str, log_path: str, timeout_s: float) -> None:
    """Return once the started app answers; fail with its log's tail if it exits or takes over timeout_s."""
    why = servers.wait_up(proc, url + "gradio_api/info", timeout_s)
    assert why is None, f"{why}\n{servers.log_tail(log_path)}"


SECRET = "hf_SECRETtokenValue1234567890"  # set as HF_TOKEN in the crowded app: it must never come back out


def wait_until(check, timeout_s: float = 120) -> bool:
    """Poll `check` until it is true or the time is up; its last value."""
    import time

    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


class Gates:
    """Gates in an app running in another process, worked from the tests through files in one folder: `admit` holds
    each request before it is prepared (before it can reach the Batcher), `forward` holds each call of the model.
    Every request that reaches a gate leaves a file there, so a test can wait until the requests it expects have
    arrived. Both gates stand open unless a test closes them (`with gates.closed(...)`)."""

    NAMES = ("admit", "forward")

    def __init__(self, folder: str):
        self.folder = folder
        for name in self.NAMES:
            self.open(name)

    def prelude(self) -> str:
        """Python run in the app's process before `import app`: both gates put in place."""
        return (
            f"import os, time, uuid, blink\n_GATES = {self.folder!r}\n"
            "def _gated(name, fn):\n"
            "    def gated(*args, **kwargs):\n"
            "        open(os.path.join(_GATES, f'{name}-{uuid.uuid4().hex}.arrived'), 'w').close()\n"
            "        while not os.path.exists(os.path.join(_GATES, name + '.open')):\n"
            "            time.sleep(0.01)\n"
            "        return fn(*args, **kwargs)\n"
            "    return gated\n"
            "blink.Deployment.submit_many = _gated('admit', blink.Deployment.submit_many)\n"
            "blink.run_jobs = _gated('forward', blink.run_jobs)\n"
        )

    def open(self, name: str) -> None:
        """Let everything held at gate `name` through, and whatever comes later."""
        open(os.path.join(self.folder, name + ".open"), "w").close()

    def close(self, name: str) -> None:
        """Hold what reaches gate `name` from now on; its count of arrivals starts again from zero."""
        import glob

        os.remove(os.path.join(self.folder, name + ".open"))
        for path in glob.glob(os.path.join(self.folder, f"{name}-*.arrived")):
            os.remove(path)

    def arrived(self, name: str) -> int:
        """How many calls reached gate `name` since it was closed."""
        import glob

        return len(glob.glob(os.path.join(self.folder, f"{name}-*.arrived")))

    @contextmanager
    def closed(self, *names: str):
        """The gates named held closed for the duration; every gate open again afterwards, whatever happened."""
        for name in names:
            self.close(name)
        try:
            yield self
        finally:
            for name in self.NAMES:
                self.open(name)


@pytest.fixture(scope="session")
def crowd_gates(tmp_path_factory) -> Gates:
    """The gates of the crowded app (open unless a test closes them)."""
    return Gates(str(tmp_path_factory.mktemp("crowd-gates")))


@pytest.fixture(scope="session")
def crowded_app(tmp_path_factory, crowd_gates):
    """A second app on the stand-in with a tiny Gradio queue (4 running, 2 waiting), a one-request Batcher (one
    running, one waiting) and `crowd_gates` in front of admission and the model, launched in its own process with
    HF_TOKEN set; yields (url, log path)."""
    env = {
        "BLINK_QUEUE_SIZE": "2",
        "BLINK_CONCURRENCY": "4",
        "BLINK_BATCH_WINDOW_MS": "0",
        "BLINK_BATCH_MAX_REQUESTS": "1",
        "BLINK_BATCH_MAX_QUEUED": "1",
        "HF_TOKEN": SECRET,
        "HUGGING_FACE_HUB_TOKEN": SECRET,
    }
    with app_process(env, str(tmp_path_factory.mktemp("crowded")), crowd_gates.prelude()) as served_app:
        yield served_app


def scrape_metrics(url: str, headers: dict | None = None) -> dict[tuple, float]:
    """An app's /metrics, parsed: {(sample name, (label, value) pairs sorted): value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "metrics", headers=headers, timeout=60).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
