"""python -m bench NAME [options]: run one benchmark (its results file in bench/results/); --list names every one;
python -m bench report [FILE...] prints results files (every committed one when none is named)."""

from __future__ import annotations

import ast
import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# Every benchmark, in the order --list shows them; each is bench/NAME.py with a main(argv) and a REPORT (its tables).
BENCHMARKS = (
    "run",
    "drift",
    "budget",
    "overhead",
    "engine_ab",
    "models",
    "batch",
    "serve",
    "route_sim",
    "memory",
    "vllm_check",
    "jevbench",
    "krite",
    "gpu",
    "shape4b",
)


def summary(name: str) -> str:
    """The first sentence of a benchmark's docstring, read without importing it."""
    with open(os.path.join(HERE, f"{name}.py"), encoding="utf-8") as fh:
        first = ast.get_docstring(ast.parse(fh.read())).split("\n\n")[0]
    return " ".join(first.split()).split(". ")[0].rstrip(".:")


def main(argv: list[str]) -> int:
    """Run the benchmark named first with the rest of the arguments; `report` prints results files; --list (or
    nothing) names every benchmark."""
    if not argv or argv[0] in ("--list", "-h", "--help"):
        if not argv or argv[0] != "--list":
            print(__doc__.strip() + "\n")
        for name in BENCHMARKS:
            print(f"{name:<11} {summary(name)}")
        print(f"{'report':<11} every results file printed whole, as the tables of the benchmark that wrote it")
        return 0
    name, rest = argv[0], argv[1:]
    if name == "report":
        from bench.lib import report

        return report.main(rest)
    if name not in BENCHMARKS:
        print(f"no benchmark named {name!r}; python -m bench --list names them", file=sys.stderr)
        return 2
    return importlib.import_module(f"bench.{name}").main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
