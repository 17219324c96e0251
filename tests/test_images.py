"""Image inputs without a model: data-URI parsing, canonical headers, limits, locations, bombs, aspect, EXIF."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from image_samples import data_uri, declared_png, encode, exif_rotated_jpeg, gradient, png_uri
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

import blink

URI = png_uri(gradient(96, 64))
PAYLOAD = URI.split(",", 1)[1]
Q = {"q": {"type": "choice", "instructions": "Which fits?", "criteria": ["a", "b"]}}
SMALL = blink.ImageLimits(min_pixels=4096, factor=32)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def refusal(state, images=(), limits=SMALL) -> tuple[str, list]:
    """The message and location of the ImageError a request's images raise."""
    with pytest.raises(blink.ImageError) as err:
        blink.extract_images(state, images, limits)
    return str(err.value), err.value.loc


# ----------------------------------------------------------------------------------------------------------- headers


def test_inline_uri_is_lifted_and_shown_as_image_n():
    req = blink.extract_images(f"look: {URI} done", limits=SMALL)
    assert req.state == "look: [image 1] done"
    assert req.marked_state == f"look: {req.markers[0]} done"
    assert req.markers[0].startswith("BLINK_IMAGE_") and req.markers[0].endswith("_1_END")
    assert len(req.images) == 1 and req.images[0].size == (96, 64)
    assert req.images[0].tobytes() == gradient(96, 64).tobytes()
    assert req.loc == ["body", "state"]


def test_markers_are_unique_per_request():
    a = blink.extract_images(URI, limits=SMALL).markers[0]
    b = blink.extract_images(URI, limits=SMALL).markers[0]
    assert a != b


def test_header_case_is_free_but_parameters_and_whitespace_are_refused():
    upper = "DATA:IMAGE/PNG;BASE64," + PAYLOAD
    assert blink.extract_images(upper, limits=SMALL).state == "[image 1]"
    for header in (
        "data:image/png;charset=utf-8;base64,",
        "data:image/png ;base64,",
        "data:image/png; base64,",
        "data:image/png;name=a.png;base64,",
    ):
        assert refusal({"x": header + PAYLOAD}) == (
            "image data URI parameters or whitespace are not supported",
            ["body", "state", "x"],
        )


def test_other_image_types_are_refused():
    for mime in ("gif", "svg+xml", "bmp", "jpg"):
        assert refusal([f"data:image/{mime};base64," + PAYLOAD]) == (
            "image must be a data:image/png, image/jpeg, or image/webp URI with base64 data",
            ["body", "state", 0],
        )


def test_text_mentioning_data_uris_is_plain_text():
    for s in ("data:image/png is a format", "see data:image/png,abc", "data:image/" + "x" * 300 + ";base64,AAAA"):
        assert blink.locate_images(s) is None
        assert blink.extract_images(s) is None
    assert blink.extract_images({"a": 1, "b": [None, True, 2.5]}) is None
    assert blink.extract_images("text", []) is None


def test_images_not_given_is_none_or_empty():
    # the _NO_IMAGES sentinel is gone: (), [] and None all mean "no listed images"; the state's own still count
    for none in ((), [], None):
        assert blink.locate_images("text", none) is None and blink.extract_images("text", none) is None
        req = blink.extract_images(f"see {URI}", none, SMALL)
        assert req.state == "see [image 1]" and len(req.images) == 1 and req.loc == ["body", "state"]
    assert blink.extract_images(f"see {URI}", limits=SMALL).state == "see [image 1]"


def test_mime_type_must_match_the_decoded_format():
    jpeg = encode(gradient(64, 64), "JPEG")
    assert refusal(data_uri(jpeg, "image/png")) == ("image 1 does not match its image/png MIME type", ["body", "state"])
    webp = encode(gradient(64, 64), "WEBP")
    assert refusal(data_uri(webp, "image/jpeg"))[0] == "image 1 does not match its image/jpeg MIME type"
    assert blink.extract_images(data_uri(webp, "image/webp"), limits=SMALL).images[0].size == (64, 64)


def test_unicode_lowercase_expansion_keeps_offsets():
    # "İ".lower() is two characters: a naive lowercase copy would shift every offset after it.
    state = f"İİİ photo {URI} tail"
    req = blink.extract_images(state, limits=SMALL)
    assert req.state == "İİİ photo [image 1] tail"
    assert req.images[0].tobytes() == gradient(96, 64).tobytes()


