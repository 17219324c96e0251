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
EARLIER_FILE = re.compile(r"the [\w.-]+\.json committed at [0-9a-f]{7}|git show [0-9a-f]{7}:\S+")
# A sentence quoting an earlier run: its figures are that run's, which no committed file holds.
EARLIER_RUN = re.compile(
    r"committed at [0-9a-f]{7}|git show [0-9a-f]{7}|at commit [0-9a-f]{7}|measured at [0-9a-f]{7}|the run of \d{4}-"
)
# A number as the docs write one (thousands separators allowed), with the unit that may follow it.
NUMBER = re.compile(
    r"(?<![\w.,/:-])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?:-(?=\d))?"
    r"(\s?(?:x|×|%|s|ms|min|GFLOP/s|GB|GiB|MB|MiB|points)(?![\w.]\w))?(?![\w-]|,\d)"
)
# What is not a figure: a date or time, a version, a commit, a model or CPU name, a limit or a target.
NOT_A_FIGURE = re.compile(
    r"\d{4}-\d{2}-\d{2}(?:T\d{2}:\d{2}Z)?|\b\d+\.\d+(?:\.\d+)+\b|\b[0-9a-f]{7,40}\b|[A-Za-z]+[\w.-]*\d[\w.-]*"
)
# Words before a number that make it a goal, a bound, a setting or an estimate, not a measurement.
BOUND = re.compile(r"(?:targets?|at least|bound|limit|about|~|/)\s*$")


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
    text = EARLIER_FILE.sub("", text)
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
        elif (
            not line.strip() or (lines and is_row != lines[0].startswith("|")) or re.match(r"\s*(?:[-*]|\d+\.) ", line)
        ):
            close()
        if line.strip() and not line.startswith("#"):
            if not lines:
                start = i
            lines.append(line)
    close()
    return out


@cache
def printed(name: str) -> str:
    """What `python -m bench report` prints for a committed results file; for a file written before the current
    header, also the tables of the benchmark that wrote it (its command's `bench/NAME.py`, else the file's name)."""
    res = results(name)
    out = report.report(res)
    if report.kind(res) == "generic":
        command = (res.get("command") or "") if isinstance(res, dict) else ""
        which = re.match(r"python bench/(\w+)\.py", command)
        spec = report.tables_of(which.group(1) if which else name.removesuffix(".json"))
        out += "\n" + "\n".join(spec[0](res)) if spec else ""
    return out


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


def sentences(text: str) -> list[str]:
    """A paragraph's sentences (a sentence ends at a full stop, a semicolon or a colon before a space)."""
    return re.split(r"(?<=[.;:])\s+(?=\S)", " ".join(text.split()))


def quoted(text: str) -> list[tuple[str, str, str]]:
    """The figures a paragraph quotes: (the number as written, its unit, the text before it); dates, versions,
    commits, names with digits in them, numbers a word marks as a target or a bound, and the figures of a sentence
    quoting an earlier run left out."""
    text = " ".join(s for s in sentences(text) if not EARLIER_RUN.search(s))
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
        if BOUND.search(before):
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


