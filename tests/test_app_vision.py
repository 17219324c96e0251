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


def test_wire_images_reach_the_model(vision_app):
    """System One assets (typesafe-sdk's multipart form, and inline data_base64) and Decisions image parts are read
    by the vision model where they stand."""
    import base64

    import httpx
    from openai import OpenAI
    from typesafe_sdk import Choice, Image, RetryPolicy, TypeSafeClient

    url = vision_app.src.rstrip("/")
    colors = {"red": (230, 20, 20), "blue": (20, 20, 230)}
    pngs = {name: base64.b64decode(png_uri(solid(rgb)).split(",", 1)[1]) for name, rgb in colors.items()}
    question = {"color": Choice(instructions="Main color of the chart?", criteria={"red": None, "blue": None})}
    got = {}
    with TypeSafeClient(api_key="k", base_url=url, retry=RetryPolicy(max_retries=0), timeout=120) as ts:
        for name, raw in pngs.items():
            r = ts.system_one(state={"note": "the chart", "chart": Image(raw)}, questions=question)
            meta = r.raw_http_response.json()["x_meta"]
            assert meta["engine"] == "torch" and meta["image_pixels"] > 0 and meta["visual_tokens"] > 0
            got[name] = r.choices["color"].probabilities
        # an alias named only in the instructions: the image is listed after the state and named [image 1] there
        aliased = ts.system_one(state="a chart", assets={"pic": Image(pngs["red"])}, questions={
            "color": Choice(instructions="Main color of pic?", criteria={"red": None, "blue": None})})
        assert aliased.raw_http_response.json()["x_meta"]["image_pixels"] > 0
    assert got["red"] != got["blue"]
    inline = httpx.post(url + "/v1/systemone", timeout=120, json={
        "model": "jev-latest", "state": {"note": "the chart", "chart": "img1"},
        "questions": {"color": {"type": "choice", "instructions": "Main color of the chart?",
                                "criteria": {"red": None, "blue": None}}},
        "assets": {"img1": {"type": "image", "format": "png", "data_base64": base64.b64encode(pngs["red"]).decode()}}})
    assert inline.status_code == 200, inline.text
    assert inline.json()["answers"]["color"]["probabilities"] == pytest.approx(got["red"], abs=1e-5)
    d = OpenAI(base_url=url + "/v1", api_key="k", max_retries=0).decisions.create(
        model="jev-latest", input=[{"role": "user", "content": [{"type": "input_text", "text": "the chart"},
                                                                {"type": "input_image", "image_url": png_uri(
                                                                    solid(colors["red"]))}]}],
        questions=[{"type": "choice", "instructions": "Main color of the chart?",
                    "choices": [{"value": "red"}, {"value": "blue"}]}])
    assert d.answers[0].type == "choice" and d.to_dict()["x_meta"]["image_pixels"] > 0
