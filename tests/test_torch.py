"""The torch engine on real models: label verification, packed right-padded readout equal to each prompt alone."""

from __future__ import annotations

import platform
from dataclasses import replace

import pytest
import torch
from conftest import ROOT

import blink
from bench.lib import answers

DOC = (
    "Invoice 2211 from Norrland Timber AB: 40 pallets of pine boards, 18,400 EUR, due 30 days after delivery. "
    "Delivered 3 March; paid 29 April after two reminders. The buyer disputes 4 damaged pallets."
)
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
    "goods": {
        "type": "choice",
        "instructions": "What was sold?",
        "criteria": {"timber": "wood or lumber", "steel": "metal products", "food": "groceries"},
    },
    "many": {
        "type": "choice",
        "instructions": "Pick the letter of the alphabet that starts the supplier's name.",
        "criteria": list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"),
    },
}

SMALL = {k: QUESTIONS[k] for k in ("late", "currency", "dispute")}
DEFAULTS = blink.Settings()  # every setting at its default, on a machine without a GPU


def linear_layers(model) -> list:
    """The model's linear layers (the Gated DeltaNet layers' own forward is blink's on a CPU, whatever the kernels)."""
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def req(state, questions: dict) -> blink.Request:
    """A request parsed at default settings."""
    return blink.parse_request(state, questions, settings=DEFAULTS)


def alone(eng: blink.TorchEngine, prompt: blink.Prompt) -> list[float]:
    """Reference: the full model's logits at the last position of this prompt run by itself."""
    with torch.no_grad():
        logits = eng.model(input_ids=torch.tensor([prompt.ids])).logits[0, -1].float()
    return logits[prompt.cand].tolist()


def max_gap(eng: blink.TorchEngine, state, questions: dict) -> float:
    """Largest difference between the engine's packed readout and each prompt run alone."""
    raw = eng.forward(req(state, questions)).readouts
    prompts = eng.render(req(state, questions))
    return max(abs(a - b) for p in prompts for a, b in zip(raw[p.qkey].logits[0], alone(eng, p)))


