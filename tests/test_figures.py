"""Every figure README.md, docs/ and bench/README.md quote from a committed results file is in that file: each
markdown table under a sentence naming `bench/results/X.json` whose header `python -m bench report` prints for X is
printed row for row, and each figure of a paragraph naming one results file is printed by the report or held by the
file (at the precision it is quoted). Nothing here imports torch."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from functools import cache

from bench.lib import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
# A results file named in prose: its path, or its name in backquotes.
MENTION = re.compile(r"(?:bench/results/|`)([\w.-]+\.json)")
# A mention of an earlier run's file, not the committed one: "the shape4b.json committed at 42f266b", "git show REV:".
EARLIER = re.compile(r"committed at [0-9a-f]{7}|git show [0-9a-f]{7}:|at commit [0-9a-f]{7}")
# A number as the docs write one (thousands separators allowed), with the unit that may follow it.
NUMBER = re.compile(
    r"(?<![\w.,/:-])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?:-(?=\d))?"
    r"(\s?(?:x|×|%|s|ms|min|GFLOP/s|GB|GiB|MB|MiB|points)(?![\w.]\w))?(?![\w-])"
)
# What is not a figure: a date or time, a version, a commit, a model or CPU name, a limit or a target.
NOT_A_FIGURE = re.compile(
    r"\d{4}-\d{2}-\d{2}(?:T\d{2}:\d{2}Z)?|\b\d+\.\d+(?:\.\d+)+\b|\b[0-9a-f]{7,40}\b|[A-Za-z]+[\w.-]*\d[\w.-]*"
)
# Words before a number that make it a goal, a bound or a setting, not a measurement.
BOUND = re.compile(r"(?:targets?|at least|bound|within|under|over|above|below|limit|of|at|to|than)\s*$")


@dataclass(frozen=True)
class Block:
    """A table or a paragraph of a markdown file, with the results file it quotes (the nearest one named before it in
    its section, or in it)."""

    doc: str
    line: int
    text: str
    source: str | None
    table: bool


def source(name: str) -> str:
    """A file of the project, as text."""
    with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
        return fh.read()


def markdown_files() -> list[str]:
    """README.md, bench/README.md and every page of docs/, relative to the repository root."""
    docs = sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    return ["README.md", os.path.join("bench", "README.md"), *docs]


def committed() -> set[str]:
    """The names of the committed results files."""
    return {n for n in os.listdir(RESULTS) if n.endswith(".json")}


def named(text: str) -> list[str]:
    """The committed results files a text names, in order (an earlier run's file left out)."""
    text = EARLIER.sub("", re.sub(r"[^\s(]*\s+committed at [0-9a-f]{7}", "", text))
    return [n for n in MENTION.findall(text) if n in committed()]


def blocks(doc: str, text: str) -> list[Block]:
    """A markdown text's tables and paragraphs (code blocks left out), each with the results file it quotes: a
    paragraph naming results files quotes the last it names, any other block the last one named before it in its
    section."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    out, current, start, lines = [], None, 0, []

    def close() -> None:
        nonlocal current, lines
        if not lines:
            return
        body = "\n".join(lines)
        table = body.startswith("|")
        names = [] if table else named(body)
        out.append(Block(doc, start + 1, body, names[-1] if len(set(names)) == 1 else current, table))
        if names:
            current = names[-1]
        lines = []

    for i, line in enumerate(text.splitlines()):
        is_row = line.startswith("|")
        if line.startswith("#"):
            close()
            current = None
        elif not line.strip() or (lines and is_row != lines[0].startswith("|")):
            close()
        if line.strip() and not line.startswith("#"):
            if not lines:
                start = i
            lines.append(line)
    close()
    return out


@cache
def printed(name: str) -> str:
    """What `python -m bench report` prints for a committed results file."""
    return report.report(results(name))


@cache
def results(name: str):
    """A committed results file's contents."""
    with open(os.path.join(RESULTS, name), encoding="utf-8") as fh:
        return json.load(fh)


def numbers(value) -> list[float]:
    """Every number a JSON value holds, at any depth."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers(v)]
    return []


def cells(row: str) -> list[str]:
    """A table row's cells, whitespace normalised."""
    return [" ".join(c.split()) for c in row.strip().strip("|").split("|")]


def table_misses(block: Block, out: str) -> list[str] | None:
    """The rows of a table that the report does not print (None: the report prints no table with its header)."""
    rows = block.text.splitlines()
    printed_rows = {tuple(cells(line)) for line in out.splitlines() if line.startswith("|")}
    if tuple(cells(rows[0])) not in printed_rows:
        return None
    return [row for row in rows[2:] if tuple(cells(row)) not in printed_rows]


def quoted(text: str) -> list[tuple[str, str, str]]:
    """The figures a paragraph quotes: (the number as written, its unit, the text before it); dates, versions,
    commits, names with digits in them, and numbers a word marks as a target or a bound left out."""
    text = re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), text)  # code and names
    text = re.sub(r"\[[^\]]*\]\([^)]*\)", lambda m: " " * len(m.group(0)), text)  # links
    text = NOT_A_FIGURE.sub(lambda m: " " * len(m.group(0)), text)
    out = []
    for m in NUMBER.finditer(text):
        whole, frac, unit = m.group(1), m.group(2) or "", (m.group(3) or "").strip()
        if not unit and m.group(0).endswith("-"):  # the first of a range takes the second's unit
            nxt = NUMBER.match(text, m.end())
            unit = (nxt.group(3) or "").strip() if nxt else ""
        digits = (whole + frac).replace(",", "").replace(".", "").lstrip("0")
        if not (unit or frac or len(digits) >= 3):
            continue
        before = text[max(0, m.start() - 20) : m.start()]
        if BOUND.search(before) and not unit and not frac:
            continue
        out.append((whole + frac, unit, before))
    return out


