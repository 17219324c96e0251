"""The one way a server is started, for the benchmarks and the tests alike: blink's own app (`python app.py`), a peer's
server (`transformers serve`, vLLM's), each a process of its own in a process group of its own with its output in a
log file, waited for until it answers, and stopped with everything it started (vLLM's engine core outlives a server
stopped alone); and a local Ray cluster with Serve on it (ray_serve), for blink's Serve app."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
APP = os.path.join(ROOT, "app.py")


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench_env(threads: int | None = None) -> dict:
    """The environment of a server a benchmark starts: this one without BLINK_* variables (blink at its defaults),
    no hub access, and `threads` CPU threads where given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLINK_")}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_UPDATE_CHECK="1", TOKENIZERS_PARALLELISM="false")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def app_env(port: int, env: dict | None = None) -> dict:
    """What blink's app is told on top of its environment: serve on 127.0.0.1:`port`, Gradio's analytics off, and
    `env` (its BLINK_* variables)."""
    return {
        "GRADIO_ANALYTICS_ENABLED": "False",
        "GRADIO_SERVER_NAME": "127.0.0.1",
        "GRADIO_SERVER_PORT": str(port),
        **(env or {}),
    }


def start(cmd: list[str], log: str, env: dict) -> subprocess.Popen:
    """`cmd` started from the repository root with environment `env`, its output to the file `log`, leading a
    process group of its own (stop() ends it and whatever it started)."""
    with open(log, "w", encoding="utf-8") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_up(proc: subprocess.Popen, url: str, timeout_s: float) -> str | None:
    """None once GET url answers below 500; else why not: the process ended (at once), or the time ran out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"the server exited with status {proc.returncode}"
        try:
            if httpx.get(url, timeout=5).status_code < 500:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return f"the server did not answer within {timeout_s:.0f} s"


def stop(proc: subprocess.Popen) -> None:
    """Stop a process started by start() and everything in its process group: SIGINT, then SIGKILL."""
    for sig, wait_s in ((signal.SIGINT, 30), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the group is gone already
            return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone; what it started may not be
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return


def log_tail(log: str, chars: int = 3000) -> str:
    """The end of a server's log."""
    with open(log, encoding="utf-8", errors="replace") as fh:
        return fh.read()[-chars:]


@dataclass
class Server:
    """A started server: its process, its base url (ending in /), its log file, and why it is not up (None: up, or
    not waited for yet)."""

    proc: subprocess.Popen
    url: str
    log: str
    down: str | None = None

    def wait(self, health: str = "", timeout_s: float = 600) -> Server:
        """Wait until GET url + health answers; `down` says why it did not."""
        self.down = wait_up(self.proc, self.url + health, timeout_s)
        return self


@contextlib.contextmanager
def started(cmd: list[str], url: str, log: str, env: dict) -> Iterator[Server]:
    """A server started for the duration, not waited for (start several, then wait for each: they start side by
    side); stopped with its process group on leaving."""
    proc = start(cmd, log, env)
    try:
        yield Server(proc, url, log)
    finally:
        stop(proc)


@contextlib.contextmanager
def running(
    cmd: list[str], url: str, log: str, env: dict, health: str = "", timeout_s: float = 600
) -> Iterator[Server]:
    """A server for the duration, waited for until GET url + health answers (`down` says why it did not)."""
    with started(cmd, url, log, env) as server:
        yield server.wait(health, timeout_s)


def app_command(python: str = sys.executable, prelude: str | None = None) -> list[str]:
    """blink's app as a user starts it, `python app.py` (in `python`'s environment); with a `prelude`, that Python
    run before `import app`, then the app launched (on GRADIO_SERVER_NAME and GRADIO_SERVER_PORT)."""
    if prelude is None:
        return [python, APP]
    return [python, "-c", f"{prelude}\nimport app\napp.launch(quiet=True)\n"]


@contextlib.contextmanager
def app_started(
    env: dict, log_dir: str, base: dict | None = None, python: str = sys.executable, prelude: str | None = None
) -> Iterator[Server]:
    """blink's app (app_command) on a free loopback port for the duration, not waited for, with `env` on top of
    `base` (default: bench_env())."""
    port = free_port()
    environment = {**(bench_env() if base is None else base), **app_env(port, env)}
    log = os.path.join(log_dir, f"app-{port}.log")
    with started(app_command(python, prelude), f"http://127.0.0.1:{port}/", log, environment) as server:
        yield server


@contextlib.contextmanager
def app(
    env: dict, log_dir: str, base: dict | None = None, python: str = sys.executable, timeout_s: float = 600
) -> Iterator[Server]:
    """blink's app as app_started() starts it, waited for until its page answers."""
    with app_started(env, log_dir, base, python) as server:
        yield server.wait(timeout_s=timeout_s)


