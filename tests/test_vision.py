"""Vision models end to end on tiny random-weight Qwen3.5 models: native, grafted, refusals, graft checks."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import tiny_models as tm
import torch
from image_samples import gradient, png_uri
from transformers import AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

import blink
import graft_keys
from adapters import record

QS = {
    "kind": {
        "type": "choice",
        "instructions": "What does the picture show?",
        "criteria": {"cat": "a cat", "dog": "a dog", "car": "a car"},
    },
    "sharp": {"type": "score", "instructions": "How sharp is it?", "criteria": ["blurry", "fair", "sharp"]},
}
IMAGE = gradient(96, 64)
URI = png_uri(IMAGE)
PLACEHOLDER = "@@IMAGE@@"
SETTINGS = blink.Settings()  # every setting at its default, on a machine without a GPU


def engine(folder: str, settings: blink.Settings = SETTINGS, **options) -> blink.TorchEngine:
    """A torch engine for a tiny model folder (options: vision, vision_tower, image_layout)."""
    return blink.TorchEngine(folder, settings=settings, **options)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """A tiny text checkpoint in a folder named blink-4b and its base vision model in one named Qwen3.5-4B."""
    root = tmp_path_factory.mktemp("vision")
    text = tm.build_qwen35_text(root / "blink-4b")
    base = tm.build_qwen35_vision(root / "Qwen3.5-4B", seed=1, text_folder=text)
    return {"root": root, "text": text, "base": base}


@pytest.fixture(scope="module")
def text_engine(folders) -> blink.TorchEngine:
    """The text checkpoint served text-only."""
    return engine(folders["text"])


@pytest.fixture(scope="module")
def native(folders) -> blink.TorchEngine:
    """The vision model served natively (BLINK_VISION)."""
    return engine(folders["base"], vision=True)


@pytest.fixture(scope="module")
def native_inline(folders) -> blink.TorchEngine:
    """The same vision model with each image where its marker stands (BLINK_IMAGE_LAYOUT=inline)."""
    return engine(folders["base"], vision=True, image_layout="inline")


@pytest.fixture(scope="module")
def native_timed(folders) -> blink.TorchEngine:
    """The same vision model reporting its image timings (BLINK_IMAGE_TIMING=1)."""
    return engine(folders["base"], blink.Settings(image_timing=True), vision=True)


@pytest.fixture(scope="module")
def grafted(folders) -> blink.TorchEngine:
    """The text checkpoint grafted onto its base's vision tower (BLINK_VISION_TOWER)."""
    return engine(folders["text"], vision_tower=f"{folders['base']}@main")


