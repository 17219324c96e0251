"""Calibration: the fit's formulas by hand, where a request's temperature comes from (request, calibration,
default), and `python blink.py calibrate` fitted on the real stand-in."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import pytest
from test_features import DEFAULTS, INTENT, ROOT, STATE, TAGS, UPSET, parse

import blink
from adapters import calibrate


def test_nll_ece_and_the_fitted_temperature_by_hand():
    obs = [([math.log(3.0), 0.0], 0), ([0.0, math.log(3.0)], 0)]  # p(correct) = 3/4, then 1/4
    assert calibrate.nll(obs, 1.0) == pytest.approx(-(math.log(0.75) + math.log(0.25)) / 2)
    assert calibrate.ece(obs, 1.0) == pytest.approx(0.25)  # both in the 0.7-0.8 bin: confidence 0.75, accuracy 0.5
    # three of four right with the same logit gap 2: the likelihood peaks where sigmoid(2 / T) = 3/4
    gap = [([2.0, 0.0], 0)] * 3 + [([2.0, 0.0], 1)]
    fitted = calibrate.fit_temperature(gap, 1.0)
    assert fitted == pytest.approx(2 / math.log(3.0), rel=1e-6)
    assert calibrate.nll(gap, fitted) < calibrate.nll(gap, 1.0)
    assert calibrate.ece(gap, fitted) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(
    "q, group",
    [
        (INTENT, "choice:3-4"),
        (UPSET, "noul:2"),
        (TAGS, "noul:2"),
        ({"type": "score", "criteria": list("abcde")}, "score:5-8"),
        ({"type": "choice", "criteria": [str(i) for i in range(17)]}, "choice:17-255"),
        ({"type": "choice", "criteria": ["only"]}, "choice:1"),
    ],
)
def test_calibration_groups(q, group):
    assert parse(q).group == group


def write_calibration(path, model_id: str, temperatures: dict) -> None:
    """A calibration file in the layout `blink.py calibrate` writes."""
    path.write_text(
        json.dumps({"format": blink.CALIBRATION_FORMAT, "models": {model_id: {"temperatures": temperatures}}})
    )


def test_temperature_comes_from_request_calibration_or_default(tmp_path, served):
    path = tmp_path / "calibration.json"
    dep = served(blink.MockEngine("org/mock", replace(DEFAULTS, calibration_path=str(path))))
    qs = {"intent": INTENT, "upset": UPSET}
    meta = dep.decide(STATE, qs)["meta"]
    assert meta["temperature"] == 1.0 and meta["temperature_source"] == "default"
    write_calibration(path, "org/other", {"choice:3-4": 2.0})  # another model's fit is never applied
    assert dep.decide(STATE, qs)["meta"]["temperature_source"] == "default"
    write_calibration(path, "org/mock", {"choice:3-4": 2.0})
    out = dep.decide(STATE, qs)
    assert out["meta"]["temperature"] == {"intent": 2.0, "upset": 1.0}
    assert out["meta"]["temperature_source"] == {"intent": f"calibration:{path}", "upset": "default"}
    raw = dep.engine().forward(dep.request(STATE, qs)).readouts
    assert out["answers"]["intent"]["probabilities"]["refund"] == pytest.approx(
        blink.softmax(raw["intent"].logits[0], 2.0)[0]
    )
    write_calibration(path, "org/mock", {"choice:3-4": 2.0, "noul:2": 2.0})
    assert dep.decide(STATE, qs)["meta"]["temperature"] == 2.0
    asked = dep.decide(STATE, qs, temperature=0.5)["meta"]
    assert asked["temperature"] == 0.5 and asked["temperature_source"] == "request"
    many = dep.decide_many([(STATE, qs)])[0]["meta"]
    assert many["temperature"] == 2.0 and many["temperature_source"] == f"calibration:{path}"
    path.write_text(json.dumps({"models": {"org/mock": {"temperatures": {"noul:2": -1}}}}))
    with pytest.raises(blink.BlinkError, match=f"calibration {path}: model 'org/mock' needs temperatures"):
        dep.decide(STATE, qs)


def test_calibrate_fits_the_stand_in_and_decide_applies_it(standin, served, tmp_path):
    out = tmp_path / "calibration.json"
    dep = served(standin, replace(standin.settings, calibration_path=str(out)))
    data = os.path.join(ROOT, "tests", "data", "calibration.jsonl")
    # what `python blink.py calibrate DATA` prints, for this deployment (the command line uses the process's own)
    printed = calibrate.format_calibration(calibrate.calibrate(data, served=dep))
    assert "NLL before" in printed and "ECE after" in printed and str(out) in printed
    entry = json.loads(out.read_text())["models"][blink.STANDIN_MODEL]
    assert set(entry["temperatures"]) == {"choice:3-4", "noul:2"}
    for group, fit in entry["fit"].items():
        assert fit["prompts"] == 12 and fit["nll_after"] <= fit["nll_before"]
        assert f"{group:<12} {fit['prompts']:>7} {fit['temperature']:>11.4f}" in printed
    meta = dep.decide(STATE, {"intent": INTENT})["meta"]
    assert meta["temperature"] == entry["temperatures"]["choice:3-4"]
    assert meta["temperature_source"] == f"calibration:{out}"
    assert dep.decide(STATE, {"intent": INTENT}, temperature=1.0)["meta"]["temperature_source"] == "request"


def test_calibration_data_errors_name_the_line_and_field(tmp_path, served):
    dep = served(blink.MockEngine(blink.STANDIN_MODEL))
    bad = tmp_path / "data.jsonl"
    bad.write_text(json.dumps({"state": "s", "questions": {"q": UPSET}, "labels": {"q": "maybe"}}) + "\n")
    with pytest.raises(blink.BlinkError, match="line 1: labels.q is 'maybe', not one of") as caught:
        calibrate.read_labelled(str(bad), dep.settings)
    assert caught.value.loc == ["line 1", "labels", "q"]
    bad.write_text("\n" + json.dumps({"state": "s", "questions": {"t": TAGS}, "labels": {"t": "late"}}))
    with pytest.raises(blink.BlinkError, match="line 2: question 't' is multi"):
        calibrate.read_labelled(str(bad), dep.settings)
    good = os.path.join(ROOT, "tests", "data", "calibration.jsonl")
    with pytest.raises(blink.BlinkError, match="the mock engine's are fabricated"):
        calibrate.calibrate(good, served=dep)