def test_standin_labels_verify_and_name_the_model(standin):
    assert standin.labels[:26] == list("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    assert len(set(standin.label_ids)) == len(standin.label_ids)
    assert standin.model_id == blink.STANDIN_MODEL
    assert sum(p.numel() for p in standin.model.parameters()) == pytest.approx(134.5e6, rel=0.01)


def test_standin_packed_readout_equals_each_prompt_alone(standin):
    assert len({len(p.ids) for p in standin.render(req(DOC, QUESTIONS))}) > 1  # real right-padding happens
    assert max_gap(standin, DOC, QUESTIONS) < 1e-4


@pytest.mark.parametrize("readout, budget", [("rows", 64), ("batched", 32768), ("batched", 64)])
def test_readouts_and_budgets_agree(readout, budget):
    eng = blink.TorchEngine(blink.STANDIN_MODEL, settings=blink.Settings(readout=readout, token_budget=budget))
    assert max_gap(eng, {"doc": DOC, "id": 2211}, SMALL) < 1e-4


def test_tiny_qwen35_fp32_packed_equals_alone(tiny_qwen):
    assert [t for t in tiny_qwen.model.config.layer_types] == [
        "linear_attention",
        "full_attention",
        "linear_attention",
        "full_attention",
    ]
    assert max_gap(tiny_qwen, DOC, SMALL) < 1e-4


@pytest.mark.parametrize("model", ["standin", "tiny_qwen"])
def test_a_padded_batch_runs_its_linear_layers_on_its_real_tokens_alone(model, request):
    # The questions' tails differ in length, so their batch is right-padded; each decoder layer's MLP and its other
    # linear layers get the real tokens alone (blink.use_real_tokens): over the call, as many rows as the tokens the
    # engine says it computed, where the padded batch holds more. The answers equal each prompt run alone.
    eng = request.getfixturevalue(model)
    eng.prefixes.clear()
    prompts = eng.render(req(DOC, SMALL))
    assert len({len(p.ids) for p in prompts}) == len(prompts)
    layer = eng.backbone().layers[-1]
    projection = next(m for m in layer.modules() if type(m) is torch.nn.Linear and m not in set(layer.mlp.modules()))
    rows = {"mlp": [], "projection": []}
    hooks = [
        module.register_forward_pre_hook(lambda _, args, seen=seen: seen.append(args[0].shape[:-1].numel()))
        for module, seen in ((layer.mlp, rows["mlp"]), (projection, rows["projection"]))
    ]
    try:
        forward = eng.forward(req(DOC, SMALL))
    finally:
        for hook in hooks:
            hook.remove()
    # after the header, one call runs every prompt's rest, of different lengths: padded, it would count more rows
    assert len(rows["mlp"]) == 2 and sum(rows["mlp"]) == sum(rows["projection"]) == forward.prefill_tokens
    assert max_gap(eng, DOC, SMALL) < 1e-4


@pytest.mark.parametrize("model", ["standin", "tiny_qwen"])
def test_each_mlp_computes_its_activation_in_place_to_the_bits_of_its_own_forward(model, request):
    eng = request.getfixturevalue(model)
    mlps = [layer.mlp for layer in eng.backbone().layers]
    assert all(vars(m)["forward"].__func__ is blink._gated_mlp_forward for m in mlps)
    x = torch.randn(1, 5, mlps[0].gate_proj.in_features, dtype=eng.model.dtype)
    with torch.inference_mode():
        assert torch.equal(mlps[0](x), type(mlps[0]).forward(mlps[0], x))


def test_models_load_without_the_hubs_kernels(tiny_qwen):
    # transformers (5.25) swaps in kernels fetched from the Hub by default: on a GPU that is remote code, and offline
    # the load fails (an H200 run of tests/test_gpu.py stopped at kernels-community/fla). blink loads none.
    assert tiny_qwen.model.use_kernels is False


ARENAS = """
import ctypes, sys, threading
import blink

blink.TorchEngine(sys.argv[1], settings=blink.Settings(release_memory=sys.argv[2] == "1"))
libc = ctypes.CDLL(None)
libc.malloc_stats()  # glibc: an "Arena N:" block per malloc arena, on stderr
gate = threading.Barrier(9)
held = []
threads = [threading.Thread(target=lambda: (held.append(bytearray(4000)), gate.wait())) for _ in range(8)]
for t in threads:
    t.start()
print("threads started", file=sys.stderr, flush=True)
libc.malloc_stats()
gate.wait()
"""


@pytest.mark.skipif(blink._libc("mallopt") is None, reason="glibc's malloc only")
def test_threads_share_malloc_arenas_where_freed_memory_is_released(tiny_qwen_dir):
    # Each thread's own arena keeps pages other threads cannot reuse (the app's forwards run on the Batcher's
    # thread); with BLINK_RELEASE_MEMORY the engine makes threads that start later share the arenas there are.
    import subprocess
    import sys

    def arenas(release: str) -> tuple[int, int]:
        done = subprocess.run(
            [sys.executable, "-c", ARENAS, tiny_qwen_dir, release],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr
        before, after = done.stderr.split("threads started")
        return before.count("Arena "), after.count("Arena ")

    shared, own = arenas("1"), arenas("0")
    assert shared[1] == shared[0]  # 8 new threads, each allocating: no new arena
    assert own[1] >= own[0] + 4  # measured: 6 arenas, then 12


def child_json(script: str, *args: str) -> dict:
    """Run a script in a child Python (a process-wide mode it sets cannot reach this one) and read the JSON object it
    prints last."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# How glibc serves a 64 MB tensor (mapped afresh: mallinfo2's hblks counts it) and whether a free hands pages back
# (the heap's size, arena): inside a forward (a hook on its first layer), and on the same thread after it
HEAP = """
import ctypes, ctypes.util, json, sys
import torch
import blink


class Info(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in names.split()]


libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = Info


def serve_one() -> dict:
    before = libc.mallinfo2()
    big = torch.empty(1 << 24)  # 64 MB
    held = libc.mallinfo2()
    del big
    freed = libc.mallinfo2()
    return {"mapped": held.hblks - before.hblks, "kept": freed.arena >= held.arena and held.arena > before.arena}


settings = blink.Settings(release_memory=sys.argv[2] == "1")
engine = blink.TorchEngine(sys.argv[1], settings=settings)
inside = []
engine.backbone().layers[0].register_forward_hook(lambda *_: inside.append(serve_one()))
engine.forward(blink.parse_request("The parcel arrived late.", {"late": {"type": "noul", "instructions": "Late?"}}))
print(json.dumps({"inside": inside[0], "after": serve_one()}))
"""


@pytest.mark.skipif(blink._libc("mallinfo2") is None, reason="glibc 2.33's malloc only")
def test_a_forward_keeps_the_pages_it_frees_for_its_next_allocation_and_glibc_maps_again_after(tiny_qwen_dir):
    # A forward's activations of tens of MB a layer were each mapped afresh and unmapped on free, faulting their pages
    # in again; inside a forward glibc serves them from its heap and keeps what is freed there,
    # and after it glibc's defaults are back (a 64 MB block mapped, so freeing it hands the pages back at once).
    kept, plain = child_json(HEAP, tiny_qwen_dir, "1"), child_json(HEAP, tiny_qwen_dir, "0")
    assert kept["inside"] == {"mapped": 0, "kept": True}
    assert kept["after"]["mapped"] == 1 and not kept["after"]["kept"]
    assert plain["inside"]["mapped"] == 1  # BLINK_RELEASE_MEMORY=0 leaves glibc alone


# A new thread (the Batcher's) runs a forward of an engine another thread loaded: a product's elements that come out
# denormal on a thread that never ran blink, inside the forward (a hook on its first layer, on the torch threads it
# starts), and whether that thread's own arithmetic keeps denormals once the forward is over
DENORMALS = """
import json, sys, threading
import torch
import blink

torch.set_num_threads(2)


def denormals() -> int:
    y = torch.full((1 << 20,), 1e-20) * 1e-20  # 1e-40: a denormal float32, unless flushed to zero
    return int((y != 0).sum())


def on_a_new_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


engine = on_a_new_thread(lambda: blink.TorchEngine(sys.argv[1], settings=blink.Settings()))
request = blink.parse_request("The parcel arrived late.", {"late": {"type": "noul", "instructions": "Late?"}})
inside = []
engine.backbone().layers[0].register_forward_hook(lambda *_: inside.append(denormals()))


def serve() -> bool:
    engine.forward(request)
    return 1e-310 * 0.5 != 0  # Python's float arithmetic on this thread, after the forward


after = on_a_new_thread(serve)
print(json.dumps({"before": on_a_new_thread(denormals), "inside": inside, "after_keeps_denormals": after}))
"""


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86's flush-to-zero modes")
def test_a_forward_flushes_denormals_on_its_thread_and_its_torch_threads_alone(tiny_qwen_dir):
    # A denormal input made a CPU product 150x slower (blink.denormals_flushed): inside a forward its thread and the
    # torch threads it starts read and write them as zero, where a thread that never ran blink keeps them, and so
    # does the forward's thread once the forward is over (hypothesis, for one, refuses to run where they are gone).
    seen = child_json(DENORMALS, tiny_qwen_dir)
    assert seen["before"] == 1 << 20 and seen["inside"] and set(seen["inside"]) == {0}
    assert seen["after_keeps_denormals"] is True


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86's flush-to-zero modes")
def test_a_block_inside_another_leaves_the_outer_one_flushing_denormals():
    # A forward inside a caller's own denormals_flushed block (or one blink call inside another) must not switch the
    # mode off under the outer block on its way out.
    try:
        assert not blink.flushes_denormals()
        with blink.denormals_flushed():
            with blink.denormals_flushed():
                assert blink.flushes_denormals()
            assert blink.flushes_denormals()
        assert not blink.flushes_denormals()
    finally:
        torch.set_flush_denormal(False)  # this process's other tests keep IEEE's denormals whatever happened above


def test_tiny_qwen35_bf16_keeps_the_argmax(tiny_qwen_dir):
    # bf16 keeps 8 mantissa bits (relative step 2**-8 = 0.4%); with logits of a few units and 4 layers of rounding,
    # batch-shape-dependent kernels move a logit by a few hundredths, so 5e-2 bounds noise, not a real difference.
    eng = blink.TorchEngine(tiny_qwen_dir, settings=blink.Settings(dtype="bfloat16"))
    assert eng.model.dtype == torch.bfloat16
    raw = eng.forward(req(DOC, SMALL)).readouts
    for p in eng.render(req(DOC, SMALL)):
        ref = alone(eng, p)
        row = raw[p.qkey].logits[0]
        assert max(abs(a - b) for a, b in zip(row, ref)) < 5e-2
        assert max(range(len(ref)), key=ref.__getitem__) == max(range(len(ref)), key=row.__getitem__)


def test_one_dtype_rule_for_every_backend_on_every_device():
    # bfloat16 on a GPU and on a CPU that computes it natively, float32 on any other CPU; BLINK_DTYPE overrides.
    assert [
        blink.default_dtype(gpu, bf16) for gpu, bf16 in ((True, False), (True, True), (False, True), (False, False))
    ] == ["bfloat16"] * 3 + ["float32"]
    with open("/proc/cpuinfo", encoding="utf-8") as fh:
        flags = next(line for line in fh if line.startswith("flags")).split()
    assert blink.native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)  # torch's probe, the kernel's flags
    here = blink.Settings.from_env({}, gpu=False)
    assert here.cpu_bf16 == blink.native_bf16()
    assert here.compute_dtype == ("bfloat16" if blink.native_bf16() else "float32")
    assert blink.Settings.from_env({"BLINK_DTYPE": "float32"}, gpu=False).compute_dtype == "float32"
    for cpu_bf16 in (True, False):  # the vLLM backend follows the same rule
        settings = blink.Settings(cpu_bf16=cpu_bf16)
        assert blink.vllm_engine_args("m", None, settings)["dtype"] == settings.compute_dtype
        assert settings.on_hardware(gpu=False, cpu_bf16=not cpu_bf16).compute_dtype == blink.default_dtype(
            False, not cpu_bf16
        )  # a worker on another CPU takes its own
        assert replace(settings, dtype="float32").on_hardware(gpu=True).compute_dtype == "float32"  # set: kept


def test_the_default_dtype_answers_and_says_so(tiny_qwen_dir):
    # An engine at the defaults this machine's environment gives (no BLINK_DTYPE) runs the rule's dtype, and every
    # live answer's meta says the backend, dtype and kernel that answered. Its answers are float32's within what
    # bfloat16 did to this tiny model in `python -m bench drift` (bench/results/drift.json): probabilities moved by at
    # most 0.0605, one pick of 24 flipped, where float32's top two stood 0.092 apart. So picks must agree wherever
    # float32's top two stand more than twice 0.0605 apart, and no probability may move by 0.1 or more.
    settings = blink.Settings.from_env({}, gpu=False)
    default = blink.Deployment.serving(blink.TorchEngine(tiny_qwen_dir, settings=settings))
    exact = blink.Deployment.serving(blink.TorchEngine(tiny_qwen_dir, settings=replace(settings, dtype="float32")))
    got, ref = default.decide(DOC, SMALL), exact.decide(DOC, SMALL)
    assert got["meta"]["dtype"] == settings.compute_dtype and ref["meta"]["dtype"] == "float32"
    assert got["meta"]["backend"] == ref["meta"]["backend"] == "torch"
    packs = settings.compute_dtype == "bfloat16" and torch.backends.mkldnn.is_available()  # bfloat16: packed weights
    assert ref["meta"]["cpu_matmul"] in ("onednn", "torch") and got["meta"]["cpu_matmul"] == (
        "onednn" if packs else "torch" if settings.compute_dtype != "float32" else ref["meta"]["cpu_matmul"]
    )
    compared = answers.compare(ref["answers"], got["answers"])
    steady = {k for k, a in ref["answers"].items() if answers.margin(answers.distribution(a)) > 2 * 0.0605}
    assert compared["questions"] == len(SMALL) and steady  # at least one pick is held to float32's
    assert not steady & set(compared["picks_differ"]) and compared["max_prob_diff"] < 0.1


def test_cpu_matmul_onednn_answers_as_torch_kernels_do(tiny_qwen_dir):
    # BLINK_CPU_MATMUL=onednn runs every linear layer of 4 rows or more through oneDNN, the same weights in place;
    # the answers equal torch's own kernels within float32 rounding, on the stand-in and on Qwen3.5's linear attention.
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    for source, questions in ((blink.STANDIN_MODEL, QUESTIONS), (tiny_qwen_dir, SMALL)):
        own = blink.TorchEngine(source, settings=blink.Settings(cpu_matmul="torch"))
        onednn = blink.TorchEngine(source, settings=blink.Settings(cpu_matmul="onednn"))
        assert (own.matmul, onednn.matmul) == ("torch", "onednn")
        head = onednn.model.lm_head
        linears = [m for m in onednn.model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
        assert linears and all(m.forward.__func__ is blink._onednn_forward for m in linears)
        assert "forward" not in vars(head)  # blink never calls lm_head: its rows are read by hand
        assert not any("forward" in vars(m) for m in linear_layers(own.model))
        calls = []

        def counted(*args, calls=calls, products=blink.onednn_linear):
            calls.append(args[0].shape)
            return products(*args)

        a = own.forward(req(DOC, questions)).readouts
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(blink, "onednn_linear", counted)
            b = onednn.forward(req(DOC, questions)).readouts
        assert len(calls) >= len(linears)  # oneDNN computed the layers (not torch's kernel twice) ...
        gap = max(abs(x - y) for q in questions for x, y in zip(a[q].logits[0], b[q].logits[0]))
        assert gap < 1e-3  # ... with the same answers; whether its rounding differs from torch's is the CPU's business
        assert max_gap(onednn, DOC, SMALL) < 1e-4  # packed equals each prompt alone under oneDNN too


def test_onednn_forward_takes_only_products_of_enough_rows():
    # Under ONEDNN_MIN_ROWS rows the product is a matrix-vector one and stays with torch's kernel, bit for bit.
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    layer = torch.nn.Linear(96, 200).requires_grad_(False)
    few, many = torch.randn(1, blink.ONEDNN_MIN_ROWS - 1, 96), torch.randn(2, blink.ONEDNN_MIN_ROWS, 96)
    assert torch.equal(blink._onednn_forward(layer, few), torch.nn.functional.linear(few, layer.weight, layer.bias))
    onednn = torch.ops.mkldnn._linear_pointwise(many, layer.weight, layer.bias, "none", [], "")
    assert torch.equal(blink._onednn_forward(layer, many), onednn)
    assert torch.allclose(onednn, torch.nn.functional.linear(many, layer.weight, layer.bias), atol=1e-5)


def test_bfloat16_weights_are_packed_for_onednn_once_at_load(tiny_qwen_dir):
    # torch's bfloat16 product on a CPU is oneDNN's, laying each weight out anew on every call: blink packs the
    # decoder's weights once at load (not lm_head, whose rows it reads by hand) and answers as torch's product does.
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    own = blink.TorchEngine(tiny_qwen_dir, settings=blink.Settings(dtype="bfloat16", cpu_matmul="torch"))
    packed = blink.TorchEngine(tiny_qwen_dir, settings=blink.Settings(dtype="bfloat16"))
    if not blink.onednn_packs_bfloat16():  # a CPU without AVX-512: torch's own kernel runs bfloat16, nothing packed
        assert packed.matmul == "torch" and packed.packed_head is None
        assert not any("forward" in vars(m) for m in linear_layers(packed.model))
        pytest.skip("this CPU's oneDNN lays out no bfloat16 weights (the fallback to torch's kernel checked)")
    assert (own.matmul, packed.matmul) == ("torch", "onednn") and packed.compute["cpu_matmul_verdict"] is None
    head = packed.model.lm_head
    linears = [m for m in packed.model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    assert linears and all(m.forward.__func__ is blink._packed_forward and m.weight.is_mkldnn for m in linears)
    assert "forward" not in vars(head) and not head.weight.is_mkldnn
    assert not any("forward" in vars(m) for m in linear_layers(own.model))
    assert sum(p.numel() for p in packed.model.parameters()) == sum(p.numel() for p in own.model.parameters())
    a, b = own.forward(req(DOC, SMALL)).readouts, packed.forward(req(DOC, SMALL)).readouts
    assert max(abs(x - y) for q in SMALL for x, y in zip(a[q].logits[0], b[q].logits[0])) < 5e-2


def test_cpu_matmul_leaves_other_dtypes_and_measures_under_auto(tiny_qwen_dir, monkeypatch):
    # float16 is left to torch. Under "auto" a float32 model's kernel is what the measured comparison decides,
    # whichever way it goes, and the engine says which kernel runs and why.
    fp16 = blink.TorchEngine(tiny_qwen_dir, settings=blink.Settings(dtype="float16", cpu_matmul="onednn"))
    assert fp16.matmul == "torch" and not any("forward" in vars(m) for m in linear_layers(fp16.model))
    assert fp16.compute["dtype"] == "float16" and fp16.compute["cpu_matmul_verdict"] is None
    for kernel in ("onednn", "torch"):
        verdict = {"kernel": kernel, "settled": True, "gain": 2.0 if kernel == "onednn" else 1.0}  # fabricated
        monkeypatch.setattr(blink, "kernel_verdict", lambda *shape, verdict=verdict: verdict)
        eng = blink.TorchEngine(tiny_qwen_dir, settings=blink.Settings(cpu_matmul="auto"))
        assert eng.matmul == (kernel if torch.backends.mkldnn.is_available() else "torch")
        assert eng.compute == {
            "backend": "torch",
            "dtype": "float32",
            "device": "cpu",
            "cpu_matmul": eng.matmul,
            "cpu_matmul_verdict": verdict if torch.backends.mkldnn.is_available() else None,
        }
    assert blink.Settings.from_env({"BLINK_CPU_MATMUL": "torch"}).cpu_matmul == "torch"
    with pytest.raises(blink.BlinkError, match="BLINK_CPU_MATMUL"):
        blink.Settings.from_env({"BLINK_CPU_MATMUL": "mkl"})


def rounds(torch_s: list[float], onednn_s: list[float]) -> dict[str, list[float]]:
    """Per-round seconds of the two kernels, as interleaved_seconds returns them (fabricated by the tests)."""
    return {"torch": torch_s, "onednn": onednn_s}


def test_a_measurement_settles_only_when_load_did_not_decide_it():
    quiet = rounds([2.0, 2.02, 2.01, 2.03], [1.0, 1.01, 1.02, 1.0])  # fabricated: oneDNN twice as fast, steady
    assert blink.settle(quiet)["settled"] and blink.settle(quiet)["gain"] == 2.0
    even = rounds([1.0, 1.01, 1.0, 1.02], [1.0, 1.0, 1.01, 1.0])  # fabricated: the same speed, steady
    assert blink.settle(even)["settled"] and blink.settle(even)["gain"] < blink.ONEDNN_MIN_GAIN
    # fabricated: by best rounds oneDNN clears the bar, round by round it does not: too close to call
    close = rounds([1.0, 1.0, 1.05, 1.0], [0.9, 0.92, 0.95, 0.93])
    found = blink.settle(close)
    assert found["gain"] >= blink.ONEDNN_MIN_GAIN > found["gain_paired"] and not found["settled"]
    busy = rounds([1.0, 1.6, 1.7, 1.5], [0.5, 0.8, 0.9, 0.85])  # fabricated: rounds far from the best
    assert blink.settle(busy)["spread"] > blink.KERNEL_MAX_SPREAD and not blink.settle(busy)["settled"]


def test_a_noisy_measurement_is_measured_again_and_never_kept_unsettled(tmp_path, monkeypatch):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    noisy = rounds([1.0, 1.0, 1.0], [0.5, 1.0, 1.0])  # fabricated
    quiet = rounds([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])  # fabricated
    measured = iter([noisy, quiet])
    monkeypatch.setattr(blink, "interleaved_seconds", lambda kernels, n: next(measured))
    got = blink.measure_kernels(8, 16)
    assert (got["kernel"], got["attempts"], got["settled"]) == ("onednn", 2, True)
    monkeypatch.setattr(blink, "interleaved_seconds", lambda kernels, n: noisy)
    verdict = blink.kernel_verdict.__wrapped__
    got = verdict(8, 16, str(tmp_path))
    assert (got["kernel"], got["attempts"], got["settled"]) == ("torch", blink.KERNEL_ATTEMPTS, False)
    assert not (tmp_path / "cpu-matmul").exists()  # the next process measures again
    assert got in blink.kernel_verdicts().values()  # on record in the header of every bench results file


def test_measured_kernels_take_turns_and_time_every_round():
    calls = []
    seconds = blink.interleaved_seconds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 4, 1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]  # a warm-up each, then turns, order swapped
    assert [len(v) for v in seconds.values()] == [4, 4] and all(t >= 0 for v in seconds.values() for t in v)
    verdict = blink.measure_kernels(32, 48)  # measured for real, on this machine
    assert verdict["kernel"] in ("onednn", "torch") and verdict["attempts"] <= blink.KERNEL_ATTEMPTS
    assert verdict["kernel"] == "torch" or (verdict["settled"] and verdict["gain"] >= blink.ONEDNN_MIN_GAIN)


def test_the_first_verdict_on_a_machine_is_kept_for_every_later_engine(tmp_path, monkeypatch):
    # "auto" measures once per machine, torch, thread count and shape; a later process (or one measuring at the
    # same time) takes the kept verdict, so engines of one model on one machine run the same kernels.
    verdicts = iter([{"kernel": k, "settled": True} for k in ("onednn", "torch", "torch")])  # fabricated
    monkeypatch.setattr(blink, "measure_kernels", lambda *shape: next(verdicts))
    verdict = blink.kernel_verdict.__wrapped__  # past this process's own memo, as a new process would be
    assert verdict(64, 96, str(tmp_path)) == {"kernel": "onednn", "settled": True, "source": "measured"}
    (kept,) = (tmp_path / "cpu-matmul").iterdir()
    assert verdict(64, 96, str(tmp_path)) == {"kernel": "onednn", "settled": True, "source": "kept"}  # not again
    assert verdict(64, 128, str(tmp_path))["kernel"] == "torch"  # another shape is measured on its own
    path = str(tmp_path / "cpu-matmul" / "x.json")
    first, second = {"kernel": "torch", "settled": True}, {"kernel": "onednn", "settled": True}
    assert blink._keep_verdict(path, "k", first) == first and blink._keep_verdict(path, "k", second) == first
    assert blink._read_verdict(str(kept), "another machine") is None
    (tmp_path / "file").write_text("")
    assert blink._keep_verdict(str(tmp_path / "file" / "v.json"), "k", second) == second  # nowhere to keep it
    assert sorted(p.name for p in (tmp_path / "cpu-matmul").iterdir() if not p.name.endswith(".json")) == []


def test_logits_differ_with_the_evidence(tiny_qwen):
    a = tiny_qwen.forward(req("The sky is green.", SMALL)).readouts
    b = tiny_qwen.forward(req("Completely different evidence about cats.", SMALL)).readouts
    assert max(abs(x - y) for q in SMALL for x, y in zip(a[q].logits[0], b[q].logits[0])) > 1e-3


def test_prompt_over_the_token_limit_is_refused_before_any_forward(monkeypatch):
    eng = blink.TorchEngine(blink.STANDIN_MODEL, settings=blink.Settings(max_input_tokens=100))
    calls = []
    monkeypatch.setattr(blink, "_forward", lambda *a: calls.append(a))
    with pytest.raises(blink.BlinkError, match=r"question 'late' renders to \d+ tokens, over the maximum") as caught:
        eng.forward(req(DOC, QUESTIONS))
    assert caught.value.loc == ["body", "questions", "late"]
    assert calls == []


def test_model_whose_labels_do_not_verify_is_refused_at_load(tmp_path):
    import tiny_models

    with pytest.raises(blink.BlinkError, match="verified single-token labels"):
        blink.TorchEngine(tiny_models.build_letterless_tokenizer(tmp_path), settings=DEFAULTS)


def test_decide_meta_on_the_live_engine(standin, served):
    standin.prefixes.clear()  # cold: nothing kept from earlier requests
    out = served(standin).decide(DOC, SMALL)
    meta = out["meta"]
    assert meta["model"] == blink.STANDIN_MODEL and meta["engine"] == "torch"
    assert meta["generated_tokens"] == 0 and meta["temperature"] == 1.0
    prompts = standin.render(req(DOC, SMALL))
    assert meta["input_tokens"] == sum(len(p.ids) for p in prompts)
    header = prompts[0].cuts[0]  # the short evidence is not kept: every prompt runs from the template header
    assert meta["prefill_tokens"] == meta["input_tokens"] - (len(prompts) - 1) * header  # the header computed once
    assert meta["cached_tokens"] == (len(prompts) - 1) * header  # read by the other questions
    assert meta["model_ms"] > 0 and meta["latency_ms"] >= meta["model_ms"]
    assert out["answers"]["currency"]["type"] == "choice"
    assert set(out["answers"]["currency"]["probabilities"]) == {"EUR", "USD", "SEK", "GBP"}


@pytest.mark.parametrize("model", [blink.STANDIN_MODEL, "tiny_qwen"])
def test_a_packed_bfloat16_head_reads_the_vocabulary_as_the_upcast_one_does(model, tiny_qwen_dir):
    # A bfloat16 engine on a CPU keeps lm_head packed for oneDNN and reads the label mass's denominator from one
    # bfloat16 product, its highest logits recomputed in float32: within its stated bound of the upcast FP32 product.
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    if not blink.onednn_packs_bfloat16():
        pytest.skip("this CPU's oneDNN lays out no bfloat16 weights: lm_head is read by the upcast product")
    eng = blink.TorchEngine(tiny_qwen_dir if model == "tiny_qwen" else model, settings=blink.Settings(dtype="bfloat16"))
    assert eng.packed_head is not None and eng.packed_head.is_mkldnn
    head = eng.model.lm_head.weight
    prompts = eng.render(req(DOC, QUESTIONS))
    with torch.no_grad():
        hs = torch.cat(
            [
                blink._last_hidden(eng.backbone()(input_ids=torch.tensor([p.ids])).last_hidden_state, [len(p.ids)])
                for p in prompts
            ]
        )
    upcast = torch.tensor(blink._vocab_lse(head, hs), dtype=torch.float64)
    packed = torch.tensor(blink._vocab_lse(head, hs, eng.packed_head), dtype=torch.float64)
    logits = hs.double() @ head.double().T
    outside = 1 - torch.softmax(logits, -1).sort(-1, descending=True).values[:, : blink.LSE_EXACT_TOP].sum(-1)
    bound = 2.0**-9 * logits.abs().max(-1).values * outside + 1e-5
    assert ((packed - upcast).abs() <= bound).all() and (packed - upcast).abs().max() < 1e-3
    assert (upcast - torch.logsumexp(logits, -1)).abs().max() < 1e-4  # the upcast product: exact in FP32
    assert blink.pack_head(eng.model, "torch") is None  # BLINK_CPU_MATMUL=torch: the upcast readout


def test_blinks_attention_keeps_the_masks_other_callers_give(standin):
    # The engine's model runs blink's attention (prefix_attention); called by anyone else with a padding mask (here a
    # left-padded batch), it masks as SDPA does: each row's last logits equal the prompt's alone.
    assert standin.model.config._attn_implementation == blink.PREFIX_ATTENTION
    prompts = [p.ids for p in standin.render(req(DOC, SMALL))][:2]
    width = max(map(len, prompts))
    ids = torch.tensor([[standin.pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        batch = standin.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        alone = [standin.model(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts]
    assert len({len(p) for p in prompts}) == 2  # real padding
    for row, want in enumerate(alone):
        assert (batch.logits[row, -1] - want).abs().max() < 1e-3


def mapped_checkpoint_rss() -> int:
    """Bytes of this process's memory resident from mapped .safetensors files (/proc/self/smaps)."""
    total, in_checkpoint = 0, False
    with open("/proc/self/smaps", encoding="utf-8") as fh:
        for line in fh:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:  # a mapping's first line
                in_checkpoint = fields[-1].endswith(".safetensors")
            elif in_checkpoint and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def test_a_copied_weights_pages_of_the_mapped_checkpoint_are_released():
    """The pages a weight was read from stay resident while the checkpoint is mapped, beside the copy made of them;
    release_mapped_pages drops them (the values read again from the file are the same)."""
    from transformers import AutoModelForCausalLM

    folder = blink.standin_folder(blink.Settings().cache_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    weight = model.lm_head.weight.detach()
    reference = weight.clone()  # every page of it read
    held = mapped_checkpoint_rss()
    assert held >= weight.nbytes
    released = blink.release_mapped_pages(weight, blink.mapped_ranges())
    assert released >= weight.nbytes - 2 * 4096
    assert mapped_checkpoint_rss() <= held - released + 8192
    assert blink.release_mapped_pages(reference, blink.mapped_ranges()) == 0  # not mapped: nothing to release
    assert torch.equal(weight, reference)


def test_weights_left_in_the_checkpoints_mapped_file_are_copied_out_and_stay_tied():
    """The stand-in (float32, its embedding tied to lm_head) loaded as from_pretrained loads it reads its weights
    from the mapped checkpoint; own_mapped_weights copies them into the process, so none is read from a file."""
    import gc

    from transformers import AutoModelForCausalLM

    folder = blink.standin_folder(blink.Settings().cache_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    before = blink.mapped_ranges()
    assert before and any(lo <= model.lm_head.weight.data_ptr() < hi for lo, hi in before)
    reference = model.lm_head.weight.detach().clone()
    assert blink.own_mapped_weights(model) > 0
    gc.collect()
    mapped = blink.mapped_ranges()
    assert not any(lo <= t.data_ptr() < hi for t in model.state_dict().values() for lo, hi in mapped)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still one tensor
    assert torch.equal(model.lm_head.weight, reference)