# What a Ray cluster's working directory leaves out: environments, history, results and tests (Ray uploads the rest).
RAY_EXCLUDES = [".git", ".venv", ".venv-vllm", "bench/results", "tests/data", "tests/artifacts", "*.pyc"]
# What a local cluster's nodes are started with: no usage reports; Ray's memory monitor off (other programs on a shared
# machine must not get its workers killed); and a minute for Serve's HTTP proxy to answer its ready and health checks
# (5 and 10 s by default: a proxy still starting on a busy two-core machine misses them, and Serve kills it).
RAY_NODE_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_memory_monitor_refresh_ms": "0",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
}


def cluster_processes(cluster) -> list:
    """Every process of a ray.cluster_utils.Cluster's nodes and their children (workers, replicas), as psutil
    processes."""
    import psutil

    found = []
    for node in cluster.list_all_nodes():
        for infos in node.all_processes.values():
            for info in infos:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc = psutil.Process(info.process.pid)
                    found += [proc, *proc.children(recursive=True)]
    return found


# The longest temp root a local cluster's folder goes under: below it come blink-ray-XXXXXXXX/ray/session_<date>_<pid>/
# sockets/<name>, about 95 characters, and a socket's path must fit in 107.
RAY_TEMP_ROOT_MAX = 16


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """This process's environment with `values` set for the duration; afterwards each variable is as it was (set to
    what it was, or unset)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ray_temp_root() -> str:
    """Where a local cluster's own temp folder goes: RAY_TMPDIR, else TMPDIR, else /tmp (Ray's own order), or /tmp
    where that folder's path is too long for Ray's socket paths."""
    root = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return root if len(root) <= RAY_TEMP_ROOT_MAX else "/tmp"


@contextlib.contextmanager
def ray_temp() -> Iterator[str]:
    """A new temp folder of this cluster's own under ray_temp_root(), made Ray's temp root (RAY_TMPDIR) in this
    process for the duration, so every path Ray derives from its default temp folder lands inside it: the sessions,
    the sockets, and the address file that ray.cluster_utils writes to `<temp root>/ray` whatever temp_dir the head
    was given (Ray's default /tmp/ray exists only where Ray ran before). On leaving, RAY_TMPDIR is as it was and
    the folder is gone."""
    temp = tempfile.mkdtemp(prefix="blink-ray-", dir=ray_temp_root())
    try:
        with environment({"RAY_TMPDIR": temp}):
            yield temp
    finally:
        shutil.rmtree(temp, ignore_errors=True)


@contextlib.contextmanager
def ray_serve(env_vars: dict | None = None, nodes: int = 2, cpus: int = 1) -> Iterator[str]:
    """A local Ray cluster of `nodes` nodes with `cpus` CPUs each on this machine (Ray's own ray.cluster_utils),
    this process its driver (the repository its working directory, `env_vars` set in each of its processes), Serve
    started with its HTTP proxy on a free loopback port; yields the proxy's URL. Everything Ray writes goes to a
    temp folder of the cluster's own (ray_temp), so it needs nothing outside the clone that it does not make itself
    and leaves nothing behind. On leaving, Serve, the driver and every node stop, and every process the cluster
    started is waited for until it is gone (one left over is an error naming it). The nodes start with RAY_NODE_ENV."""
    with ray_temp():
        with _ray_serve(env_vars, nodes, cpus) as url:
            yield url


@contextlib.contextmanager
def _ray_serve(env_vars: dict | None, nodes: int, cpus: int) -> Iterator[str]:
    """ray_serve inside its temp folder (RAY_TMPDIR set): the cluster, the driver, Serve, and their stop."""
    import psutil
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    with environment(RAY_NODE_ENV):  # the nodes, and every process they start, inherit these
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": cpus, "gcs_server_port": free_port(), "include_dashboard": False},
        )
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus)
    try:
        ray.init(
            address=cluster.address,
            runtime_env={"working_dir": ROOT, "excludes": RAY_EXCLUDES, "env_vars": dict(env_vars or {})},
            logging_level="ERROR",
            log_to_driver=False,
        )
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        yield f"http://127.0.0.1:{port}"
    finally:
        processes = cluster_processes(cluster)  # the nodes' processes and every worker and replica they started
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        cluster.shutdown()

        def alive(proc) -> bool:
            try:
                return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        def left() -> list:
            return [p for p in processes if alive(p)]

        deadline = time.monotonic() + 60
        while left() and time.monotonic() < deadline:
            time.sleep(0.5)
        if left():
            raise RuntimeError(f"Ray processes left running: {[' '.join(p.cmdline()[:2]) for p in left()]}")