# --------------------------------------------------------------------------------------------------------- locations


def test_locations_point_into_the_request_body():
    state = {"a": ["x", {"b": "data:image/png;charset=x;base64," + PAYLOAD}]}
    assert refusal(state)[1] == ["body", "state", "a", 1, "b"]
    bad = {"a": [URI, {"b": "data:image/png;base64,AAA"}]}
    assert refusal(bad) == ("image 2 has invalid base64 data", ["body", "state", "a", 1, "b"])
    assert refusal("text", [URI, "data:image/png;base64,!"]) == (
        "image must be a data:image/png, image/jpeg, or image/webp URI with base64 data",
        ["body", "images", 1],
    )


def test_images_list_errors_name_their_entry():
    assert refusal("x", "not a list") == ("images must be a list of data URIs", ["body", "images"])
    assert refusal("x", [URI, 7]) == ("image 2 must be a data URI", ["body", "images", 1])
    assert refusal("x", ["hello"]) == (
        "image must be a data:image/png, image/jpeg, or image/webp URI with base64 data",
        ["body", "images", 0],
    )
    assert refusal("x", ["see " + URI]) == (
        "image must be a data:image/png, image/jpeg, or image/webp URI with base64 data",
        ["body", "images", 0],
    )
    assert refusal("x", [URI + " trailing"])[1] == ["body", "images", 0]
    assert refusal("x", ["data:image/png;x=1;base64," + PAYLOAD]) == (
        "image data URI parameters or whitespace are not supported",
        ["body", "images", 0],
    )


def test_images_list_markers_follow_the_state():
    as_text = blink.extract_images("evidence", [URI, URI], SMALL)
    assert as_text.state == "evidence\n[image 1]\n[image 2]"
    assert blink.extract_images("", [URI], SMALL).state == "[image 1]"
    assert blink.extract_images(["a"], [URI], SMALL).state == ["a", "[image 1]"]
    nested = blink.extract_images({"p": URI}, [URI], SMALL)
    assert nested.state == {"state": {"p": "[image 1]"}, "images": ["[image 2]"]}
    assert nested.loc == ["body", "state", "p"]
    assert blink.extract_images(None, [URI], SMALL).loc == ["body", "images", 0]


def test_several_images_in_one_string_keep_their_order():
    other = png_uri(gradient(64, 64, shift=9))
    req = blink.extract_images(f"{URI} and {other}", limits=SMALL)
    assert req.state == "[image 1] and [image 2]"
    assert [im.size for im in req.images] == [(96, 64), (64, 64)]


# ------------------------------------------------------------------------------------------------------------ limits


def test_image_count_is_checked_before_anything_is_decoded(monkeypatch):
    def never(*_a, **_k):
        raise AssertionError("decoded before counting")

    monkeypatch.setattr(blink, "_decode_base64", never)
    junk = "data:image/png;base64,AAAA"  # valid base64, not an image: decoding it would fail first
    assert refusal({"a": junk, "b": [junk]}, [junk]) == ("at most 2 images per request", ["body", "images", 0])
    assert refusal([junk, junk, junk]) == ("at most 2 images per request", ["body", "state", 2])


def env_limits(env: dict) -> blink.ImageLimits:
    """The image limits a deployment reads from these environment variables."""
    return blink.Settings.from_env(env, gpu=False).image_limits


def test_limits_come_from_the_environment_and_are_range_checked():
    with pytest.raises(blink.ImageError, match="at most 1 images per request"):
        blink.extract_images([URI, URI], limits=env_limits({"BLINK_MAX_IMAGES": "1"}))
    bounds = {
        "BLINK_MAX_IMAGES": (1, 8),
        "BLINK_MAX_IMAGE_BYTES": (1024, 33554432),
        "BLINK_MAX_IMAGE_PIXELS": (65536, 16777216),
        "BLINK_MAX_IMAGE_SOURCE_PIXELS": (65536, 64000000),
    }
    fields = {
        "BLINK_MAX_IMAGES": "max_images",
        "BLINK_MAX_IMAGE_BYTES": "max_bytes",
        "BLINK_MAX_IMAGE_PIXELS": "max_pixels",
        "BLINK_MAX_IMAGE_SOURCE_PIXELS": "max_source_pixels",
    }
    for name, (lo, hi) in bounds.items():
        for ok in (lo, hi):
            assert getattr(env_limits({name: str(ok)}), fields[name]) == ok
        for bad in (str(lo - 1), str(hi + 1), "many"):
            with pytest.raises(
                blink.BlinkError,
                match=f"^{name} must be a whole number from {lo} to {hi} "
                rf"\(got '{bad}'\)$",
            ):
                env_limits({name: bad})
    assert env_limits({}) == blink.ImageLimits() == blink.Settings().image_limits


