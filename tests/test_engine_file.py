"""The engine file holds the engine: adapters import blink and never the reverse, importing the page builds no model,
one coercion rule for every entry, and an engine the deployment replaced is released."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref

import pytest
from conftest import ROOT

import blink

ADAPTER_DEPENDENCIES = ("adapters", "gradio", "fastapi", "starlette", "ray", "pyarrow", "mcp")


def python(code: str, **env) -> str:
    """Run code in a fresh interpreter at the repository root; its stdout."""
    import os

    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_blink_imports_no_adapter_nor_what_adapters_need():
    loaded = json.loads(
        python(
            "import json, sys, blink\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {ADAPTER_DEPENDENCIES!r})))"
        )
    )
    assert loaded == []


def test_blink_py_holds_no_protocol_http_ray_parquet_or_export_code():
    source = open(f"{ROOT}/blink.py", encoding="utf-8").read()
    for word in ("systemone", "fastapi", "gradio", "import ray", "pyarrow", "DecisionConfig", "zstd"):
        assert word not in source, word


def test_adapter_commands_run_from_blink_py(tmp_path):
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"state": "Refund please", "questions": '{"q": {"type": "noul"}}'}) + "\n")
    done = subprocess.run(
        [sys.executable, "blink.py", "batch", str(rows), "--out", str(tmp_path / "out.jsonl"), "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "BLINK_MOCK": "1"},
    )
    assert done.returncode == 0, done.stderr
    (record,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert record["meta"]["engine"] == "mock" and record["answers"]["q"]["type"] == "noul"


def test_importing_app_builds_no_model_and_launching_does():
    out = python("import sys, blink, app\nprint('transformers' in sys.modules, len(blink._LIVE))")
    assert out.split() == ["False", "0"]


@pytest.mark.parametrize(
    "state, questions",
    [
        ('{"order": 7, "items": ["kettle"]}', '{"q": {"type": "noul", "instructions": "Refund?"}}'),
        ("[1, 2]", {"q": {"type": "noul"}}),
        ("plain words {not json", '{"q": {"type": "choice", "criteria": {"a": "first", "b": "second"}}}'),
    ],
)
def test_json_text_means_the_same_on_every_entry(state, questions, mock_served):
    """decide(), the wire's Request and a batch row all go through parse_request: the same key and rendering."""
    from adapters import wire

    direct = mock_served.request(state, questions)
    as_json = json.loads(questions) if isinstance(questions, str) else questions
    call = wire.systemone_call({"model": "jev-latest", "state": state, "questions": as_json}, {}, mock_served)
    assert call.request.key == direct.key and call.request.state == direct.state
    assert direct.state == blink.coerce_state(state) and isinstance(direct.spec, dict)


@pytest.mark.parametrize(
    "state, questions, field",
    [("  ", {"q": {"type": "noul"}}, "state"), ("x", " ", "questions"), ("x", "{broken", "questions")],
)
def test_blank_or_broken_json_text_is_refused_by_name(state, questions, field, mock_served):
    with pytest.raises(blink.BlinkError) as caught:
        mock_served.request(state, questions)
    assert caught.value.loc == ["body", field]


def test_a_replaced_engine_is_released(tiny_qwen_dir):
    dep = blink.Deployment.serving(blink.TorchEngine(tiny_qwen_dir, settings=blink.Settings()))
    first = dep.engine()
    gone, key = weakref.ref(first), first.key
    assert blink._LIVE[key] is first
    dep.decide("x", {"q": {"type": "noul"}})
    dep.install(blink.MockEngine(first.model_id))
    del first
    gc.collect()
    assert gone() is None and key not in blink._LIVE


def test_busy_carries_a_location_as_blink_errors_do():
    assert blink.BlinkBusy("busy").loc == [] and blink.BlinkBusy("busy", ["body"]).loc == ["body"]


def test_the_engine_interface_names_what_adapters_read(mock_served, standin):
    mock = mock_served.engine()
    assert mock.live is mock and mock.source is None and mock.revision is None
    hybrid = blink.HybridEngine(None, standin)
    assert hybrid.live is standin and hybrid.source == standin.source
