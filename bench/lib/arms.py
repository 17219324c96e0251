"""Every arm of every benchmark, in one registry: the name its results file gives it, the name tables and the figure
give it, what it runs, and what makes it that arm: blink's settings it changes (an engine built here, or a server's
BLINK_* variables), or the function that runs or starts it. A benchmark takes
its arms from here; its tables and lib/plot.py name them from here."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import blink


@dataclass(frozen=True)
class Arm:
    """One arm of one benchmark."""

    name: str  # as its results file names it
    title: str  # as tables and the figure name it
    what: str  # what it runs, in one line
    settings: dict = field(default_factory=dict)  # blink Settings fields it sets, over its benchmark's base settings
    runs: str | None = None  # "module:function" under bench/ (e.g. "peers.llamacpp:start") that runs or starts it
    python: str = "project"  # a server arm's environment: the project's (.venv) or vLLM's (.venv-vllm)
    app_args: dict = field(default_factory=dict)  # the Ray Serve app's arguments (adapters/serve.py; bench serve)
    colour: str | None = None  # in the figure

    def function(self) -> Callable:
        """The function that runs or starts this arm (`runs`), imported now."""
        module, name = self.runs.split(":")
        return getattr(importlib.import_module(f"bench.{module}"), name)

    def env(self) -> dict[str, str]:
        """The BLINK_* variables that give a server this arm's settings."""
        names = {f.name: f.metadata["env"] for f in fields(blink.Settings) if "env" in f.metadata}
        return {names[k]: str(v) for k, v in self.settings.items()}


def _as_named(name: str, what: str, settings: dict) -> Arm:
    """An arm titled as its results file names it."""
    return Arm(name, name, what, settings)


F32_TORCH = {"dtype": "float32", "cpu_matmul": "torch"}  # the exact path: every answer is compared with its
NO_PREFIX = {"prefix_cache": False}


def _named(*arms: Arm) -> dict[str, Arm]:
    """Arms by name, in the order given."""
    return {arm.name: arm for arm in arms}


