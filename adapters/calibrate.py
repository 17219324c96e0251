"""Calibration: fit one temperature per question group on labelled requests (`python blink.py calibrate DATA.jsonl`)
and write it where blink reads it (blink.calibration_for applies it to every request that sets no temperature).

Calibration data: one labelled request per line,
  {"state": ..., "questions": {...}, "labels": {question key: the correct option key}}
Noul labels are "yes" / "no"; score labels the level index as a string ("0".."9"). Questions without a label are
not run; multi questions cannot be labelled with one key and are refused. Every prompt of a labelled question is one
observation (each rotation of a permute question, with the label at its shown position).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace

import blink

MIN_CALIBRATION_PROMPTS = 8  # a group with fewer labelled prompts is not fitted (a temperature from 3 points is noise)
TEMPERATURE_RANGE = (0.05, 50.0)  # the fit searches inverse temperatures between these bounds
ECE_BINS = 10


def nll(obs: list[tuple[list[float], int]], temperature: float) -> float:
    """Mean negative log-likelihood of the correct labels, observations being (label logits, correct index)."""
    return sum(blink.logsumexp([v / temperature for v in z]) - z[y] / temperature for z, y in obs) / len(obs)


def ece(obs: list[tuple[list[float], int]], temperature: float, bins: int = ECE_BINS) -> float:
    """Expected calibration error: the top probability against being right, in equal-width bins weighted by size."""
    sums = [[0.0, 0.0] for _ in range(bins)]  # per bin: sum of confidences, number right
    for z, y in obs:
        p = blink.softmax(z, temperature)
        top = max(range(len(p)), key=lambda i: (p[i], -i))
        cell = sums[min(bins - 1, int(p[top] * bins))]
        cell[0] += p[top]
        cell[1] += float(top == y)
    return sum(abs(conf - right) for conf, right in sums) / len(obs)


def fit_temperature(obs: list[tuple[list[float], int]], start: float) -> float:
    """The temperature minimising NLL: NLL is convex in 1/T, so a golden-section search over 1/T finds it. Never
    worse than `start` on these observations (the temperature used before fitting)."""
    lo, hi = 1 / TEMPERATURE_RANGE[1], 1 / TEMPERATURE_RANGE[0]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(100):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if nll(obs, 1 / a) <= nll(obs, 1 / b):
            hi = b
        else:
            lo = a
    fitted = 2 / (lo + hi)
    return fitted if nll(obs, fitted) <= nll(obs, start) else start


def read_labelled(path: str, settings: blink.Settings) -> list[tuple[int, blink.Request, dict[str, str]]]:
    """(line number, the request of its labelled questions, labels) per line of a calibration data file, each
    checked."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise blink.BlinkError(f"calibration data {path} cannot be read: {exc}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise blink.BlinkError(f"{where}: not JSON: {exc}") from None
        if not isinstance(item, dict) or not isinstance(item.get("labels"), dict) or not item["labels"]:
            raise blink.BlinkError(
                f"{where}: needs state, questions and labels {{question: correct option key}}", [f"line {n}", "labels"]
            )
        questions, labels = item.get("questions"), item["labels"]
        try:
            request = blink.parse_request(item.get("state"), questions, settings=settings)
        except blink.BlinkError as exc:
            raise blink.BlinkError(f"{where}: {exc}", [f"line {n}", *exc.loc[1:]]) from None
        parsed = {q.key: q for q in request.questions}
        for qkey, key in labels.items():
            loc = [f"line {n}", "labels", qkey]
            if qkey not in parsed:
                raise blink.BlinkError(f"{where}: labels.{qkey} names no question", loc)
            if parsed[qkey].multi:
                raise blink.BlinkError(f"{where}: question {qkey!r} is multi; calibration labels name one option", loc)
            if str(key) not in parsed[qkey].keys:
                raise blink.BlinkError(f"{where}: labels.{qkey} is {key!r}, not one of the question's option keys", loc)
        labelled = replace(
            request,
            questions=tuple(q for q in request.questions if q.key in labels),
            spec={qkey: q for qkey, q in questions.items() if qkey in labels},
        )
        out.append((n, labelled, {qkey: str(key) for qkey, key in labels.items()}))
    if not out:
        raise blink.BlinkError(f"calibration data {path} has no labelled requests")
    return out


