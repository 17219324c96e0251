"""The README documents every setting blink.py and app.py read, with the defaults the code has, so the docs cannot
drift from the code."""

from __future__ import annotations

import os
import re

import blink

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTING = re.compile(r"[\"'](BLINK_[A-Z][A-Z0-9_]*)[\"']")  # a quoted name: each is an environment variable
NUMERIC_DEFAULT = re.compile(r"os\.environ\.get\(\"(BLINK_[A-Z0-9_]+)\", \"(\d+)\"\)")


def source(name: str) -> str:
    """A file of the project, as text."""
    with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
        return fh.read()


def limits_rows() -> list[str]:
    """The table rows of the README's "Security and limits" section."""
    section = source("README.md").split("## Security and limits", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("|")]


def row_of(name: str) -> str:
    """The limits row that documents a variable."""
    rows = [row for row in limits_rows() if f"`{name}`" in row]
    assert len(rows) == 1, (name, rows)
    return rows[0]


def shows(row: str, value: int) -> bool:
    """True when the row states the number (written with thousands separators), not as part of another number."""
    return re.search(rf"(?<!\d)(?<!\d,){re.escape(f'{value:,}')}(?!\d|,\d)", row) is not None


def test_every_setting_the_code_reads_is_documented():
    read = set(SETTING.findall(source("blink.py") + source("app.py")))
    documented = set(re.findall(r"`(BLINK_[A-Z0-9_]+)`", source("README.md")))
    assert len(read) >= 20
    assert sorted(read - documented) == []


def test_limits_are_documented_with_the_defaults_of_the_code():
    defaults = dict(NUMERIC_DEFAULT.findall(source("blink.py") + source("app.py")))
    limits = {name: int(v) for name, v in defaults.items() if any(f"`{name}`" in row for row in limits_rows())}
    assert {"BLINK_MAX_INPUT_TOKENS", "BLINK_MAX_REQUEST_TOKENS", "BLINK_MAX_JSON_DEPTH", "BLINK_TOKEN_BUDGET",
            "BLINK_QUEUE_SIZE", "BLINK_CONCURRENCY", "BLINK_BATCH_MAX_QUEUED", "BLINK_GPU_DURATION"} <= set(limits)
    if "BLINK_MAX_REQUEST_CHARS" not in os.environ:
        limits["BLINK_MAX_REQUEST_CHARS"] = blink.MAX_REQUEST_CHARS
    for name, value in limits.items():
        assert shows(row_of(name), value), (name, value, row_of(name))
    fixed = {"questions per request": blink.MAX_QUESTIONS, "options of a `choice`": blink.MAX_OPTIONS,
             "prompts one request renders": blink.MAX_PROMPTS,
             "requests in one `/decide_batch`": blink.MAX_BATCH_REQUESTS}
    for label, value in fixed.items():
        rows = [row for row in limits_rows() if row.startswith(f"| {label}")]
        assert len(rows) == 1 and shows(rows[0], value), (label, value, rows)
