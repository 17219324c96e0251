"""The Space's image path: refused clearly on the text-only stand-in, answered end to end by a vision model."""

from __future__ import annotations

import json
import os

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


def test_text_only_model_refuses_images_at_their_location(client):
    with pytest.raises(AppError, match=r"this model reads text only \(field: images\.0\)"):
        client.predict(
            "a chart", '{"q": {"type": "noul"}}', 1.0, "", "live", [png_uri(solid((200, 0, 0)))], api_name="/decide"
        )
    example = blink.load_example(IMAGE_PRESET)
    with pytest.raises(AppError, match=r"this model reads text only \(field: state\.chart\)"):
        client.predict(example["state"], example["questions"], 1.0, "", "live", None, api_name="/decide")


@pytest.fixture(scope="module")
def vision_folder(tmp_path_factory) -> str:
    """A tiny native vision model (named as Qwen3.5-4B, so BLINK_VISION applies to it) saved to a folder."""
    return tiny_models.build_qwen35_vision(tmp_path_factory.mktemp("vision-app") / "Qwen3.5-4B")


@pytest.fixture(scope="module")
def vision_app(vision_folder, tmp_path_factory):
    """app.py served as a subprocess over the tiny vision model (BLINK_VISION=1), on loopback: a gradio_client."""
    from conftest import app_process

    env = {"BLINK_MODEL": vision_folder, "BLINK_VISION": "1"}
    with app_process(env, tmp_dir=str(tmp_path_factory.mktemp("vision-log"))) as (url, _):
        yield Client(url, verbose=False)


@pytest.fixture(scope="module")
def vision_local(vision_folder) -> blink.Deployment:
    """The same model and settings as the vision app, in this process: the answers the app must give."""
    env = {"BLINK_MODEL": vision_folder, "BLINK_VISION": "1", "BLINK_DTYPE": os.environ["BLINK_DTYPE"]}
    return blink.Deployment(blink.Settings.from_env(env))  # the dtype the app subprocess inherits (conftest)


def test_image_preset_runs_end_to_end_on_a_vision_model(vision_app, vision_local):
    example = blink.load_example(IMAGE_PRESET)
    out = vision_app.predict(
        example["state"], json.dumps(example["questions"]), 1.0, "", "saved", None, api_name="/decide"
    )
    want = vision_local.decide(example["state"], example["questions"])
    assert out["meta"]["engine"] == want["meta"]["engine"] == "torch"
    # the image reached the model resized as the rules say, and the answers are the model's for this request
    assert (out["meta"]["image_pixels"], out["meta"]["visual_tokens"]) == (
        want["meta"]["image_pixels"],
        want["meta"]["visual_tokens"],
    )
    assert out["meta"]["visual_tokens"] * 32 * 32 == out["meta"]["image_pixels"]  # one token per 32 x 32 pixels
    assert out["meta"]["input_tokens"] == want["meta"]["input_tokens"]
    assert list(out["answers"]) == list(example["questions"])
    for key, answer in out["answers"].items():
        assert answer["probabilities"] == pytest.approx(want["answers"][key]["probabilities"], abs=1e-5), key


def test_uploaded_images_reach_the_model(vision_app, vision_local):
    qs = '{"color": {"type": "choice", "instructions": "Main color of [image 1]?", "criteria": ["red", "blue"]}}'
    red = vision_app.predict("see the image", qs, 1.0, "", "live", [png_uri(solid((230, 20, 20)))], api_name="/decide")
    blue = vision_app.predict("see the image", qs, 1.0, "", "live", [png_uri(solid((20, 20, 230)))], api_name="/decide")
    want = vision_local.decide("see the image", json.loads(qs), images=[png_uri(solid((230, 20, 20)))])
    assert red["meta"]["image_pixels"] == want["meta"]["image_pixels"]
    assert red["answers"]["color"]["probabilities"] == pytest.approx(
        want["answers"]["color"]["probabilities"], abs=1e-5
    )
    assert red["answers"]["color"]["probabilities"] != blue["answers"]["color"]["probabilities"]


def test_wire_images_reach_the_model(vision_app, vision_local):
    """System One assets (typesafe-sdk's multipart form, and inline data_base64) and Decisions image parts are read
    by the vision model where they stand: the answers are the model's for the same request in blink's terms."""
    import base64

    import httpx
    from openai import OpenAI
    from typesafe_sdk import Choice, Image, RetryPolicy, TypeSafeClient

    url = vision_app.src.rstrip("/")
    colors = {"red": (230, 20, 20), "blue": (20, 20, 230)}
    pngs = {name: base64.b64decode(png_uri(solid(rgb)).split(",", 1)[1]) for name, rgb in colors.items()}
    question = {"color": Choice(instructions="Main color of the chart?", criteria={"red": None, "blue": None})}
    asked = {
        "color": {"type": "choice", "instructions": "Main color of the chart?", "criteria": {"red": None, "blue": None}}
    }
    got = {}
    with TypeSafeClient(api_key="k", base_url=url, retry=RetryPolicy(max_retries=0), timeout=120) as ts:
        for name, raw in pngs.items():
            r = ts.system_one(state={"note": "the chart", "chart": Image(raw)}, questions=question)
            meta = r.raw_http_response.json()["x_meta"]
            want = vision_local.decide({"note": "the chart", "chart": png_uri(solid(colors[name]))}, asked)
            assert meta["engine"] == "torch" and (meta["image_pixels"], meta["visual_tokens"]) == (
                want["meta"]["image_pixels"],
                want["meta"]["visual_tokens"],
            )
            got[name] = r.choices["color"].probabilities
            assert got[name] == pytest.approx(want["answers"]["color"]["probabilities"], abs=1e-5)
        # an alias named only in the instructions: the image is listed after the state and named [image 1] there
        aliased = ts.system_one(
            state="a chart",
            assets={"pic": Image(pngs["red"])},
            questions={"color": Choice(instructions="Main color of pic?", criteria={"red": None, "blue": None})},
        )
        want = vision_local.decide(
            "a chart",
            {"color": {**asked["color"], "instructions": "Main color of [image 1]?"}},
            images=[png_uri(solid(colors["red"]))],
        )
        assert aliased.choices["color"].probabilities == pytest.approx(
            want["answers"]["color"]["probabilities"], abs=1e-5
        )
    assert got["red"] != got["blue"]
    inline = httpx.post(
        url + "/v1/systemone",
        timeout=120,
        json={
            "model": "jev-latest",
            "state": {"note": "the chart", "chart": "img1"},
            "questions": {
                "color": {
                    "type": "choice",
                    "instructions": "Main color of the chart?",
                    "criteria": {"red": None, "blue": None},
                }
            },
            "assets": {
                "img1": {"type": "image", "format": "png", "data_base64": base64.b64encode(pngs["red"]).decode()}
            },
        },
    )
    assert inline.status_code == 200, inline.text
    assert inline.json()["answers"]["color"]["probabilities"] == pytest.approx(got["red"], abs=1e-5)
    d = OpenAI(base_url=url + "/v1", api_key="k", max_retries=0).decisions.create(
        model="jev-latest",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "the chart"},
                    {"type": "input_image", "image_url": png_uri(solid(colors["red"]))},
                ],
            }
        ],
        questions=[
            {
                "type": "choice",
                "instructions": "Main color of the chart?",
                "choices": [{"value": "red"}, {"value": "blue"}],
            }
        ],
    )
    assert d.answers[0].type == "choice" and d.to_dict()["x_meta"]["image_pixels"] == want["meta"]["image_pixels"]
