"""GPU checks: the torch engine on a CUDA device against the CPU's exact path (float32), on the tiny Qwen3.5 text
and vision models. Skipped where torch sees no CUDA device, as in CI; run by hand on a GPU with
`python -m pytest -q tests/test_gpu.py` (docs/testing.md, *On a GPU*, says where and when it last ran)."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from image_samples import png_uri

import blink

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DOC = (
    "Invoice 2211 from Norrland Timber AB: 40 pallets of pine boards, 18,400 EUR, due 30 days after delivery. "
    "Delivered 3 March; paid 29 April after two reminders. The buyer disputes 4 damaged pallets. "
)
LONG_DOC = DOC * 24  # over BLINK_PREFIX_MIN_TOKENS: its questions share the encoded evidence
QUESTIONS = {
    "late": {"type": "noul", "instructions": "Was the invoice paid after its due date?"},
    "currency": {
        "type": "choice",
        "instructions": "Which currency is the invoice in?",
        "criteria": ["EUR", "USD", "SEK", "GBP"],
    },
    "dispute": {
        "type": "score",
        "instructions": "How serious is the dispute?",
        "criteria": ["no dispute", "minor", "part of the order", "whole order"],
    },
    "many": {
        "type": "choice",
        "instructions": "Pick the letter that starts the supplier's name.",
        "criteria": list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"),
    },
}
CPU = blink.Settings(dtype="float32", gpu=False)


def gap(got: dict, ref: dict) -> float:
    """The largest probability difference between two decide() results over every question and label."""
    return max(
        abs(p - ref["answers"][k]["probabilities"][label])
        for k, a in got["answers"].items()
        for label, p in a["probabilities"].items()
    )


def picks(result: dict) -> dict:
    """Each question's pick: the chosen option, yes/no, or the most likely level."""
    return {k: max(a["probabilities"], key=a["probabilities"].get) for k, a in result["answers"].items()}


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory) -> str:
    import tiny_models

    return tiny_models.build_qwen35_text(tmp_path_factory.mktemp("gpu") / "tiny-qwen3.5")


@pytest.fixture(scope="module")
def cpu_ref(text_folder) -> blink.Deployment:
    """The tiny model on the CPU in float32: the answers every GPU arm is held to."""
    return blink.Deployment.serving(blink.TorchEngine(text_folder, settings=CPU))


def on_gpu(folder: str, **changes) -> blink.Deployment:
    """The model on the GPU at the defaults a GPU machine gets (Settings.from_env), but for `changes`."""
    settings = replace(blink.Settings.from_env({}), **changes)
    return blink.Deployment.serving(blink.TorchEngine(folder, settings=settings))


def test_a_gpu_machine_gets_the_gpu_rule():
    settings = blink.Settings.from_env({})
    assert settings.gpu and settings.compute_dtype == "bfloat16"
    assert blink.Settings.from_env({"BLINK_DTYPE": "float32"}).compute_dtype == "float32"


@pytest.mark.parametrize("doc", [DOC, LONG_DOC], ids=["short", "shared-prefix"])
def test_float32_on_the_gpu_answers_as_the_cpu(text_folder, cpu_ref, doc):
    gpu = on_gpu(text_folder, dtype="float32")
    assert gpu.engine().model.device.type == "cuda"
    got, ref = gpu.decide(doc, QUESTIONS), cpu_ref.decide(doc, QUESTIONS)
    assert got["meta"]["dtype"] == "float32" and got["meta"]["backend"] == "torch"
    print(f"float32 cuda vs cpu ({len(doc)} chars): largest probability gap {gap(got, ref):.2e}")
    assert gap(got, ref) < 1e-4 and picks(got) == picks(ref)


def test_the_gpu_default_bfloat16_drifts_as_the_cpus_does(text_folder, cpu_ref):
    # bfloat16 keeps 8 mantissa bits, so no fixed bound fits every model: the tiny model's peaked random logits move
    # a probability by 0.06 on the CPU. CUDA's bfloat16 kernels round differently but no coarser, so the GPU's gap
    # from float32 stays within twice the CPU's (plus 0.01), and a pick moves only where float32's margin is inside
    # that gap.
    gpu = on_gpu(text_folder)
    cpu_bf16 = blink.Deployment.serving(blink.TorchEngine(text_folder, settings=replace(CPU, dtype="bfloat16")))
    for doc in (DOC, LONG_DOC):
        got, ref = gpu.decide(doc, QUESTIONS), cpu_ref.decide(doc, QUESTIONS)
        bound = 2 * gap(cpu_bf16.decide(doc, QUESTIONS), ref) + 0.01
        assert got["meta"]["dtype"] == "bfloat16"
        print(
            f"bfloat16 cuda vs float32 cpu ({len(doc)} chars): largest probability gap {gap(got, ref):.3f}, "
            f"bound {bound:.3f}"
        )
        assert gap(got, ref) < bound
        for k, pick in picks(got).items():
            p = sorted(ref["answers"][k]["probabilities"].values(), reverse=True)
            assert pick == picks(ref)[k] or p[0] - p[1] < bound


def test_shared_prefixes_on_the_gpu_equal_the_plain_path(text_folder):
    shared, plain = on_gpu(text_folder, dtype="float32"), on_gpu(text_folder, dtype="float32", prefix_cache=False)
    got, ref = shared.decide(LONG_DOC, QUESTIONS), plain.decide(LONG_DOC, QUESTIONS)
    assert got["meta"]["prefill_tokens"] < ref["meta"]["prefill_tokens"] == ref["meta"]["input_tokens"]
    assert gap(got, ref) < 1e-4


def test_concurrent_requests_on_the_gpu_are_each_their_own(text_folder, cpu_ref):
    gpu = on_gpu(text_folder, dtype="float32")
    docs = [DOC.replace("18,400 EUR", f"{n},000 {cur}") for n, cur in zip(range(11, 19), ["EUR", "USD"] * 4)]
    results: dict[int, dict] = {}
    start = threading.Barrier(len(docs))

    def one(i: int) -> None:
        start.wait()
        results[i] = gpu.decide(docs[i], QUESTIONS)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(docs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    many = gpu.decide_many([(d, QUESTIONS) for d in docs])
    for i, doc in enumerate(docs):
        ref = cpu_ref.decide(doc, QUESTIONS)
        assert gap(results[i], ref) < 1e-4 and gap(many[i], ref) < 1e-4


def test_images_on_the_gpu_answer_as_on_the_cpu(tmp_path, text_folder):
    import tiny_models
    from PIL import Image

    folder = tiny_models.build_qwen35_vision(tmp_path / "Qwen3.5-4B", text_folder=text_folder)
    qs = {"color": {"type": "choice", "instructions": "Main color of [image 1]?", "criteria": ["red", "blue"]}}
    image = png_uri(Image.new("RGB", (96, 64), (230, 20, 20)))
    ref = blink.Deployment.serving(blink.TorchEngine(folder, settings=CPU, vision=True))
    gpu = blink.Deployment.serving(
        blink.TorchEngine(folder, settings=replace(blink.Settings.from_env({}), dtype="float32"), vision=True)
    )
    got, want = gpu.decide("see the image", qs, images=[image]), ref.decide("see the image", qs, images=[image])
    assert got["meta"]["visual_tokens"] == want["meta"]["visual_tokens"] > 0
    assert gap(got, want) < 1e-4
