"""What `python -m bench report FILE...` prints of any results file: its header (the command, the hardware, when and
for how long, whether the machine held steady), the tables of the benchmark that wrote it (that benchmark's REPORT:
its table function and the fields those show), then every field those left out. A file without the current header (a
`python -m bench NAME` command), or of a benchmark with no tables, prints as generic tables of its fields, so every
file prints, whole. Nothing here imports torch: the benchmarks import it where they run, not where they print.

    python -m bench report                                  # every committed file in bench/results
    python -m bench report bench/results/decision.json      # one file
    git show 543d9f8:bench/results/full.json | python -m bench report -    # a committed earlier run, from stdin
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import sys

from bench.lib import harness

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Benchmarks folded into another: the committed files they wrote print as the benchmark that now measures the same.
FOLDED = {"quantfloor": "drift"}


def pct(x: float | None) -> str:
    """A share as a whole percentage ('-' when unknown)."""
    return "-" if x is None else f"{100 * x:.0f}%"


def mb(n: int) -> str:
    """Bytes in MB."""
    return f"{n / 1e6:,.0f} MB"


def table(head: list[str], rows: list[list]) -> list[str]:
    """A markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def cell(value) -> str:
    """One value of a generic table: numbers to 4 significant digits, lists and objects as JSON, whole (a "|" escaped,
    so that it stays in its cell)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False).replace("|", "\\|")
    return "—" if value is None else str(value).replace("|", "\\|")


def _scalar(value) -> bool:
    """A value a table cell holds as it is (not a nested list or object)."""
    return not isinstance(value, (list, dict))


def _table(rows: list[tuple[str, dict]], first: str) -> list[str]:
    """A markdown table of named rows, one column per field any row has (nested fields as compact JSON)."""
    columns = list(dict.fromkeys(k for _, row in rows for k in row))
    return table([first, *columns], [[cell(name), *(cell(row.get(k)) for k in columns)] for name, row in rows])


def generic_report(res) -> list[str]:
    """Any results fields: the plain ones as a list, then one table per list or map of objects (a file of a kind this
    script has no tables for, e.g. a new benchmark's, still prints, whole)."""
    if not isinstance(res, dict):
        res = {"results": res}
    fields, tables = [], []
    for key, value in res.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables += ["", f"{key}:", "", *_table([(str(i), v) for i, v in enumerate(value)], "#")]
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            tables += ["", f"{key}:", "", *_table(list(value.items()), "name")]
        elif isinstance(value, dict) and value and all(_scalar(v) for v in value.values()):
            fields.append(f"- {key}: " + ", ".join(f"{k} {cell(v)}" for k, v in value.items()))
        else:
            fields.append(f"- {key}: {cell(value)}")
    return [*fields, *tables]


def field_report(intro: str, head: list[str], rows: list[list], res: dict) -> list[str]:
    """A field harness's report (jevbench, krite): what ran, its table, then its targets with the measured values."""
    verdict = {True: "met", False: "**missed**"}
    targets = [
        f"- {t['target']}: {cell(t['value'])} — {'not measured' if t['value'] is None else verdict[bool(t['met'])]}"
        for t in res["targets"]
    ]
    return [intro, "", *table(head, rows), "", *targets]


def steadiness_line(res: dict) -> str:
    """Whether the machine held steady over a run, from the matmul probes of its start and end."""
    s = harness.steadiness(*res["matmul_gflops_start_end"])
    start, end = s["matmul_gflops_start_end"]
    probes = (
        f"matmul probe {start:.0f} GFLOP/s at the start of the run and {end:.0f} at its end "
        f"({s['matmul_change']:.0%} apart)"
    )
    if s["unsteady"]:
        return (
            f"**Unsteady machine:** {probes}, more than the {s['unsteady_threshold']:.0%} a steady run stays "
            "within: the machine's speed changed during the run, so read its ratios with care."
        )
    return f"Steady machine: {probes}, within {s['unsteady_threshold']:.0%}."


HEADER = (
    "command",
    "quick",
    "hardware",
    "python",
    "torch",
    "transformers",
    "threads",
    "measured_at",
    "duration_s",
    "load_average",
    "matmul_gflops",
    "matmul_gflops_start_end",
    "matmul_gflops_by_dtype",
    "matmul_change",
    "unsteady_threshold",
    "unsteady",
)


def header_line(res: dict) -> str:
    """How a run ran, from its header: when, by what command, for how long, on what, with what."""
    threads = f" with {res['threads']} thread(s)" if isinstance(res["threads"], int) else ""
    return (
        f"Measured {res['measured_at']} by `{res['command']}` in {res['duration_s'] / 60:.1f} min: {res['hardware']}, "
        f"torch {res['torch']}{threads}, transformers {res['transformers']}."
    )


def kind(res) -> str:
    """Which benchmark wrote a results file, from the command its header records (`python -m bench NAME ...`);
    'generic' for a file without that header."""
    command = (res.get("command") or "") if isinstance(res, dict) else ""
    if not command.startswith("python -m bench "):
        return "generic"
    name = command.split()[3]
    return FOLDED.get(name, name)


def tables_of(which: str) -> tuple | None:
    """The benchmark's REPORT (its table function and the fields those show), or None where it has none."""
    if not os.path.exists(os.path.join(BENCH, f"{which}.py")):
        return None
    return getattr(importlib.import_module(f"bench.{which}"), "REPORT", None)


def report(res) -> str:
    """The markdown block of one results file, whole."""
    spec = tables_of(kind(res)) if isinstance(res, dict) else None
    if spec is None:
        return "\n".join(generic_report(res))
    tables, shown = spec
    steady = ["", steadiness_line(res)] if "matmul_gflops_start_end" in res else []
    rest = {k: v for k, v in res.items() if k not in HEADER and k not in shown}
    tail = ["", "Other fields:", "", *generic_report(rest)] if rest else []
    return "\n".join([header_line(res), *steady, "", *tables(res), *tail])


def main(paths: list[str]) -> int:
    """Print every file named (`-` reads stdin; none: every committed results file), each under its name when
    there are several."""
    paths = paths or sorted(
        p for p in glob.glob(os.path.join(harness.RESULTS, "*.json")) if not p.endswith("-quick.json")
    )
    for i, path in enumerate(paths):
        if path == "-":
            res = json.load(sys.stdin)
        else:
            with open(path, encoding="utf-8") as fh:
                res = json.load(fh)
        if len(paths) > 1:
            print(f"{'' if i == 0 else chr(10)}## {path}\n")
        print(report(res))
    return 0