REGISTRY: dict[str, dict[str, Arm]] = {
    # `python -m bench run`, the grid: the ways of getting a choice out of one loaded causal LM
    "grid": _named(
        Arm(
            "blink_plain",
            "blink",
            "TorchEngine.forward: every question a right-padded prefill packed under BLINK_TOKEN_BUDGET",
            {"prefix_cache": False},
            colour="#1f77b4",
        ),
        Arm(
            "blink_prefix",
            "blink prefix",
            "the same with BLINK_PREFIX_CACHE=1: system prompt and evidence encoded once, each question's tail after",
            {"prefix_cache": True},
            colour="#17becf",
        ),
        Arm(
            "unbatched",
            "forward/question",
            "model(ids).logits[0, -1] at the label ids, one question at a time: the loop a user writes by hand",
            runs="lib.grid:unbatched_one",
            colour="#7f7f7f",
        ),
        Arm(
            "per_option",
            "per-option LL",
            "one forward per option of (context + option text)[:-1], continuation log-probs summed "
            "(lm-evaluation-harness multiple choice, SGLang select)",
            runs="lib.grid:per_option_one",
            colour="#d62728",
        ),
        Arm(
            "generate",
            "generate+parse",
            "model.generate (greedy, 4 new tokens), then the first offered letter in the text",
            runs="lib.grid:generate_one",
            colour="#ff7f0e",
        ),
    ),
    # `python -m bench run`, the decision peers: what a user would pick instead of blink, on the three cases
    "decision": _named(
        Arm("blink", "blink", "blink at its defaults (no BLINK_* variable): a Deployment serving the engine, decide()"),
        Arm(
            "pipeline",
            "pipeline",
            "transformers' pipeline('decision') with its own built-in prompt, on the model as from_pretrained loads "
            "it: one unbatched forward per question",
            runs="peers.decision:start_pipeline",
        ),
        Arm(
            "pipeline_export",
            "pipeline_export",
            "the same pipeline reading the DecisionConfig `python blink.py export` writes: blink's prompt, token for "
            "token",
            runs="peers.decision:start_pipeline_export",
        ),
        Arm(
            "pipeline_bfloat16",
            "pipeline_bfloat16",
            "the pipeline as a user runs it at blink's dtype where blink computes in bfloat16 and the checkpoint is "
            "not: pipeline('decision', model=<checkpoint>, dtype=torch.bfloat16), its own model freshly loaded",
            runs="peers.decision:start_pipeline_bfloat16",
        ),
        Arm(
            "llama.cpp",
            "llama.cpp",
            "llama-cpp-python on the stand-in's Q4_1 GGUF file, fed blink's prompt ids, every prompt evaluated from "
            "nothing",
            runs="peers.llamacpp:start",
        ),
        Arm(
            "llama.cpp_reuse",
            "llama.cpp_reuse",
            "the same keeping the longest common prefix with the previous prompt in its KV cache (as llama-server's "
            "prompt cache does)",
            runs="peers.llamacpp:start",
        ),
        Arm(
            "llama.cpp_q8_0",
            "llama.cpp_q8_0",
            "llama-cpp-python on the stand-in's weights at Q8_0 (llama.cpp's quantizer), fed blink's prompt ids, every "
            "prompt evaluated from nothing",
            runs="peers.llamacpp:start",
        ),
        Arm(
            "llama.cpp_q8_0_reuse",
            "llama.cpp_q8_0_reuse",
            "the same at Q8_0 keeping the longest common prefix with the previous prompt in its KV cache",
            runs="peers.llamacpp:start",
        ),
        Arm(
            "llama.cpp_bf16",
            "llama.cpp_bf16",
            "llama-cpp-python on the model's weights at BF16 (a Qwen3.5 checkpoint by llama.cpp's converter, the "
            "stand-in by its quantizer), fed blink's prompt ids, every prompt evaluated from nothing",
            runs="peers.llamacpp:start",
        ),
        Arm(
            "llama.cpp_bf16_reuse",
            "llama.cpp_bf16_reuse",
            "the same at BF16 keeping the longest common prefix with the previous prompt in its KV cache",
            runs="peers.llamacpp:start",
        ),
        Arm(
            "onnxruntime_int8",
            "onnxruntime_int8",
            "ONNX Runtime: the stand-in exported by torch.onnx, quantized by onnxruntime's quantize_dynamic (int8 "
            "weights, activations per call), in .venv-onnx, fed blink's prompt ids, each prompt evaluated from nothing",
            runs="peers.onnxrt:start",
        ),
        Arm(
            "blink_int8",
            "blink_int8",
            "blink with BLINK_QUANTIZE=int8 (otherwise its defaults): a Deployment serving its own engine, decide()",
            {"quantize": "int8"},
            runs="peers.decision:start_blink",
        ),
        Arm(
            "blink_vllm",
            "blink_vllm",
            "blink on vLLM: `python app.py` with BLINK_BACKEND=vllm in .venv-vllm, asked over /v1/systemone, its CPU "
            "time read from the server's process group",
            {"backend": "vllm"},
            runs="peers.vllm_arm:start",
            python="vllm",
        ),
    ),
    # `python -m bench run`, over HTTP
    "http": _named(
        Arm(
            "transformers serve /v1/systemone",
            "transformers serve /v1/systemone",
            "`transformers serve --decision-config` (blink's exported prompt where there is one), one inference thread",
        ),
        Arm("blink /v1/systemone", "blink /v1/systemone", "`python app.py` with no BLINK_* variable but the model"),
    ),
    "drift": _named(
        _as_named("float32", "float32 on torch's own kernels: the exact path, the reference", F32_TORCH),
        _as_named("float32_onednn", "float32, the linear layers by oneDNN", {**F32_TORCH, "cpu_matmul": "onednn"}),
        _as_named("bfloat16", "bfloat16 weights and activations, shared prefixes on", {"dtype": "bfloat16"}),
        _as_named(
            "bfloat16_plain", "the same without shared prefixes (for its drift only)", {"dtype": "bfloat16"} | NO_PREFIX
        ),
        _as_named(
            "int8",
            "BLINK_QUANTIZE=int8 in bfloat16: every linear layer but lm_head int8 (weights per output channel, widened "
            "to bfloat16 as each layer runs), the activations and the rest in bfloat16",
            {"quantize": "int8", "dtype": "bfloat16"},
        ),
    ),
    "gpu": _named(
        Arm("default", "defaults", "the GPU defaults"),
        Arm(
            "kv_32768",
            "`BLINK_PREFIX_KV_TOKENS=32768`",
            "fewer prefix copies held at once",
            {"prefix_kv_tokens": 32768},
        ),
        Arm("plain", "`BLINK_PREFIX_CACHE=0`", "every question runs its whole prompt", {"prefix_cache": False}),
    ),
    "overhead": _named(
        Arm("defaults", "defaults", "blink's defaults"),
        Arm("prefix off", "prefix off", "shared prefixes off (the earlier default)", {"prefix_cache": False}),
        Arm("torch kernels", "torch kernels", "the linear layers by torch's own kernels", {"cpu_matmul": "torch"}),
    ),
    "vllm_check": _named(
        Arm(
            "blink torch float32",
            "torch float32",
            "blink on torch in float32: the reference",
            {"backend": "torch", "dtype": "float32"},
        ),
        Arm(
            "blink torch bfloat16",
            "torch bfloat16",
            "blink on torch in bfloat16",
            {"backend": "torch", "dtype": "bfloat16"},
        ),
        Arm(
            "blink vLLM float32",
            "vLLM float32",
            "blink on vLLM (BLINK_BACKEND=vllm) in float32",
            {"backend": "vllm", "dtype": "float32"},
            python="vllm",
        ),
        Arm(
            "blink vLLM bfloat16",
            "vLLM bfloat16",
            "blink on vLLM (BLINK_BACKEND=vllm) in bfloat16",
            {"backend": "vllm", "dtype": "bfloat16"},
            python="vllm",
        ),
    ),
    "batch": _named(
        Arm("loop", "loop of `decide()`", "decide() per row in a process of its own, each answer appended to OUT"),
        Arm("batch", "`blink.py batch`", "`python blink.py batch IN --out OUT`: rows packed into shared forwards"),
        Arm(
            "ray", "`blink.py batch --ray {workers}`", "the same command on a local Ray cluster, one engine per worker"
        ),
        Arm(
            "pipeline",
            "no model, serial",
            "`python blink.py batch` on the mock engine: what reading, packing and writing feed at most",
            {"engine": "mock"},
        ),
        Arm("pipeline ray", "no model, `--ray {workers}`", "the same through Ray", {"engine": "mock"}),
    ),
    "memory": _named(
        Arm("decide", "decide", "blink.decide() in a loop, in a process of its own"),
        Arm("app", "app", "`python app.py`, sent System One requests over HTTP"),
    ),
    # `python -m bench serve`: blink's Ray Serve app (adapters/serve.py), one replica against two under each router
    "serve": _named(
        Arm("one_replica", "one replica", "the Serve app with one replica", app_args={"replicas": 1}),
        Arm(
            "pow2",
            "pow2",
            "two replicas under Serve's default router (power of two choices over queue lengths)",
            app_args={"replicas": 2, "routing": "pow2"},
        ),
        Arm(
            "prefix_tree",
            "prefix_tree",
            "two replicas under Ray Serve LLM's PrefixCacheAffinityRouter (a character prefix tree over each "
            "request's text)",
            app_args={"replicas": 2, "routing": "prefix_tree"},
        ),
        Arm(
            "evidence",
            "evidence",
            "two replicas under blink's router at its defaults: consistent hashing of each document's evidence key "
            "with bounded loads (documents and queued prompt tokens), another home for a hot document",
            app_args={"replicas": 2, "routing": "evidence"},
        ),
        Arm(
            "evidence_lead",
            "evidence, rule lead {lead}",
            "blink's router under its earlier rule (BLINK_ROUTE_RULE=lead: the rendezvous home unless it leads the "
            "least loaded by more than BLINK_ROUTE_MAX_LEAD requests), on the re-ask and hot workloads",
            app_args={"replicas": 2, "routing": "evidence"},
        ),
    ),
}


def of(benchmark: str) -> dict[str, Arm]:
    """A benchmark's arms, by name."""
    return REGISTRY[benchmark]


def title(benchmark: str, name: str) -> str:
    """How tables and the figure name an arm (its name where the registry has none: an arm of an older run)."""
    arm = REGISTRY.get(benchmark, {}).get(name)
    return arm.title if arm else name


def engine(arm: Arm, model: str, base: blink.Settings) -> blink.TorchEngine:
    """The model loaded by blink's torch engine under the arm's settings (over `base`)."""
    return blink.TorchEngine(model, settings=replace(base, **arm.settings))


def engines(benchmark: str, model: str, base: blink.Settings) -> dict[str, blink.TorchEngine]:
    """The model loaded once per arm of a benchmark whose arms are blink under other settings."""
    return {name: engine(arm, model, base) for name, arm in of(benchmark).items()}
