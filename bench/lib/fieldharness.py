"""What the field's harness benchmarks (bench/jevbench.py, bench/krite.py) share: each harness's pinned environment
(tools/setup.sh --harnesses makes .venv-jevbench and .venv-krite), the two ways blink's app is started for them
(`python app.py` at its defaults, and with BLINK_DTYPE=float32), and a harness command run and timed."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

import blink
from bench.lib import harness, servers

MODEL = "jev-latest"  # the "model" field every harness request carries (the SDK's default model name)
# Each arm is `python app.py` as a user starts it, with only these variables set: its defaults, then float32
ARMS = {"defaults": {}, "float32": {"BLINK_DTYPE": "float32"}}
START_S = 600


def environment(name: str) -> str:
    """The harness environment's folder (.venv-NAME in the repository root)."""
    return os.path.join(servers.ROOT, f".venv-{name}")


def missing(name: str) -> str | None:
    """Why the harness `name` cannot run here (None when it can)."""
    if not os.path.exists(os.path.join(environment(name), "bin", "python")):
        return f"no {name} environment at {environment(name)} (bash tools/setup.sh --harnesses builds it)"
    return None


def begin(name: str, argv: list[str] | None, description: str, flags) -> harness.Run | None:
    """The run of the harness `name` (its own flags; every core unless told), or None, having said why, where its
    environment is missing."""
    run = harness.Run(name, argv, description, flags, threads="0")
    why = missing(name)
    if why:
        print(f"skipped: {why}; nothing was measured")
        return None
    return run


def version(name: str, package: str) -> str:
    """The version of `package` installed in the harness environment `name`."""
    python = os.path.join(environment(name), "bin", "python")
    got = run([python, "-c", f"import importlib.metadata as m; print(m.version({package!r}))"], ".")
    return got["stdout"].strip()


def targets_line(targets: list[dict], sep: str = "; ") -> str:
    """Each target with met or missed and its value, for the line a harness prints last."""
    return sep.join(f"{t['target']}: {'met' if t['met'] else 'missed'} ({t['value']})" for t in targets)


def arm_dtype(arm: str) -> str:
    """The dtype blink computes in under the arm's variables on this machine."""
    return blink.Settings.from_env(ARMS[arm]).compute_dtype


@contextlib.contextmanager
def app(arm: str, logs: str) -> Iterator[str]:
    """blink's app for the arm (`python app.py`, no thread limit: as a user starts it), waited for: its base url."""
    with servers.app(ARMS[arm], logs, servers.bench_env(), timeout_s=START_S) as server:
        if server.down:
            raise RuntimeError(f"blink's app ({arm}) did not come up: {server.down}\n{servers.log_tail(server.log)}")
        yield server.url


def run(cmd: list[str], cwd: str, env: dict | None = None, timeout_s: float = 7200) -> dict:
    """A harness command run to its end: {command, returncode, seconds, stdout, stderr (their ends)}."""
    watch = harness.Stopwatch()
    done = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )  # fmt: skip
    return {
        "command": " ".join(os.path.relpath(c, servers.ROOT) if c.startswith(servers.ROOT) else c for c in cmd),
        "returncode": done.returncode,
        "seconds": round(watch.seconds(), 1),
        "stdout": done.stdout[-6000:],
        "stderr": done.stderr[-3000:],
    }
