"""The Space's image path: refused clearly on the text-only stand-in, answered end to end by a vision model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import tiny_models
from gradio_client import Client
from gradio_client.exceptions import AppError
from image_samples import png_uri
from PIL import Image

import blink

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE_PRESET = os.path.join(ROOT, "examples", "support-chart-image.json")


def solid(rgb: tuple[int, int, int]) -> Image.Image:
    """A 96x64 image of one color."""
    return Image.new("RGB", (96, 64), rgb)


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_text_only_model_refuses_images_at_their_location(client):
    with pytest.raises(AppError, match=r"this model reads text only \(field: images\.0\)"):
        client.predict("a chart", '{"q": {"type": "noul"}}', 1.0, "", "live", [png_uri(solid((200, 0, 0)))],
                       api_name="/decide")
    example = blink.load_example(IMAGE_PRESET)
    with pytest.raises(AppError, match=r"this model reads text only \(field: state\.chart\)"):
        client.predict(example["state"], example["questions"], 1.0, "", "live", None, api_name="/decide")


@pytest.fixture(scope="module")
def vision_app(tmp_path_factory):
    """app.py served as a subprocess over a tiny native vision model (BLINK_VISION=1), on loopback."""
    folder = tiny_models.build_qwen35_vision(tmp_path_factory.mktemp("vision-app") / "Qwen3.5-4B")
    port = free_port()
    env = {**os.environ, "BLINK_MODEL": folder, "BLINK_VISION": "1", "GRADIO_SERVER_NAME": "127.0.0.1",
           "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False"}
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "app.py")], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 120
    while True:
        try:
            client = Client(url, verbose=False)
            break
        except Exception:  # noqa: BLE001 - not up yet
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the vision app did not start: {proc.stderr.read()[-2000:]}") from None
            time.sleep(0.5)
    yield client
    proc.terminate()
    proc.wait(timeout=20)


def test_image_preset_runs_end_to_end_on_a_vision_model(vision_app):
    example = blink.load_example(IMAGE_PRESET)
    out = vision_app.predict(example["state"], json.dumps(example["questions"]), 1.0, "", "saved", None,
                             api_name="/decide")
    assert out["meta"]["engine"] == "torch" and out["meta"]["image_pixels"] > 0 and out["meta"]["visual_tokens"] > 0
    assert set(out["answers"]) == set(example["questions"])


def test_uploaded_images_reach_the_model(vision_app):
    qs = '{"color": {"type": "choice", "instructions": "Main color of [image 1]?", "criteria": ["red", "blue"]}}'
    red = vision_app.predict("see the image", qs, 1.0, "", "live", [png_uri(solid((230, 20, 20)))],
                             api_name="/decide")
    blue = vision_app.predict("see the image", qs, 1.0, "", "live", [png_uri(solid((20, 20, 230)))],
                              api_name="/decide")
    assert red["meta"]["image_pixels"] > 0
    assert red["answers"]["color"]["probabilities"] != blue["answers"]["color"]["probabilities"]
