"""Safety: no remote code, no pickled weights, no secrets in answers, logs or recordings."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import blink

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["blink.py", "app.py", "graft_keys.py"]


def project_sources() -> list[str]:
    """The product's own Python files that exist."""
    return [os.path.join(ROOT, f) for f in SOURCES if os.path.exists(os.path.join(ROOT, f))]


def test_no_remote_code_and_no_pickle_in_the_product():
    for path in project_sources():
        code = open(path, encoding="utf-8").read()
        assert not re.search(r"trust_remote_code\s*=\s*True", code), path
        assert not re.search(r"\bimport pickle\b|pickle\.loads?\(|torch\.load\(", code), path


def test_a_pickled_checkpoint_is_refused(tiny_qwen_dir, tmp_path):
    folder = tmp_path / "pickled"
    shutil.copytree(tiny_qwen_dir, folder)
    weights = folder / "model.safetensors"
    from safetensors.torch import load_file

    torch.save(load_file(weights), folder / "pytorch_model.bin")
    weights.unlink()
    with pytest.raises(OSError, match="no file named model.safetensors"):
        blink.TorchEngine(str(folder), settings=blink.Settings())


def test_hf_token_never_reaches_answers_logs_or_recordings(tmp_path):
    secret = "hf_SECRETtokenValue1234567890"
    examples = tmp_path / "examples"
    examples.mkdir()
    (examples / "a.json").write_text(json.dumps({"state": "hello", "questions": {"q": {"type": "noul"}}}))
    script = (
        f"import sys, json; sys.path.insert(0, {ROOT!r}); import blink; from adapters import record\n"
        f"blink.EXAMPLES_DIR = {str(examples)!r}\n"
        "print(json.dumps(blink.decide('hello', {'q': {'type': 'noul'}})))\n"
        f"record.record(blink.STANDIN_MODEL, {str(tmp_path / 'r.json')!r})\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_TOKEN": secret, "HUGGING_FACE_HUB_TOKEN": secret},
    )
    assert done.returncode == 0, done.stderr
    assert secret not in done.stdout and secret not in done.stderr
    assert secret not in (tmp_path / "r.json").read_text()


def test_hf_token_never_reaches_the_served_app(crowded_app):
    """The app launched with HF_TOKEN set: no page, endpoint, answer, error or log line carries it."""
    import httpx
    from conftest import SECRET
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    url, log_path = crowded_app
    client = Client(url, verbose=False)
    seen = [
        json.dumps(client.predict(api_name="/info")),
        json.dumps(client.predict("Is this urgent?", {"q": {"type": "noul"}}, api_name="/decide")),
        json.dumps(client.predict([{"state": "x", "questions": {}}], api_name="/decide_batch")),
    ]
    with pytest.raises(AppError) as refused:
        client.predict("", {}, api_name="/decide")
    seen.append(refused.value.message)
    seen += [
        httpx.get(url + path, timeout=30).text for path in ("", "config", "gradio_api/info", "gradio_api/openapi.json")
    ]
    assert all(SECRET not in text for text in seen)
    with open(log_path, encoding="utf-8") as log:
        assert SECRET not in log.read()
