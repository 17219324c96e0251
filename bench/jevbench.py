"""jevbench, the field's coherence harness, run unmodified against blink's app at its defaults and in float32.

    python -m bench jevbench            # check, --suite examples and --suite jevbench-mini (1,248 requests), both arms
    python -m bench jevbench --quick    # check and --suite examples only (results in jevbench-quick.json)
    python -m bench jevbench --dimensions BAT --mini-arms defaults   # jevbench-mini's BAT tests only, at the defaults

jevbench 0.1.0 (pinned in tools/requirements-jevbench.txt, installed into .venv-jevbench by `bash tools/setup.sh
--harnesses`; without it this prints why and exits 0: skipped, nothing measured) ships its suites, frozen plans and
rewrite banks in its wheel and talks to a server over HTTP only. For each arm (bench/lib/fieldharness.py: `python
app.py` as a user starts it, then with BLINK_DTYPE=float32) its own commands run as they are documented: `jevbench check
--url URL --model jev-latest`, then `jevbench eval --suite SUITE --url URL --model jev-latest --concurrency 1
--cache-dir DIR --out REPORT` for each suite, each arm with a request cache of its own. The results file keeps every
command, its exit status, how long it took and the end of what it printed, and the report JSON jevbench wrote, whole,
beside the harness header. Its scores (REP, BAT, MEA, LOG, CHO, overall; jevbench's own 0-1 scale, its table prints them
x100) are the model's except BAT, which the engine decides: an answer stays the same when the request's other questions
change (the target: BAT 100 at the defaults).
"""

from __future__ import annotations

import json
import os
import sys

from bench.lib import fieldharness, report

SUITES = {"full": ["examples", "jevbench-mini"], "quick": ["examples"]}
PILLARS = ("REP", "BAT", "MEA", "LOG", "CHO")
# jevbench's public leaderboard (jevbench-mini, x100), read beside blink's rows
PUBLISHED = {
    "open-jev-9b (best)": {"overall": 83.9, "BAT": 100.0},
    "Laya": {"overall": 56.5, "BAT": 100.0},
    "uniform answerer": {"overall": 89.4, "accuracy": 0.398},
}
BAT_TARGET = 1.0  # jevbench's BAT at blink's defaults (its 0-1 scale)


def command() -> str:
    """The jevbench command line in its environment."""
    return os.path.join(fieldharness.environment("jevbench"), "bin", "jevbench")


def harness_env() -> dict:
    """jevbench's environment: this one without a key (blink's app runs without one)."""
    return {k: v for k, v in os.environ.items() if k != "JEVBENCH_API_KEY"}


def scores(report: dict) -> dict:
    """The report's pillar and overall scores (0-1), with accuracy where jevbench reports one."""
    got = report.get("scores") or {}
    out = {p: got.get("pillars", {}).get(p) for p in PILLARS}
    out["overall"] = got.get("overall")
    for key in ("accuracy",):
        if key in got:
            out[key] = got[key]
    return out


def arm_run(arm: str, suites: list[str], files: str, mini: list[str]) -> dict:
    """jevbench check and eval of each suite against the arm's app: {check, suites: {suite: {run, report}}};
    jevbench-mini with jevbench's own selection flags `mini`."""
    cache = os.path.join(files, f"cache-{arm}")
    out = {"dtype": fieldharness.arm_dtype(arm), "env": fieldharness.ARMS[arm], "suites": {}}
    with fieldharness.app(arm, files) as url:
        endpoint = url + "v1/systemone"
        out["check"] = fieldharness.run(
            [command(), "check", "--url", endpoint, "--model", fieldharness.MODEL], files, harness_env()
        )
        print(f"{arm}: jevbench check exit {out['check']['returncode']}", flush=True)
        for suite in suites:
            path = os.path.join(files, f"{arm}-{suite}.json")
            ran = fieldharness.run(
                [command(), "eval", "--suite", suite, "--url", endpoint, "--model", fieldharness.MODEL,
                 "--concurrency", "1", "--cache-dir", cache, "--out", path,
                 *(mini if suite == "jevbench-mini" else [])],
                files, harness_env(),
            )  # fmt: skip
            report = json.load(open(path, encoding="utf-8")) if os.path.exists(path) else None
            out["suites"][suite] = {"run": ran, "scores": scores(report or {}), "report": report}
            print(f"{arm} {suite}: exit {ran['returncode']} in {ran['seconds']} s, {scores(report or {})}", flush=True)
    return out