def reference_logits(eng: blink.TorchEngine, content_for, images: list, qkey: str, q: dict) -> torch.Tensor:
    """Last-position logits over the whole vocabulary from tiny_models.run_image_prompt, for one question alone."""
    tok, proc = eng.vision_tok, eng.image_processor
    (row,) = blink.parse_question(qkey, q).rows
    user = blink.user_message(content_for.state, row, blink.LABEL_POOL[: len(row.shown)])
    messages = [{"role": "system", "content": blink.SYSTEM}, {"role": "user", "content": content_for(user)}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    return tm.run_image_prompt(eng.model, tok, proc, prompt, images)


def reference_label_logits(eng: blink.TorchEngine, content_for, images: list, questions: dict = QS) -> dict:
    """Label logits from tiny_models.run_image_prompt: the plain transformers path, one prompt per question."""
    out = {}
    for qkey, q in questions.items():
        n = len(blink.parse_question(qkey, q).options)
        out[qkey] = reference_logits(eng, content_for, images, qkey, q)[eng.label_ids[:n]].tolist()
    return out


class First:
    """Reference content for layout "first": the images, then the text with [image N] where each stood."""

    def __init__(self, state, n_images: int):
        self.state, self.n = state, n_images

    def __call__(self, user: str) -> list:
        return [{"type": "image"}] * self.n + [{"type": "text", "text": user}]


class Inline:
    """Reference content for layout "inline": the text split at the placeholder, the image in between."""

    def __init__(self, state):
        self.state = state

    def __call__(self, user: str) -> list:
        before, after = user.split(PLACEHOLDER)
        return [{"type": "text", "text": before}, {"type": "image"}, {"type": "text", "text": after}]


def image_forward(eng, state, questions: dict = QS, images=()) -> blink.Forward:
    """The engine's own forward of one image request."""
    return eng.forward(blink.parse_request(state, questions, images=list(images), settings=eng.settings))


def image_logits(eng, state, images=()) -> tuple[dict, int, dict]:
    """The engine's own label logits for an image request (each question has one prompt here), its prompt tokens and
    its image meta."""
    res = image_forward(eng, state, images=images)
    return {qkey: r.logits[0] for qkey, r in res.readouts.items()}, res.input_tokens, res.extra


def assert_close(got: dict, want: dict, tol: float = 1e-4) -> None:
    """Every question's label logits agree within tol."""
    assert got.keys() == want.keys()
    for qkey, row in want.items():
        assert len(got[qkey]) == len(row)
        assert max(abs(a - b) for a, b in zip(got[qkey], row)) < tol, qkey


# -------------------------------------------------------------------------------------------------------------- graft


def test_grafted_text_logits_equal_the_text_models(folders, text_engine, grafted):
    ids = text_engine.tok(blink.wrap(text_engine.tok, "Which label fits? A or B."), return_tensors="pt")["input_ids"]
    text_model = AutoModelForCausalLM.from_pretrained(folders["text"]).eval()
    assert blink.cpu_matmul(text_model, grafted.matmul)[0] == grafted.matmul  # the same kernels on both sides
    assert blink.use_gated_delta(text_model, grafted.settings.gated_delta) == grafted.gated_delta_layers > 0
    grafted.model.model.rope_deltas = None
    with torch.no_grad():
        want = text_model(input_ids=ids).logits
        got = grafted.model(input_ids=ids).logits
    assert float((want - got).abs().max()) == 0.0
    state = {"ticket": "The screen flickers after the update.", "tags": ["display"]}
    request = blink.parse_request(state, QS, settings=SETTINGS)
    got, want = grafted.forward(request), text_engine.forward(request)
    assert (got.readouts, got.input_tokens) == (want.readouts, want.input_tokens)


def test_graft_keeps_the_base_vision_tower(native, grafted):
    base, graft = native.model.state_dict(), grafted.model.state_dict()
    visual = [k for k in base if k.startswith("model.visual.")]
    assert visual and all(torch.equal(base[k], graft[k]) for k in visual)
    language = [k for k in base if k.startswith("model.language_model.layers.")]
    assert any(not torch.equal(base[k], graft[k]) for k in language)  # seed 1 base vs seed 0 text: really replaced


def test_graft_keys_map_every_text_weight_and_refuse_unknown_names(folders, native):
    text_keys = AutoModelForCausalLM.from_pretrained(folders["text"]).state_dict().keys()
    target = native.model.state_dict()
    mapped = [graft_keys.text_to_parent(k) for k in text_keys]
    assert all(k in target for k in mapped) and len(set(mapped)) == len(mapped)
    assert graft_keys.text_to_parent("model.layers.3.self_attn.q_proj.bias") == (
        "model.language_model.layers.3.self_attn.q_proj.bias"
    )
    for name in (
        "mtp.fc.weight",
        "model.visual.blocks.0.attn.qkv.weight",
        "lm_head.bias",
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        "model.layers.01.mlp.up_proj.weight",
        "model.embed_tokens.weight.extra",
        "model.language_model.norm.weight",
        "norm.weight",
    ):
        with pytest.raises(ValueError, match="graft_keys does not know the text weight"):
            graft_keys.text_to_parent(name)


@pytest.fixture()
def fresh_pair(folders):
    """A newly loaded vision model and text model, for grafts that are meant to fail."""
    vision = AutoModelForImageTextToText.from_pretrained(folders["base"]).eval()
    return vision, AutoModelForCausalLM.from_pretrained(folders["text"]).eval()


def test_graft_refuses_unknown_misshaped_and_missing_weights(fresh_pair):
    vision, text = fresh_pair
    assert graft_keys.graft_text_weights(vision, text) == len(text.state_dict())
    text.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(ValueError, match="graft_keys does not know the text weight 'extra'"):
        graft_keys.graft_text_weights(vision, text)
    del text.extra
    text.model.norm.weight = torch.nn.Parameter(torch.ones(tm.HIDDEN_SIZE + 1))
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(65,\)"):
        graft_keys.graft_text_weights(vision, text)
    text.model.norm.weight = torch.nn.Parameter(torch.ones(tm.HIDDEN_SIZE))
    text.lm_head = torch.nn.Identity()
    with pytest.raises(ValueError, match="incomplete text graft: 1 missing language weights"):
        graft_keys.graft_text_weights(vision, text)


def _text_variant(root, **overrides) -> str:
    """A tiny text checkpoint named blink-4b whose config differs from the base's in the given fields."""
    tok = tm.build_tokenizer()
    config = tm.text_config(tok)
    for field, value in overrides.items():
        setattr(config, field, value)
    folder = root / "blink-4b"
    torch.manual_seed(0)
    tm.Qwen3_5ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def _base_variant(folders, root, edit_config=None, template_suffix: str = "") -> str:
    """A copy of the base vision model (named Qwen3.5-4B) with its config or chat template edited."""
    folder = root / "Qwen3.5-4B"
    shutil.copytree(folders["base"], folder)
    if edit_config:
        cfg = json.loads((folder / "config.json").read_text())
        edit_config(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    if template_suffix:
        template = folder / "chat_template.jinja"
        template.write_text(template.read_text() + template_suffix)
    return str(folder)


def test_graft_refuses_config_mismatches(folders, tmp_path):
    text = _text_variant(tmp_path / "a", intermediate_size=96)
    with pytest.raises(blink.BlinkError, match="^incompatible vision tower: text intermediate_size differs"):
        engine(text, vision_tower=f"{folders['base']}@main")
    text = _text_variant(tmp_path / "b", layer_types=["full_attention"] * 4)
    with pytest.raises(blink.BlinkError, match="text layer_types differs"):
        engine(text, vision_tower=f"{folders['base']}@main")

    def narrow_vision(cfg):
        cfg["vision_config"]["out_hidden_size"] = 32

    base = _base_variant(folders, tmp_path / "c", narrow_vision)
    with pytest.raises(blink.BlinkError, match="visual output does not match text hidden size"):
        engine(folders["text"], vision_tower=f"{base}@main")


def test_graft_refuses_special_token_and_label_mismatches(folders, tmp_path):
    def wrong_pad(cfg):
        cfg["image_token_id"] = cfg["video_token_id"]

    base = _base_variant(folders, tmp_path / "a", wrong_pad)
    with pytest.raises(blink.BlinkError, match="^incompatible vision tower: image_token_id differs from the text"):
        engine(folders["text"], vision_tower=f"{base}@main")
    with pytest.raises(blink.BlinkError, match="image_token_id differs"):  # a native model is checked the same way
        engine(base, vision=True)
    # A template that ends in "X" glues the label into "XA", "XB"...: the labels no longer verify after it.
    base = _base_variant(folders, tmp_path / "b", template_suffix="X")
    with pytest.raises(blink.BlinkError, match="^vision processor does not preserve the option-label token"):
        engine(folders["text"], vision_tower=f"{base}@main")


def test_vision_sources_are_restricted(folders, tmp_path):
    assert blink.vision_source("blink-4b", "Qwen/Qwen3.5-4B@abc123") == ("Qwen/Qwen3.5-4B", "abc123")
    assert blink.vision_source("blink-4b", f"{folders['base']}@main") == (folders["base"], "main")
    cases = {
        ("other-model", "Qwen/Qwen3.5-4B@main"): "only supported for blink-4b and blink-27b",
        ("blink-4b", "Qwen/Qwen3.5-4B"): "must be a repo@revision",
        ("blink-4b", "Qwen/Qwen3.5-4B@"): "must be a repo@revision",
        ("blink-4b", "Qwen/Qwen3.5-9B@main"): "for blink-4b must use Qwen/Qwen3.5-4B@revision",
        ("blink-27b", "Qwen/Qwen3.5-4B@main"): "for blink-27b must use Qwen/Qwen3.8-27B@revision",
        ("blink-4b", f"{tmp_path}@main"): "must use Qwen/Qwen3.5-4B@revision",
    }
    for (name, spec), message in cases.items():
        with pytest.raises(blink.BlinkError, match=message):
            blink.vision_source(name, spec)
    with pytest.raises(blink.BlinkError, match="only supported for blink-4b"):
        engine(folders["base"], vision_tower=f"{folders['base']}@main")
    with pytest.raises(blink.BlinkError, match="^BLINK_VISION needs a model with its own vision tower"):
        engine(folders["text"], vision=True)
    text_as_base = tmp_path / "x" / "Qwen3.5-4B"
    shutil.copytree(folders["text"], text_as_base)
    with pytest.raises(blink.BlinkError, match="the selected vision tower has no vision configuration"):
        engine(folders["text"], vision_tower=f"{text_as_base}@main")
    with pytest.raises(blink.BlinkError, match="image_layout must be inline or first"):
        engine(folders["base"], vision=True, image_layout="last")


def test_deployment_settings_pick_native_or_grafted():
    env = {"BLINK_VISION": "1", "BLINK_VISION_TOWER": "Qwen/Qwen3.5-4B@main"}
    dep = blink.Deployment(blink.Settings.from_env(env, gpu=False))
    assert dep._vision_options("Qwen/Qwen3.5-4B") == {"vision": True, "vision_tower": None}
    assert dep._vision_options("thegovind/blink-4b") == {"vision": False, "vision_tower": "Qwen/Qwen3.5-4B@main"}
    assert dep._vision_options(blink.STANDIN_MODEL) == {}
    dep = blink.Deployment(blink.Settings(vision=False, vision_tower=None))
    assert dep._vision_options("Qwen/Qwen3.5-4B") == {} and dep._vision_options("thegovind/blink-4b") == {}


# -------------------------------------------------------------------------------------------------- image requests


def test_processor_falls_back_to_the_pil_image_processor(native):
    if importlib.util.find_spec("torchvision") is None:
        assert type(native.image_processor).__name__ == "Qwen2VLImageProcessorPil"
        assert native.renderer is native.vision_tok
    limits = native.image_limits
    assert (limits.min_pixels, limits.max_pixels, limits.factor) == (tm.MIN_PIXELS, tm.MAX_PIXELS, 32)


def test_layout_first_matches_the_reference_forward(native):
    state = {"photo": URI, "note": "taken at noon"}
    got, _, meta = image_logits(native, state)
    want = reference_label_logits(native, First({"photo": "[image 1]", "note": "taken at noon"}, 1), [IMAGE])
    assert_close(got, want)
    assert meta == {"image_pixels": 96 * 64, "visual_tokens": 96 * 64 // 32**2}
    other, _, _ = image_logits(native, {"photo": png_uri(gradient(96, 64, shift=77)), "note": "taken at noon"})
    assert max(abs(a - b) for a, b in zip(other["kind"], got["kind"])) > 1e-3  # the pixels reach the answer


def test_layout_inline_matches_the_reference_forward(native, native_inline):
    assert (native_inline.image_layout, native.image_layout) == ("inline", "first")
    state = {"before": "the photo:", "photo": URI, "after": "end"}
    got, _, _ = image_logits(native_inline, state)
    want = reference_label_logits(
        native_inline, Inline({"before": "the photo:", "photo": PLACEHOLDER, "after": "end"}), [IMAGE]
    )
    assert_close(got, want)
    first, _, _ = image_logits(native, state)
    assert max(abs(a - b) for a, b in zip(first["kind"], got["kind"])) > 1e-4


def test_image_prompts_rotate_ask_each_option_and_carry_the_label_mass(native):
    state = {"photo": URI, "note": "taken at noon"}
    kind = QS["kind"]
    qs = {"kind": {**kind, "permute": 3}, "which": {**kind, "multi": True}}
    raw = image_forward(native, state, qs).readouts
    assert [len(raw[q].logits) for q in qs] == [3, 3]
    plain, _, _ = image_logits(native, state)
    # permute rotates the key order (car, cat, dog): its rotation 1 is the order listed here (cat, dog, car)
    assert raw["kind"].logits[1] == pytest.approx(plain["kind"], abs=1e-5)
    visible = First({"photo": "[image 1]", "note": "taken at noon"}, 1)
    keyed = {**kind, "criteria": dict(sorted(kind["criteria"].items()))}
    option_dog = {"type": "noul", "instructions": blink.multi_criterion(kind["instructions"], "dog: a dog")}
    for readout, row, q in ((raw["kind"], 0, keyed), (raw["which"], 1, option_dog)):
        logits = reference_logits(native, visible, [IMAGE], "q", q)
        labels = native.label_ids[: len(readout.logits[row])]
        assert readout.logits[row] == pytest.approx(logits[labels].tolist(), abs=1e-4)
        want = logits.float().log_softmax(-1)[labels].exp().sum().item()
        assert blink.label_mass(readout.logits[row], readout.lse[row]) == pytest.approx(want, rel=1e-4)  # ~1e-3


def test_two_images_inline_and_listed(native):
    second = gradient(64, 128, shift=5)
    state = {"photo": URI}
    got, _, meta = image_logits(native, state, [png_uri(second)])
    visible = {"state": {"photo": "[image 1]"}, "images": ["[image 2]"]}
    assert_close(got, reference_label_logits(native, First(visible, 2), [IMAGE, second]))
    assert meta["visual_tokens"] == (96 * 64 + 64 * 128) // 32**2


def test_grafted_model_reads_images(grafted):
    got, _, _ = image_logits(grafted, URI)
    assert_close(got, reference_label_logits(grafted, First("[image 1]", 1), [IMAGE]))


def test_decide_with_images_end_to_end(served, native, native_timed):
    big = gradient(320, 240)
    result = served(native).decide({"photo": png_uri(big)}, QS)
    h, w = smart_resize(240, 320, factor=32, min_pixels=tm.MIN_PIXELS, max_pixels=tm.MAX_PIXELS)
    meta = result["meta"]
    assert meta["image_pixels"] == h * w and meta["visual_tokens"] == h * w // 32**2
    assert meta["engine"] == "torch" and meta["input_tokens"] == meta["prefill_tokens"] > meta["visual_tokens"]
    assert "vision_encoder_ms" not in meta
    assert set(result["answers"]) == set(QS) and result["answers"]["sharp"]["type"] == "score"
    timed = served(native_timed).decide({"photo": URI}, QS)["meta"]
    assert timed["image_preprocess_ms"] > 0 and timed["vision_encoder_ms"] > 0 and timed["lm_prefill_ms"] > 0
    assert timed["lm_prefill_ms"] <= timed["model_ms"] + 1


def test_text_requests_on_a_vision_engine_stay_text(served, text_engine, grafted):
    dep = served(grafted)
    state = "The parcel arrived damaged."
    image_logits(grafted, URI)  # an image request first: no state of it may reach the next text request
    result = dep.decide(state, QS)
    request = blink.parse_request(state, QS, settings=SETTINGS)
    assert result["answers"] == blink.assemble(
        request, text_engine.forward(request).readouts, {qkey: 1.0 for qkey in QS}
    )
    assert "image_pixels" not in result["meta"]


def test_text_only_model_refuses_images(served, text_engine):
    dep = served(text_engine)
    with pytest.raises(blink.ImageError) as err:
        dep.decide({"a": "x", "b": [URI]}, QS)
    assert (str(err.value), err.value.loc) == ("this model reads text only", ["body", "state", "b", 0])
    with pytest.raises(blink.ImageError) as err:
        dep.decide("x", QS, images=[URI])
    assert err.value.loc == ["body", "images", 0]


def test_batched_image_requests_answer_like_decide(served, native):
    dep = served(native, blink.Settings(batch_window_ms=0))
    text_req, image_req = ("plain words", QS), ({"photo": URI}, QS)
    out = dep.decide_many([text_req, image_req, ("see the image", QS, [URI]), ("x", QS, ["bad"])])
    assert out[0]["answers"] == dep.decide(*text_req)["answers"]
    assert_close(
        {k: [v["probabilities"][o] for o in v["probabilities"]] for k, v in out[1]["answers"].items()},
        {k: [v["probabilities"][o] for o in v["probabilities"]] for k, v in dep.decide(*image_req)["answers"].items()},
    )
    assert out[2]["meta"]["visual_tokens"] == 6 and isinstance(out[3], blink.ImageError)
    res = dep.submit(dep.request("see the image", QS, images=[URI]), native.model_id)
    assert res["meta"]["image_pixels"] == 96 * 64


def test_image_prompt_with_a_literal_pad_token_is_refused(native):
    with pytest.raises(blink.BlinkError, match="has mismatched image patches"):
        image_logits(native, {"photo": URI, "text": "<|image_pad|>"})


def test_reference_image_processor_reloads_from_the_folder(folders, native):
    proc = AutoImageProcessor.from_pretrained(folders["base"])
    tok = AutoTokenizer.from_pretrained(folders["base"])
    assert type(proc) is type(native.image_processor) and tok.convert_tokens_to_ids(blink.IMAGE_PAD) == (
        native.image_token_id
    )


def test_bundled_image_example_runs_on_a_vision_model_and_is_never_recorded(served, native, folders, tmp_path):
    path = next(f for f in blink.example_files() if f.endswith("support-chart-image.json"))
    example = blink.load_example(path)
    result = served(native).decide(example["state"], example["questions"])
    assert result["answers"]["busiest"]["choice"] in ("Q1", "Q2", "Q3", "Q4") and result["meta"]["visual_tokens"] > 0
    data = record.record(folders["text"], str(tmp_path / "replay.json"), settings=SETTINGS)
    assert "support-chart-image.json" not in {hit["example"] for hit in data["requests"].values()}
