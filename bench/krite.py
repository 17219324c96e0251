"""krite-bench's measuring code, unmodified, against blink's app at its defaults and in float32, on suites written in
krite's case format from the project's labelled data.

    python -m bench krite               # quality/ECE, flip rate with and without permute, interference; both arms
    python -m bench krite --quick       # 4 cases per suite (results in krite-quick.json)
    python -m bench krite --invariance-cases N --interference-cases N

krite-bench 0.1.0 (pinned in tools/requirements-krite.txt, installed into .venv-krite by `bash tools/setup.sh
--harnesses`; without it this prints why and exits 0: skipped, nothing measured). Its `data` command downloads krite's
datasets from a hub; its runners read any suite as `$KRITE_ROOT/benchmarks/data/<suite id>.jsonl` and any engine from
`$KRITE_ROOT/benchmarks/baselines/engines.toml`. So this writes, into a KRITE_ROOT of its own (under
bench/results/files/krite):

- suites (suites()) from bench/data/clearcut.jsonl, named blink-clearcut-* (none of krite's dataset ids): its 48
  labelled choice questions as 4-option and as 8-option choices (the gold option, the question's own other options,
  then options of the other questions, seeded; the gold's position random, as krite's own builder places it), its
  26 yes/no questions and its 14 three-level graded questions; and each choice suite again with blink's `permute: K`
  in every question (all K cyclic rotations averaged; a blink request option, not in krite's Protocol v1);
- engines.toml: the arm's app as krite's own client meets a Jev-style server (request_model "jev-latest", dialect
  "jev": krite maps the reply with client.from_jev and validates it against its response schema).

Then krite's own commands, per arm: `krite-bench quality` (accuracy and raw ECE per suite, metrics.summarize), its
pooled temperature calibration (metrics.pooled_calibration: krite's `calibrate` command only knows krite's dataset
ids, so its function is called on these suites' prediction files the way run_calibration calls it), `krite-bench
invariance` (runners.run_invariance: every order of 4 options, 24 seeded orders of 8, a flip being a changed
`choice`), and runners.run_interference on the choice suites (its `interference` command is fixed to krite's agnews
suite): the question alone and beside krite's first 3 and 15 filler questions, the max probability change. krite's
own rows (invariance.jsonl, interference.jsonl, quality.jsonl and the calibration blocks) are kept whole in the
results file beside the harness header. The targets are the engine's (krite's own: interference 0 within 1e-5 in
float32 and 1e-3 in bfloat16; flip rate with permute at or under Kev's published 0.060 on 8 options); accuracy and ECE
are the model's.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from bench.lib import fieldharness, report

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "clearcut.jsonl")
DATASET = "blink-clearcut"
SEED = 13  # krite's own seed
CHOICE_K = (4, 8)
SCORE_LEVELS = 3  # the score suite's questions: those with 3 levels (14 of the 21)
INSTRUCTIONS = "Which option fits the text?"  # a labelled question without instructions gets this one
# krite's published rows (its site and package) and its targets
PUBLISHED = {
    "interference_15_fillers": {"Laya": 0.0017, "Kev": 0.034},
    "flip_rate_8_options": {"Laya": 0.197, "Kev": 0.060},
}
INTERFERENCE_TARGET = {"float32": 1e-5, "bfloat16": 1e-3, "float16": 1e-3}
FLIP_TARGET = 0.060  # Kev's published 8-option flip rate: blink with permute at or under it
CASES = {"full": {"invariance": 24, "interference": 48}, "quick": {"invariance": 4, "interference": 4}}

INTERFERENCE = r"""
import sys
from pathlib import Path
from krite_bench import runners
engine, out, n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
for suite in sys.argv[4:]:
    runners.run_interference(engine, suite, n, out)
"""
# runners.run_calibration's own steps for suite ids it does not list: read each prediction file against its suite,
# then metrics.pooled_calibration (one temperature per bucket, fit on one half, scored on the other)
CALIBRATION = r"""
import json, sys
from pathlib import Path
from krite_bench import data, metrics, runners
engine, out = sys.argv[1], Path(sys.argv[2])
group = {}
for sid in sys.argv[3:]:
    cases = data.load_suite(sid)
    rows = [json.loads(line) for line in (out / f"pred-{engine}-{sid}.jsonl").read_text().splitlines() if line]
    assert [r["case_id"] for r in rows] == [c["case_id"] for c in cases], sid
    preds = [
        {"probs": r["probs"], "gold": r["gold"], "names": runners.names_of(c["request"]["questions"]["q"]),
         "bucket": c["bucket"], "index": i}
        for i, (r, c) in enumerate(zip(rows, cases)) if r.get("error") is None
    ]
    if preds:
        group[sid] = (preds, len(cases))