def test_the_environment_is_not_read_by_the_image_functions(monkeypatch):
    # Limits are read once, into Settings; locate_images and extract_images take theirs as an argument only.
    monkeypatch.setenv("BLINK_MAX_IMAGES", "nonsense")
    assert blink.locate_images({"text": "no images here"}) is None
    assert blink.locate_images([URI, URI]).limits == blink.ImageLimits()
    monkeypatch.setenv("BLINK_MAX_IMAGES", "1")
    assert len(blink.extract_images([URI, URI], limits=SMALL).images) == 2


def test_decoded_bytes_limit():
    limits = blink.ImageLimits(max_bytes=1024, min_pixels=4096, factor=32)
    big = png_uri(gradient(128, 128))
    assert refusal(big, limits=limits) == ("image 1 exceeds 1024 decoded bytes", ["body", "state"])
    # 1368 base64 characters pass the length pre-check but decode to 1026 bytes
    assert refusal("data:image/png;base64," + "A" * 1368, limits=limits)[0] == (
        "image 1 must contain 1-1024 decoded bytes"
    )


def test_source_pixels_limit():
    limits = env_limits({"BLINK_MAX_IMAGE_SOURCE_PIXELS": "65536"})
    with pytest.raises(blink.ImageError, match="^image 1 exceeds 65536 source pixels$"):
        blink.extract_images(png_uri(gradient(300, 300)), limits=limits)
    assert blink.extract_images(png_uri(gradient(256, 256)), limits=limits).images[0].size == (256, 256)


def test_decompression_bombs_are_refused_from_the_header():
    for width, height in ((9000, 9000), (100_000, 100_000)):  # under and over PIL's own bomb threshold
        raw = declared_png(width, height)
        assert len(raw) < 200
        assert refusal({"scan": data_uri(raw)}) == ("image 1 exceeds 20000000 source pixels", ["body", "state", "scan"])


def test_undecodable_image_is_refused():
    raw = encode(gradient(64, 64), "PNG")
    message, loc = refusal(data_uri(raw[:60]))
    assert message.startswith("image 1 cannot be decoded") and loc == ["body", "state"]
    assert refusal(data_uri(b"not an image at all"))[0].startswith("image 1 cannot be decoded")


# ------------------------------------------------------------------------------------------------- aspect and resize


def test_aspect_ratio_at_most_200_to_1():
    assert refusal({"strip": png_uri(gradient(402, 2))}) == (
        "image 1: image aspect ratio must be at most 200:1",
        ["body", "state", "strip"],
    )
    assert blink.extract_images(png_uri(gradient(400, 2)), limits=SMALL).images[0].size[0] % 32 == 0


def test_resize_is_the_processors_policy():
    limits = blink.ImageLimits()
    for height, width in ((700, 1000), (64, 96), (3000, 4000), (20, 20), (1088, 1920), (33, 4000)):
        assert blink._image_size(height, width, limits) == smart_resize(
            height, width, factor=32, min_pixels=limits.min_pixels, max_pixels=limits.max_pixels
        )
    narrow = blink.ImageLimits(max_pixels=65536, min_pixels=65536, factor=32)
    with pytest.raises(blink.BlinkError, match="cannot fit between 65536 and 65536 pixels"):
        blink._image_size(32, 6400, narrow)


def test_decoded_images_are_resized_factor_aligned():
    limits = blink.ImageLimits(max_pixels=65536, min_pixels=4096)
    req = blink.extract_images(png_uri(gradient(400, 280)), limits=limits)
    w, h = req.images[0].size
    assert w % 32 == 0 and h % 32 == 0 and 65536 >= w * h >= 32768 and req.images[0].mode == "RGB"