def labelled_observations(eng: blink.Engine, items: list, path: str) -> dict[str, list[tuple[list[float], int]]]:
    """Run every labelled request (packed, like decide_many) and group its prompts' (logits, correct index)."""
    jobs = []
    for n, request, _ in items:
        try:
            jobs.append(eng.prepare(request))
        except blink.BlinkError as exc:
            raise blink.BlinkError(f"{path} line {n}: {exc}") from None
    groups: dict[str, list] = {}
    for (n, request, labels), result in zip(items, blink.run_jobs(jobs)):
        if isinstance(result, Exception):
            raise blink.BlinkError(f"{path} line {n}: {result}") from None
        for q in request.questions:
            for row, z in zip(q.rows, result.readouts[q.key].logits):
                if len(z) > 1:  # one option is certain at any temperature: nothing to fit
                    groups.setdefault(q.group, []).append((z, [o.key for o in row.shown].index(labels[q.key])))
    return groups


def write_calibration(path: str, model_id: str, entry: dict) -> None:
    """Put one model's entry into the calibration file, keeping every other model's; written atomically."""
    data = blink.load_calibration(path) if os.path.exists(path) else {"format": blink.CALIBRATION_FORMAT, "models": {}}
    data["models"][model_id] = entry
    partial = f"{path}.tmp-{os.getpid()}"
    with open(partial, "w", encoding="utf-8") as fh:
        json.dump(data, fh, ensure_ascii=False, indent=1)
        fh.write("\n")
    os.replace(partial, path)


def calibrate(
    data_path: str, model: str | None = None, out: str | None = None, served: blink.Deployment | None = None
) -> dict:
    """Fit one temperature per question group on labelled requests by minimising NLL, and write it where the engine
    reads it (`out`, else BLINK_CALIBRATION / calibration.json). Returns the fit report."""
    served = served or blink.deployment()
    items = read_labelled(data_path, served.settings)  # a bad data file fails before any model loads
    eng = served.engine(model)
    if eng.fabricated:
        raise blink.BlinkError("calibration needs a model's own numbers; the mock engine's are fabricated")
    groups = labelled_observations(eng, items, data_path)
    start = served.settings.temperature
    fits, temps = {}, {}
    for group, obs in sorted(groups.items()):
        fitted = fit_temperature(obs, start) if len(obs) >= MIN_CALIBRATION_PROMPTS else None
        after = fitted if fitted is not None else start
        fits[group] = {
            "prompts": len(obs),
            "temperature": fitted,
            "nll_before": nll(obs, start),
            "nll_after": nll(obs, after),
            "ece_before": ece(obs, start),
            "ece_after": ece(obs, after),
        }
        if fitted is not None:
            temps[group] = fitted
    path = out or served.settings.calibration_path
    live = eng.live  # a hybrid engine's live half ran the requests
    entry = {
        "temperatures": temps,
        "fit": fits,
        "data": os.path.basename(data_path),
        "requests": len(items),
        "engine": live.name,
        "revision": live.revision,
        "hardware": blink.hardware(),
        "fitted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_calibration(path, eng.model_id, entry)
    return {"model": eng.model_id, "path": path, "start_temperature": start, **entry}


def format_calibration(report: dict) -> str:
    """The fit report as a table: prompts, temperature, NLL and ECE before and after, per group."""
    head = (
        f"calibrated {report['model']} on {report['requests']} requests from {report['data']}; "
        f"before = temperature {report['start_temperature']:g}; wrote {report['path']}"
    )
    columns = (
        f"{'group':<12} {'prompts':>7} {'temperature':>11} {'NLL before':>10} {'NLL after':>9} "
        f"{'ECE before':>10} {'ECE after':>9}"
    )
    lines = [head, columns]
    for group, fit in report["fit"].items():
        t = f"{fit['temperature']:.4f}" if fit["temperature"] is not None else "too few"
        lines.append(
            f"{group:<12} {fit['prompts']:>7} {t:>11} {fit['nll_before']:>10.4f} {fit['nll_after']:>9.4f} "
            f"{fit['ece_before']:>10.4f} {fit['ece_after']:>9.4f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python blink.py calibrate DATA.jsonl [--model ID] [--out FILE]`: the fit table; 2 when refused."""
    parser = argparse.ArgumentParser(prog="blink.py calibrate", description="fit temperatures on labelled requests")
    parser.add_argument("data", help="labelled requests, one JSON object a line")
    parser.add_argument("--model", default=None, help="one of the served models (BLINK_MODELS)")
    parser.add_argument("--out", default=None, help="where to write the temperatures (default: BLINK_CALIBRATION)")
    args = parser.parse_args(argv)
    try:
        print(format_calibration(calibrate(args.data, args.model, args.out)))
    except blink.BlinkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