print(json.dumps(metrics.pooled_calibration(group)))
"""


def bucket(qtype: str, k: int) -> str:
    """krite's calibration bucket (krite_bench.data.bucket)."""
    if qtype == "noul":
        return "noul"
    if qtype == "choice":
        return f"choice/{k}" if k <= 4 else ("choice/5-8" if k <= 8 else "choice/9+")
    return f"score/{k}" if k <= 5 else "score/6+"


def labelled() -> list[tuple[str, str, dict, str]]:
    """Every labelled question of clearcut.jsonl: (id, state, question, label)."""
    out = []
    with open(DATA, encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            for qid, q in row["questions"].items():
                out.append((qid, row["state"], q, row["labels"][qid]))
    return out


def case(suite: str, qid: str, state: str, question: dict, gold, k: int) -> dict:
    """One case in krite's format (krite_bench.data.build_suite's fields)."""
    return {
        "case_id": f"{suite}/{qid}",
        "suite": suite,
        "dataset": DATASET,
        "lang": "en",
        "type": question["type"],
        "bucket": bucket(question["type"], k),
        "request": {"state": state, "questions": {"q": question}},
        "gold": {"q": gold},
    }


def choice_suite(k: int) -> list[dict]:
    """The labelled choice questions as k-option choices: the gold, the question's own other options, then options of
    the other questions (seeded), in a seeded order."""
    rows = [r for r in labelled() if r[2]["type"] == "choice"]
    pool = list(dict.fromkeys(o for r in rows for o in r[2]["criteria"]))
    rng = np.random.default_rng([SEED, k])
    suite, cases = f"{DATASET}-choice{k}", []
    for qid, state, q, gold in rows:
        own = [o for o in q["criteria"] if o != gold]
        others = [o for o in pool if o not in q["criteria"]]
        distractors = [own[int(i)] for i in rng.permutation(len(own))]
        distractors += [others[int(i)] for i in rng.permutation(len(others))]
        names = [gold, *distractors[: k - 1]]
        names = [names[int(j)] for j in rng.permutation(k)]  # the gold's position is random
        question = {"type": "choice", "instructions": q.get("instructions") or INSTRUCTIONS}
        question["criteria"] = dict.fromkeys(names)
        cases.append(case(suite, qid, state, question, gold, k))
    return cases


def graded_suite(qtype: str) -> list[dict]:
    """The labelled yes/no (noul: gold True/False) or 3-level graded (score: gold level index) questions (krite scores
    a score suite's agreement over one level count)."""
    suite, cases = f"{DATASET}-{qtype}{SCORE_LEVELS if qtype == 'score' else ''}", []
    for qid, state, q, label in labelled():
        if q["type"] != qtype or (qtype == "score" and len(q["criteria"]) != SCORE_LEVELS):
            continue
        question = {"type": qtype, "instructions": q.get("instructions") or INSTRUCTIONS}
        if qtype == "score":
            question["criteria"] = list(q["criteria"])
        gold = label == "yes" if qtype == "noul" else int(label)
        cases.append(case(suite, qid, state, question, gold, len(q.get("criteria") or []) or 2))
    return cases


def with_permute(cases: list[dict]) -> list[dict]:
    """The same cases with blink's `permute: K` (every cyclic rotation of the K options, averaged) in the question."""
    out = []
    for c in cases:
        q = c["request"]["questions"]["q"]
        suite = f"{c['suite']}-permute"
        question = {**q, "permute": len(q["criteria"])}
        out.append({**c, "case_id": c["case_id"].replace(c["suite"], suite, 1), "suite": suite,
                    "request": {**c["request"], "questions": {"q": question}}})  # fmt: skip
    return out


def suites() -> dict[str, list[dict]]:
    """Every suite this benchmark writes: {suite id: cases}."""
    plain = {f"{DATASET}-choice{k}": choice_suite(k) for k in CHOICE_K}
    permuted = {f"{sid}-permute": with_permute(cases) for sid, cases in plain.items()}
    graded = {f"{DATASET}-noul": graded_suite("noul"), f"{DATASET}-score{SCORE_LEVELS}": graded_suite("score")}
    return {**plain, **permuted, **graded}


def write_root(root: str, written: dict[str, list[dict]]) -> None:
    """A KRITE_ROOT: benchmarks/data/<suite>.jsonl for every suite."""
    folder = os.path.join(root, "benchmarks", "data")
    os.makedirs(folder, exist_ok=True)
    os.makedirs(os.path.join(root, "benchmarks", "baselines"), exist_ok=True)
    for sid, cases in written.items():
        with open(os.path.join(folder, f"{sid}.jsonl"), "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(c, ensure_ascii=False) + "\n" for c in cases)


def write_engine(root: str, engine: str, url: str, dtype: str) -> None:
    """engines.toml naming the arm's app as krite's client meets a Jev-style server."""
    port = int(url.rstrip("/").rsplit(":", 1)[1])
    with open(os.path.join(root, "benchmarks", "baselines", "engines.toml"), "w", encoding="utf-8") as fh:
        fh.write(
            f'[{engine}]\nport = {port}\nrequest_model = "{fieldharness.MODEL}"\ndialect = "jev"\n'
            f'model = "blink"\nbackend = "blink python app.py"\nprecision = "{dtype}"\n'
        )


def rows(path: str, engine: str) -> list[dict]:
    """krite's rows for the engine in one of its result files."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [r for r in map(json.loads, filter(str.strip, fh)) if r.get("engine") == engine]


def arm_run(arm: str, root: str, files: str, cases: dict) -> dict:
    """krite's quality, calibration, invariance and interference runs against the arm's app: krite's rows, the
    commands that wrote them and their times."""
    engine, dtype = f"blink-{arm}", fieldharness.arm_dtype(arm)
    env = {**os.environ, "KRITE_ROOT": root}
    krite = os.path.join(fieldharness.environment("krite"), "bin", "krite-bench")
    python = os.path.join(fieldharness.environment("krite"), "bin", "python")
    out = os.path.join(root, "results", arm)
    plain = [f"{DATASET}-choice{k}" for k in CHOICE_K]
    quality = [*plain, f"{DATASET}-noul", f"{DATASET}-score{SCORE_LEVELS}"]
    orders = [*plain, *(f"{s}-permute" for s in plain)]
    inv_n, mix_n = str(cases["invariance"]), str(cases["interference"])
    commands = {
        "quality": [krite, "--out", out, "quality", "--engine", engine, "--suites", ",".join(quality)],
        "calibration": [python, "-c", CALIBRATION, engine, out, *quality],
        "invariance": [krite, "--out", out, "invariance", "--engine", engine, "--suites", ",".join(orders),
                       "--n", inv_n],
        "interference": [python, "-c", INTERFERENCE, engine, out, mix_n, *plain],
    }  # fmt: skip
    got = {"dtype": dtype, "env": fieldharness.ARMS[arm], "engine": engine, "runs": {}}
    with fieldharness.app(arm, files) as url:
        write_engine(root, engine, url, dtype)
        for name, cmd in commands.items():
            ran = fieldharness.run(cmd, root, env)
            got["runs"][name] = {k: v for k, v in ran.items() if k != "stdout" or name != "calibration"}
            print(f"{arm} krite {name}: exit {ran['returncode']} in {ran['seconds']} s", flush=True)
            if name == "calibration" and ran["returncode"] == 0:
                got["calibration"] = json.loads(ran["stdout"])
    for name in ("quality", "invariance", "interference"):
        got[name] = rows(os.path.join(out, f"{name}.jsonl"), engine)
    return got


def figures(got: dict) -> dict:
    """The arm's headline figures from krite's rows: flip rates, interference, accuracy and raw ECE per suite."""
    flips = {r["suite"]: r["full_permutation_flip_rate"] for r in got["invariance"]}
    mixes = {f"{r['suite']} +{r['fillers']}": r["max_prob_dev"] for r in got["interference"]}
    quality = {r["suite"]: {"accuracy": r.get("accuracy"), "ece": r.get("raw", {}).get("ece")} for r in got["quality"]}
    errors = {
        f"{name} {r['suite']}": r["error_rate"]
        for name in ("quality", "invariance", "interference")
        for r in got[name]
        if r.get("error_rate")
    }
    return {"flip_rate": flips, "interference_max_prob_dev": mixes, "quality": quality, "error_rates": errors}


def targets(arms: dict) -> list[dict]:
    """krite's interference targets per arm (its dtype's tolerance) and the 8-option flip rate with permute."""
    out = []
    for arm, got in arms.items():
        bound = INTERFERENCE_TARGET.get(got["dtype"])
        for r in got["interference"]:
            if r["fillers"] == 15 and bound is not None:
                value = r["max_prob_dev"]
                out.append(
                    {
                        "target": f"interference (15 fillers, max |dp|) <= {bound:g} at {arm} ({got['dtype']}), "
                        f"{r['suite']}",
                        "value": value,
                        "threshold": bound,
                        "met": value is not None and value <= bound and not r["error_rate"],
                    }
                )
        value = got["figures"]["flip_rate"].get(f"{DATASET}-choice8-permute")
        out.append(
            {
                "target": f"flip rate with permute on 8 options <= {FLIP_TARGET} at {arm} ({got['dtype']})",
                "value": value,
                "threshold": FLIP_TARGET,
                "met": value is not None and value <= FLIP_TARGET,
            }
        )
    return out


def flags(ap) -> None:
    """krite's own flags."""
    ap.add_argument("--invariance-cases", type=int, default=None, help="cases per invariance suite (24; quick 4)")
    ap.add_argument("--interference-cases", type=int, default=None, help="cases per interference suite (48; quick 4)")


def main(argv: list[str] | None = None) -> int:
    """Write the suites and a KRITE_ROOT, run krite's runners against each arm's app, write the results file."""
    run = fieldharness.begin("krite", argv, __doc__, flags)
    if run is None:
        return 0
    cases = dict(CASES["quick" if run.quick else "full"])
    cases["invariance"] = run.args.invariance_cases or cases["invariance"]
    cases["interference"] = run.args.interference_cases or cases["interference"]
    files = run.files()
    root = os.path.join(files, "krite-root")
    written = suites()
    if run.quick:  # every suite cut to its first cases
        written = {sid: c[: cases["invariance"]] for sid, c in written.items()}
    write_root(root, written)
    print(f"krite root, server logs and krite's own files in {files}", flush=True)
    arms = {}
    for arm in fieldharness.ARMS:
        arms[arm] = arm_run(arm, root, files, cases)
        arms[arm]["figures"] = figures(arms[arm])
    result = {
        "krite_bench": fieldharness.version("krite", "krite-bench"),
        "suites": {sid: {"cases": len(c), "bucket": c[0]["bucket"]} for sid, c in written.items()},
        "cases": cases,
        "arms": arms,
        "published": PUBLISHED,
        "targets": targets(arms),
    }
    path = run.write(result)
    for arm, got in arms.items():
        print(f"{arm} ({got['dtype']}): {json.dumps(got['figures'])}")
    met = fieldharness.targets_line(result["targets"])
    print(f"krite: {met}; wrote {path}")
    failed = [f"{a} {n}" for a, got in arms.items() for n, r in got["runs"].items() if r["returncode"] != 0]
    return 1 if failed else 0


def krite_report(res: dict) -> list[str]:
    """Per arm its flip rates, interference and quality (accuracy, raw ECE) rows, krite's published rows, the
    targets."""
    rows = []
    for arm, got in res["arms"].items():
        name, f = f"blink {arm} ({got['dtype']})", got["figures"]
        rows += [[name, "flip rate", sid, report.cell(v)] for sid, v in f["flip_rate"].items()]
        rows += [[name, "interference max dp", k, report.cell(v)] for k, v in f["interference_max_prob_dev"].items()]
        for sid, q in f["quality"].items():
            rows += [[name, "accuracy", sid, report.cell(q["accuracy"])], [name, "ECE", sid, report.cell(q["ece"])]]
        rows += [[name, "error rate", k, report.cell(v)] for k, v in f["error_rates"].items()]
    for measure, published in res["published"].items():
        rows += [[f"{who} (published)", measure, "krite's", v] for who, v in published.items()]
    suites = ", ".join(f"{k} ({v['cases']})" for k, v in res["suites"].items())
    intro = (
        f"krite-bench {res['krite_bench']}; suites {suites}; cases per run {res['cases']}. The model is the"
        " stand-in: accuracy and ECE are its own."
    )
    return report.field_report(intro, ["system", "measure", "suite", "value"], rows, res)


REPORT = (krite_report, ("krite_bench", "suites", "cases", "arms", "published", "targets"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