def targets(arms: dict) -> list[dict]:
    """BAT at the defaults on every suite run."""
    out = []
    for suite in arms["defaults"]["suites"]:
        value = arms["defaults"]["suites"][suite]["scores"]["BAT"]
        out.append(
            {
                "target": f"jevbench BAT = 100 at blink's defaults ({suite})",
                "value": value,
                "threshold": BAT_TARGET,
                "met": None if value is None else value >= BAT_TARGET,  # None: the suite did not complete
            }
        )
    return out


def summary_rows(arms: dict) -> list[str]:
    """One line per arm and suite: the pillars and overall x100."""
    lines = []
    for arm, got in arms.items():
        for suite, one in got["suites"].items():
            s = one["scores"]
            cells = " ".join(
                f"{k} {100 * s[k]:.1f}" if s.get(k) is not None else f"{k} -" for k in [*PILLARS, "overall"]
            )
            lines.append(f"{arm} ({got['dtype']}) {suite}: {cells}; exit {one['run']['returncode']}")
    return lines


def flags(ap) -> None:
    """jevbench's own flags."""
    ap.add_argument("--dimensions", default=None, help="jevbench-mini's dimensions only (jevbench's --dimensions)")
    ap.add_argument("--mini-arms", default=",".join(fieldharness.ARMS), help="the arms jevbench-mini runs on")


def main(argv: list[str] | None = None) -> int:
    """Run jevbench's check and suites against each arm's app, write the results file, print the scores."""
    run = fieldharness.begin("jevbench", argv, __doc__, flags)
    if run is None:
        return 0
    suites = SUITES["quick" if run.quick else "full"]
    files = run.files()
    print(f"server logs and jevbench's own files in {files}", flush=True)
    mini = ["--dimensions", run.args.dimensions] if run.args.dimensions else []
    mini_arms = run.args.mini_arms.split(",")
    arms = {
        arm: arm_run(arm, [s for s in suites if s != "jevbench-mini" or arm in mini_arms], files, mini)
        for arm in fieldharness.ARMS
    }
    result = {
        "jevbench": fieldharness.version("jevbench", "jevbench"),
        "model_field": fieldharness.MODEL,
        "suites": suites,
        "jevbench_mini_selection": {"arms": mini_arms, "flags": mini},
        "arms": arms,
        "published": PUBLISHED,
        "targets": targets(arms),
    }
    path = run.write(result)
    print("\n".join(summary_rows(arms)))
    met = fieldharness.targets_line(result["targets"], ", ")
    print(f"jevbench: {met}; wrote {path}")
    failed = [a for a, got in arms.items() if got["check"]["returncode"] != 0]
    return 1 if failed else 0


def jevbench_report(res: dict) -> list[str]:
    """Its pillar and overall scores (x100, as its table prints them) per arm and suite, the leaderboard's published
    rows beside them, the targets."""
    pillars = ["REP", "BAT", "MEA", "LOG", "CHO", "overall"]
    rows = []
    for arm, got in res["arms"].items():
        for suite, one in got["suites"].items():
            s, printed = one["scores"], one["report"] or {}
            requests = (printed.get("result") or {}).get("requests", "-")
            rows.append(
                [f"blink {arm} ({got['dtype']})", suite]
                + [f"{100 * s[p]:.1f}" if s.get(p) is not None else "-" for p in pillars]
                + [requests, one["run"]["returncode"], one["run"]["seconds"]]
            )
    for name, row in res["published"].items():
        cells = [f"{row[p]:.1f}" if p in row else "-" for p in pillars]
        rows.append([f"{name} (published)", "jevbench-mini", *cells, "-", "-", "-"])
    intro = (
        f"jevbench {res['jevbench']}, model field {res['model_field']!r}; the model is the stand-in (REP, MEA, LOG,"
        " CHO and overall are its own; BAT is the engine's)."
    )
    return report.field_report(intro, ["system", "suite", *pillars, "requests", "exit", "seconds"], rows, res)


REPORT = (jevbench_report, ("jevbench", "model_field", "arms", "published", "targets", "suites"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
