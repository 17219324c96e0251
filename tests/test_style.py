"""The code has one format: ruff's (pyproject.toml), checked the way CI checks it."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUFF = os.path.join(os.path.dirname(sys.executable), "ruff")


def ruff(*args: str) -> subprocess.CompletedProcess:
    """ruff from the test environment, run over the repository."""
    return subprocess.run([RUFF, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_code_is_formatted_by_ruff():
    done = ruff("format", "--check", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_check_passes():
    done = ruff("check", ".")
    assert done.returncode == 0, done.stdout + done.stderr
