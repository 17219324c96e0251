"""blink-4b's own architecture for llama.cpp: random-weight Qwen3.5 text models (hybrid Gated DeltaNet and full
attention, every fourth layer full) tokenized with the Qwen vocabulary llama.cpp ships for its `qwen35` pre-tokenizer,
converted to GGUF by llama.cpp's own converter (BF16) and re-typed by its own quantizer (Q8_0 and the rest).

Everything comes from the llama.cpp tree vendored in llama-cpp-python's source distribution (the version installed,
else tools/requirements-llama.txt's): convert_hf_to_gguf.py with its conversion/ package and gguf-py, and
models/ggml-vocab-qwen35.gguf, the vocabulary file llama.cpp tests its qwen35 tokenizer with. That file holds
151,643 byte-level BPE tokens, their merges and three control tokens (<|endoftext|>, <|im_start|>, <|im_end|>): the
Qwen2/Qwen3 token table, not the 248,077 tokens of the released Qwen3.5 checkpoints (those are not on this machine).
The models keep Qwen3.5's 248,320-row embedding and output matrices all the same (the converter names the rows no
token uses [PAD<i>]), so every forward pass costs what the real model's does; a prompt tokenizes as Qwen3.5's
pre-tokenizer splits it over that table.

The sdist, the tokenizer, each shape's model folder and each folder's GGUF files are built once and kept under
BLINK_CACHE (llama-src/, qwen35/, gguf/qwen35/).
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import tempfile

from bench.lib import checkpoints
from bench.workers import isolated

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENDOR = "vendor/llama.cpp/"  # llama.cpp's tree in the sdist
SOURCES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-qwen35.gguf")  # what is kept of it
VOCAB = "models/ggml-vocab-qwen35.gguf"
FTYPES = {"q4_1": 3, "q8_0": 7, "bf16": 32}  # llama.cpp's LLAMA_FTYPE_MOSTLY_* of each type its quantizer makes here
CONVERTED = "bf16"  # the type the converter writes; the others are quantized from it

# The converter tells a BPE pre-tokenizer by the ids its test string tokenizes to. On that string llama.cpp's qwen35
# vocabulary gives the ids Qwen1.5's tokenizer gives ("qwen2": the two regexes differ on combining marks only, and
# the string has none that split differently), so a Qwen3.5 checkpoint carrying it is written with the pre-tokenizer
# transformers' Qwen3_5Tokenizer always applies: "qwen35". Run as `python -c CONVERT tree argv...`.
CONVERT = """
import sys
tree = sys.argv[1]
sys.path.insert(0, tree)
sys.argv = [tree + "/convert_hf_to_gguf.py", *sys.argv[2:]]
import convert_hf_to_gguf
from conversion.qwen import Qwen3_5TextModel
hashed = Qwen3_5TextModel.get_vocab_base_pre
Qwen3_5TextModel.get_vocab_base_pre = lambda self, tok: {"qwen2": "qwen35"}.get(hashed(self, tok), hashed(self, tok))
convert_hf_to_gguf.main()
"""


def llama_version() -> str:
    """The llama-cpp-python version whose llama.cpp converts here: the one installed, else the pinned one."""
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        with open(os.path.join(ROOT, "tools", "requirements-llama.txt"), encoding="utf-8") as fh:
            pins = [line.split("==")[1].strip() for line in fh if line.startswith("llama-cpp-python==")]
        return pins[0]


def partial_path(path: str) -> str:
    """Where `path` is written before it is moved into place (this process's own)."""
    return f"{path}.partial-{os.getpid()}"


def llama_source(cache_dir: str) -> str:
    """llama.cpp's tree (SOURCES) from llama-cpp-python's sdist, downloaded by pip once and kept under
    cache_dir/llama-src/<version>/llama.cpp."""
    version = llama_version()
    tree = os.path.join(cache_dir, "llama-src", version, "llama.cpp")
    if os.path.exists(os.path.join(tree, VOCAB)):
        return tree
    os.makedirs(os.path.dirname(tree), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(tree)) as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python", "-d", tmp]
        subprocess.run([*pip, f"llama-cpp-python=={version}"], check=True, capture_output=True)
        (sdist,) = glob.glob(os.path.join(tmp, "llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                inner = member.name.split("/", 1)[-1]
                if member.isfile() and inner.startswith(VENDOR) and inner[len(VENDOR) :].startswith(SOURCES):
                    member.name = inner[len(VENDOR) :]
                    tar.extract(member, os.path.join(tmp, "llama.cpp"), filter="data")
        os.replace(os.path.join(tmp, "llama.cpp"), tree)
    return tree


def vocab_file(cache_dir: str) -> str:
    """llama.cpp's qwen35 vocabulary file."""
    return os.path.join(llama_source(cache_dir), VOCAB)


def build_tokenizer(vocab_gguf: str):
    """A Qwen3.5 tokenizer (transformers' Qwen3_5Tokenizer: byte-level BPE, Qwen3.5's pre-tokenizer regex) over the
    tokens and merges of llama.cpp's qwen35 vocabulary file, its control tokens at their ids (151,643-151,645), then
    the vision tokens and <think>, </think> (as the test tokenizer has them, tests/tiny_models.py) and its ChatML
    template, the one blink renders with."""
    from gguf import GGUFReader
    from tokenizers import AddedToken
    from transformers import Qwen3_5Tokenizer

    from tests import tiny_models

    fields = GGUFReader(vocab_gguf).fields
    tokens, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    vocab = {token: i for i, (token, kind) in enumerate(zip(tokens, types)) if kind == 1}  # 1: normal
    control = [token for token, kind in zip(tokens, types) if kind == 3]
    if control != tiny_models.SPECIAL_TOKENS[:3] or sorted(vocab.values()) != list(range(len(vocab))):
        raise ValueError(f"{vocab_gguf}: not the Qwen token table (normal tokens from 0, then {', '.join(control)})")
    for token in tiny_models.SPECIAL_TOKENS + tiny_models.THINK_TOKENS:
        vocab[token] = len(vocab)
    tok = Qwen3_5Tokenizer(
        vocab=vocab,
        merges=[tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"].contents()],
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=tiny_models.NAMED_SPECIAL_TOKENS,
        model_max_length=32768,
        chat_template=tiny_models.CHAT_TEMPLATE,
    )
    tok.add_tokens([AddedToken("<|im_start|>", special=True, normalized=False)], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tiny_models.THINK_TOKENS])
    return tok


def qwen_tokenizer(cache_dir: str):
    """The Qwen3.5 tokenizer over llama.cpp's qwen35 vocabulary (build_tokenizer), built once (reading the file
    takes ~20 s) and kept under cache_dir/qwen35/tokenizer-<version>."""
    from transformers import AutoTokenizer

    folder = os.path.join(cache_dir, "qwen35", f"tokenizer-{llama_version()}")
    if not os.path.exists(os.path.join(folder, "tokenizer.json")):
        partial = partial_path(folder)
        build_tokenizer(vocab_file(cache_dir)).save_pretrained(partial)
        os.replace(partial, folder)
    return AutoTokenizer.from_pretrained(folder)


def every_fourth_full(layers: int) -> list[str]:
    """Qwen3.5's layer pattern: every fourth layer full attention, the rest linear (Gated DeltaNet)."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]


def qwen_shape(shape: dict, mrope_section: list[int]) -> dict:
    """The config fields of a Qwen3.5 text shape as the released models set them around `shape`: every fourth layer
    full attention, tied embeddings, 32,768 positions; its rotary sections."""
    return {
        **shape,
        "layer_types": every_fourth_full(shape["num_hidden_layers"]),
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "mrope_section": mrope_section,
    }


# The shapes built here: (config fields over the tiny test model's, including its rotary sections).
SHAPES = {
    "4b": qwen_shape(checkpoints.SHAPE, [11, 11, 10]),  # 4.2 B parameters, ~8 GB in bfloat16
    # its first 8 layers (6 Gated DeltaNet, 2 full attention): every product at the 4b's own shapes, 1.5 B parameters
    # (0.9 B of them the decoder's), so float32 fits where the 4b's 17 GB would not
    "4b-8l": qwen_shape({**checkpoints.SHAPE, "num_hidden_layers": 8}, [11, 11, 10]),
    # the 4b's proportions at hidden 320 (query heads 1.6x and linear key/value heads 0.8x/1.6x of it, the MLP 3.6x,
    # 4 query heads per key-value head, 2 linear value heads per key head), 8 layers: 103 M parameters, 79 M of
    # them the embedding
    "small": qwen_shape(
        {
            "hidden_size": 320,
            "intermediate_size": 1152,
            "num_hidden_layers": 8,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 128,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "vocab_size": checkpoints.SHAPE["vocab_size"],
        },
        [6, 5, 5],  # 32 rotary dims, 16 frequencies
    ),
    # the test model's (hidden 64, layers [linear, full, linear, full]) with Qwen3.5's vocabulary rows, tied
    "tiny": {"vocab_size": checkpoints.SHAPE["vocab_size"], "tie_word_embeddings": True},
}


def qwen_folder(name: str, cache_dir: str, device: str = "cpu") -> str:
    """The random-weight Qwen3.5 of SHAPES[name] in bfloat16 (the weights llama.cpp's BF16 file holds exactly) with
    qwen_tokenizer(), built once on `device` and kept under cache_dir/qwen35/<name>-<hash of its shape>. The 4b
    shapes are drawn in bfloat16 from the start ("4b": 8 GB to build, not float32's 17 before the cast), the others
    in float32 and then cast."""
    import torch

    shape = dict(SHAPES[name])
    key = hashlib.sha256(json.dumps([shape, llama_version()], sort_keys=True).encode()).hexdigest()[:12]
    folder = os.path.join(cache_dir, "qwen35", f"{name}-{key}")
    if not os.path.exists(os.path.join(folder, "config.json")):
        tok = qwen_tokenizer(cache_dir)
        partial = partial_path(folder)
        mrope_section = shape.pop("mrope_section", None)
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16 if name.startswith("4b") else before)
        try:
            checkpoints.model_folder(partial, shape, torch.bfloat16, device, mrope_section, tok)
        finally:
            torch.set_default_dtype(before)
        os.replace(partial, folder)
    return folder


def is_qwen35(folder: str) -> bool:
    """Whether `folder` is a local Qwen3.5 text checkpoint (what the converter takes here)."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as fh:
            return "Qwen3_5ForCausalLM" in json.load(fh).get("architectures", [])
    except (OSError, ValueError):
        return False


def folder_key(folder: str) -> str:
    """What names a checkpoint folder's GGUF files: its path, config and weight files (names, sizes, times)."""
    parts = [os.path.realpath(folder)]
    with open(os.path.join(folder, "config.json"), "rb") as fh:
        parts.append(hashlib.sha256(fh.read()).hexdigest())
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        stat = os.stat(path)
        parts.append(f"{os.path.basename(path)}:{stat.st_size}:{stat.st_mtime_ns}")
    return os.path.basename(os.path.normpath(folder)) + "-" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def convert(folder: str, cache_dir: str, path: str) -> str:
    """`folder` converted to BF16 GGUF at `path` by llama.cpp's converter (CONVERT: its pre-tokenizer named), in a
    process of its own; its error (the converter's last lines) raised here."""
    tree = llama_source(cache_dir)
    argv = [folder, "--outtype", CONVERTED, "--outfile", path, "--no-mtp"]
    done = subprocess.run([sys.executable, "-c", CONVERT, tree, *argv], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed on {folder}: {done.stderr.strip()[-2000:]}")
    return path


def quantize(source: str, path: str, ftype: int) -> str:
    """`source` (a GGUF file) quantized by llama.cpp's own quantizer to `ftype` at `path` (re-quantizing allowed)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = ftype, True
    if llama_cpp.llama_model_quantize(source.encode(), path.encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {source}")
    return path


def made_once(path: str, make, *args) -> str:
    """`path`, made by `make(*args, a path beside it)` and moved into place the first time only."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = partial_path(path)
        try:
            make(*args, partial)
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    return path


def quantize_elsewhere(source: str, kind: str, path: str) -> None:
    """`source` quantized to `kind` (FTYPES) at `path` in a child process of its own, where llama.cpp's native code
    runs."""
    isolated.Child("llama.cpp", quantize, source, path, FTYPES[kind]).close()


def quantized(source: str, path: str, kind: str) -> str:
    """`source` at `kind` at `path`, quantized once by llama.cpp's quantizer."""
    return made_once(path, quantize_elsewhere, source, kind)


def gguf_file(folder: str, kind: str, cache_dir: str) -> str:
    """A Qwen3.5 checkpoint folder as GGUF at `kind`: BF16 by llama.cpp's converter, another kind by its quantizer
    from that; each made once and kept under cache_dir/gguf/qwen35/<folder_key>/."""
    where = os.path.join(cache_dir, "gguf", "qwen35", folder_key(folder))
    base = made_once(os.path.join(where, f"model.{CONVERTED.upper()}.gguf"), convert, folder, cache_dir)
    return base if kind == CONVERTED else quantized(base, os.path.join(where, f"model.{kind.upper()}.gguf"), kind)