# Figures the docs quote that neither the report prints nor the file holds at their precision, found when this test
# was written: derived figures (a ratio or a difference of two printed ones), settings and sizes quoted beside a run,
# and figures of a run other than the file the paragraph follows. Each is to be printed by its benchmark's table
# function or reworded; the test fails when one is resolved (remove it here) or a new one appears.
UNRESOLVED = {
    ("bench/README.md", "0.006", "drift.json"),  # the difference of two arms' largest differences
    ("bench/README.md", "0.47", "drift.json"),  # an earlier int8 scheme's drift
    ("bench/README.md", "11.3GB", "shape4b.json"),  # the shape4b.json committed at 9f5700d
    ("bench/README.md", "0.63x", "shape4b.json"),  # int8's weights over bfloat16's
    ("bench/README.md", "32,768", "full.json"),  # a GPU's default settings
    ("bench/README.md", "131,072", "full.json"),
    ("bench/README.md", "4,100", "gpu.json"),  # the 4138-token log, rounded
    ("bench/README.md", "14.9GiB", "gpu.json"),  # a 16 GB card's memory and what it would leave
    ("bench/README.md", "3.1GiB", "gpu.json"),
    ("bench/README.md", "0.44GiB", "gpu.json"),
    ("bench/README.md", "488MB", "memory.json"),  # peaks over the bound and earlier runs' growth
    ("bench/README.md", "3.2GB", "memory.json"),
    ("bench/README.md", "814MB", "memory.json"),
    ("bench/README.md", "1.23x", "overhead.json"),  # the decision run's ratio, quoted after overhead.json
    ("bench/README.md", "75MB", "overhead.json"),  # lm_head chunk sizes and glibc's threshold
    ("bench/README.md", "32MB", "overhead.json"),
    ("bench/README.md", "8MB", "overhead.json"),
    ("bench/README.md", "1.30x", "serve.json"),
    ("bench/README.md", "1.48x", "serve-default.json"),  # a ratio of two printed token counts
    ("bench/README.md", "16,544", "serve-default.json"),
    ("bench/README.md", "1,024MB", "serve.json"),  # a setting and sizes of the workload
    ("bench/README.md", "0.83", "serve.json"),
    ("bench/README.md", "256", "serve.json"),
    ("bench/README.md", "192", "vllm-cpu.json"),
    ("bench/README.md", "256", "vllm-cpu.json"),
    ("bench/README.md", "0.32", "vllm-cpu.json"),  # a version of vLLM written without its name before it
    ("bench/README.md", "360", "jevbench.json"),  # jevbench's estimate of its suites, not the run
    ("bench/README.md", "1,248", "jevbench.json"),
    ("bench/README.md", "5.6", "krite.json"),  # 5.6e-17, read as 5.6
    ("docs/serving.md", "1.29x", "serve.json"),  # ratios of the req/s the report prints
    ("docs/serving.md", "1.30x", "serve.json"),
    ("docs/serving.md", "1.52x", "serve.json"),
    ("docs/serving.md", "1.22x", "serve.json"),
    ("docs/serving.md", "256", "serve.json"),  # route_sim's replicas and gaps, quoted after serve.json
    ("docs/serving.md", "17.7points", "serve.json"),
    ("docs/serving.md", "5.2points", "serve.json"),
    ("docs/serving.md", "1.48x", "serve-default.json"),
    ("docs/serving.md", "16,544", "serve-default.json"),
}


def all_misses() -> tuple[set[tuple[str, str, str]], int, int]:
    """What every doc quotes that its results file does not hold, as (doc, figure or row, file); and how many tables
    and figures were checked."""
    found, tables, figures = set(), 0, 0
    for doc in markdown_files():
        f, t, n = misses(doc, source(doc))
        found |= {(d, what, name) for d, _, what, name in f}
        tables, figures = tables + t, figures + n
    return found, tables, figures


def test_every_quoted_figure_is_in_the_results_file_it_names():
    found, tables, figures = all_misses()
    assert tables >= 30 and figures >= 350, (tables, figures)
    assert sorted(found - UNRESOLVED) == [], "quoted, but not in the results file named"
    assert sorted(UNRESOLVED - found) == [], "now found: remove from UNRESOLVED"


def test_an_altered_figure_or_row_is_reported():
    text = source("README.md")
    speed = text.split("\n## Speed\n", 1)[1].split("\n## ", 1)[0]
    assert misses("README.md", speed)[0] == []
    assert "4.78x" in speed and "2.54 against 2.52" in speed
    rows, _, _ = misses("README.md", speed.replace("4.78x", "4.87x", 1))
    assert [(what, name) for _, _, what, name in rows] == [
        ("| questions over a new document | 3.50 | 4.87x | 1.10x | 8.36x | 3.26x |", "decision.json")
    ]
    prose, _, _ = misses("README.md", speed.replace("2.54 against 2.52", "2.54 against 2.62"))
    assert [(what, name) for _, _, what, name in prose] == [("2.62", "vllm-cpu.json")]


def test_the_speed_figures_are_what_report_prints():
    """README's Speed section quotes decision.json's table and vllm-cpu.json's figures, each as the report prints it."""
    text = source("README.md")
    speed = text.split("\n## Speed\n", 1)[1].split("\n## ", 1)[0]
    checked = [b for b in blocks("README.md", speed) if b.source]
    assert {b.source for b in checked} == {"decision.json", "vllm-cpu.json"}
    found, tables, figures = misses("README.md", speed)
    assert found == [] and tables == 1 and figures >= 4, (found, tables, figures)