def test_exif_orientation_is_applied():
    raw = exif_rotated_jpeg(96, 64, orientation=6)  # stored landscape, shown rotated 90 degrees clockwise
    assert Image.open(io.BytesIO(raw)).size == (96, 64)
    img = blink.extract_images(data_uri(raw, "image/jpeg"), limits=SMALL).images[0]
    assert img.size == (64, 96)
    left, right = img.getpixel((8, 48)), img.getpixel((56, 48))
    assert right[0] > 200 and right[2] < 60  # the red top half now stands on the right
    assert left[2] > 200 and left[0] < 60


def test_rgba_and_palette_images_become_rgb():
    rgba = Image.new("RGBA", (64, 64), (10, 200, 30, 128))
    pal = gradient(64, 64).convert("P")
    for img in (rgba, pal):
        assert blink.extract_images(png_uri(img), limits=SMALL).images[0].mode == "RGB"


# ------------------------------------------------------------------------------------------ engines that read text only


def test_text_only_engines_refuse_images_at_their_location(served):
    dep = served(blink.MockEngine("mock-model"))
    with pytest.raises(blink.ImageError) as err:
        dep.decide({"doc": "x", "photo": URI}, Q)
    assert str(err.value) == "this model reads text only" and err.value.loc == ["body", "state", "photo"]
    with pytest.raises(blink.ImageError) as err:
        dep.decide("x", Q, images=[URI])
    assert err.value.loc == ["body", "images", 0]
    with pytest.raises(blink.ImageError, match="at most 2 images"):  # the count comes before the text-only refusal
        dep.decide([URI, URI, URI], Q)
    assert dep.decide("plain text", Q)["answers"]["q"]["choice"] in ("a", "b")


def test_batching_keeps_image_refusals_per_request(served):
    dep = served(blink.MockEngine("mock-model"))
    out = dep.decide_many([("text", Q), ({"p": URI}, Q), ("more text", Q, [URI]), ("text", Q, [])])
    assert out[0]["answers"]["q"]["choice"] in ("a", "b") and out[3]["answers"] == out[0]["answers"]
    assert isinstance(out[1], blink.ImageError) and out[1].loc == ["body", "state", "p"]
    assert isinstance(out[2], blink.ImageError) and out[2].loc == ["body", "images", 0]
    batcher = dep.batcher("mock-model")
    with pytest.raises(blink.ImageError, match="this model reads text only"):
        dep.submit(dep.request("x", Q, images=[URI]), "mock-model")
    assert batcher.q.qsize() == 0
    items = dep.submit_many([dep.request("x", Q, images=[URI]), dep.request("text", Q)])
    assert isinstance(items[0], blink.ImageError) and items[0].loc == ["body", "images", 0]
    assert items[1]["answers"] == dep.submit(dep.request("text", Q))["answers"] == out[0]["answers"]


def test_image_data_uri_reads_the_files_own_format(tmp_path):
    path = tmp_path / "photo.png"
    path.write_bytes(encode(gradient(64, 64), "WEBP"))  # a WebP file with a misleading name
    uri = blink.image_data_uri(str(path))
    assert uri.startswith("data:image/webp;base64,")
    assert blink.extract_images(uri, limits=SMALL).images[0].size == (64, 64)
    gif = tmp_path / "a.gif"
    gradient(8, 8).save(gif, "GIF")
    with pytest.raises(blink.BlinkError, match="images must be PNG, JPEG or WebP"):
        blink.image_data_uri(str(gif))


def test_command_line_images(tmp_path):
    # The command line serves the deployment its environment describes: here the mock engine, which reads text only.
    path = tmp_path / "photo.png"
    path.write_bytes(encode(gradient(64, 64), "PNG"))
    env = {**os.environ, "BLINK_ENGINE": "mock", "BLINK_MODEL": "mock-model"}

    def main(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, os.path.join(ROOT, "blink.py"), "--state", "a photo", "--questions", json.dumps(Q), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    refused = main("--image", str(path))
    assert refused.returncode == 2 and refused.stderr.strip() == "error: this model reads text only"
    answered = main()
    assert answered.returncode == 0, answered.stderr
    out = json.loads(answered.stdout)
    assert out["meta"]["engine"] == "mock" and out["meta"]["model"] == "mock-model"
    assert out["answers"]["q"]["choice"] in ("a", "b")