def held(figure: str, unit: str, out: str, values: list[float]) -> bool:
    """True when a figure is printed by the report (as written) or is one of the file's values at the precision it
    is quoted (a share as a percentage, bytes in MB or GB, seconds in ms or minutes too)."""
    if re.search(rf"(?<![\d.,]){re.escape(figure)}(?![\d]|,\d|\.\d)", out):
        return True
    q = float(figure.replace(",", ""))
    decimals = len(figure.split(".")[1]) if "." in figure else 0
    scales = [1.0, 100.0, 1e-6, 1e-9, 2.0**-30, 2.0**-20, 1000.0, 1 / 60]
    return any(
        math.isclose(round(v * s, decimals), q, abs_tol=10**-decimals / 2 + 1e-12) for v in values for s in scales
    )


def misses(doc: str, text: str) -> tuple[list[tuple], int, int]:
    """What a markdown text quotes that its results file does not hold: (doc, line, the row or figure, the file);
    and how many tables and figures were checked."""
    found, tables, figures = [], 0, 0
    for block in blocks(doc, text):
        if block.source is None:
            continue
        out = printed(block.source)
        if block.table:
            rows = table_misses(block, out)
            if rows is not None:
                tables += 1
                found += [(doc, block.line, row, block.source) for row in rows]
            continue
        if len(set(named(block.text))) > 1:
            continue
        values = numbers(results(block.source))
        for figure, unit, _ in quoted(block.text):
            figures += 1
            if not held(figure, unit, out, values):
                found.append((doc, block.line, f"{figure}{unit}", block.source))
    return found, tables, figures


def test_every_quoted_figure_is_in_the_results_file_it_names():
    found, tables, figures = [], 0, 0
    for doc in markdown_files():
        f, t, n = misses(doc, source(doc))
        found, tables, figures = found + f, tables + t, figures + n
    assert tables >= 10 and figures >= 100, (tables, figures)
    assert found == []
