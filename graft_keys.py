"""The graft of a Qwen3.5 text checkpoint onto its base's vision-language model: weight names, checks and the copy.

A text fine-tune (Qwen3_5ForCausalLM) keeps its decoder under `model.`; the vision-language model
(Qwen3_5ForConditionalGeneration) keeps the same decoder under `model.language_model.` beside its vision tower
`model.visual.`, and the output head `lm_head.weight` has the same name in both. Every name a dense Qwen3.5 text
model holds is listed below; anything else (an MoE expert, an MTP head, a vision weight, a typo) is refused, so a
graft never guesses where a weight belongs. The vision base is checked against the text checkpoint (config fields,
special-token ids) before the weights are copied; every refusal is a ValueError naming what differs.
"""

from __future__ import annotations

import re

TEXT_PREFIX = "model."
VISION_PREFIX = "model.language_model."
HEAD = "lm_head.weight"
TOP_LEVEL = frozenset({"embed_tokens.weight", "norm.weight"})
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")  # carry a bias when the config sets attention_bias
LAYER_WEIGHTS = frozenset(
    {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "linear_attn.in_proj_qkv.weight",
        "linear_attn.in_proj_z.weight",
        "linear_attn.in_proj_b.weight",
        "linear_attn.in_proj_a.weight",
        "linear_attn.conv1d.weight",
        "linear_attn.dt_bias",
        "linear_attn.A_log",
        "linear_attn.norm.weight",
        "linear_attn.out_proj.weight",
        *(f"self_attn.{p}.{kind}" for p in _PROJECTIONS for kind in ("weight", "bias")),
    }
)
_LAYER = re.compile(r"layers\.(?:0|[1-9][0-9]*)\.(.+)")


def text_to_parent(name: str) -> str:
    """The vision-language model's name for one text-checkpoint weight; ValueError for a name not known here."""
    if name == HEAD:
        return name
    if name.startswith(TEXT_PREFIX):
        rest = name[len(TEXT_PREFIX) :]
        layer = _LAYER.fullmatch(rest)
        if rest in TOP_LEVEL or (layer is not None and layer.group(1) in LAYER_WEIGHTS):
            return VISION_PREFIX + rest
    raise ValueError(f"graft_keys does not know the text weight {name!r}")


# ---- the graft: a vision base checked against the text checkpoint, then the text weights copied onto it -------

VISION_TOKENS = (
    ("<|image_pad|>", "image_token_id"),
    ("<|vision_start|>", "vision_start_token_id"),
    ("<|vision_end|>", "vision_end_token_id"),
)
GRAFT_CONFIG_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "layer_types",
)


def check_graft_config(text_config, base_config) -> None:
    """Refuse a vision base whose language model is not the text checkpoint's architecture."""
    base_text = getattr(base_config, "text_config", None)
    for name in GRAFT_CONFIG_FIELDS:
        value = getattr(text_config, name, None)
        if value is None or value != getattr(base_text, name, None):
            raise ValueError(f"incompatible vision tower: text {name} differs from the checkpoint")
    if getattr(base_config.vision_config, "out_hidden_size", None) != text_config.hidden_size:
        raise ValueError("incompatible vision tower: visual output does not match text hidden size")


def check_vision_tokens(config, vocab_size: int, tokenizers: list) -> None:
    """The vision model's special-token ids are in the vocabulary and every tokenizer maps its tokens to them."""
    for token, name in VISION_TOKENS:
        expected = getattr(config, name, None)
        if (
            not isinstance(expected, int)
            or not 0 <= expected < vocab_size
            or any(tok.convert_tokens_to_ids(token) != expected for tok in tokenizers)
        ):
            raise ValueError(f"incompatible vision tower: {name} differs from the text tokenizer")


def graft_text_weights(vision_model, text_model) -> int:
    """Copy every text-checkpoint weight onto its name in the vision model (text_to_parent), refusing an
    unknown, unplaceable, duplicated or mis-shaped weight and a language weight left unfilled. Returns the count."""
    target = vision_model.state_dict()
    copied = {}
    for name, value in text_model.state_dict().items():
        try:
            dest = text_to_parent(name)
        except ValueError as exc:
            raise ValueError(f"incompatible text checkpoint: {exc}") from None
        if dest not in target or dest in copied:
            raise ValueError(f"text weight {name!r} cannot be grafted onto the vision model")
        if target[dest].shape != value.shape:
            raise ValueError(
                f"text weight {name!r} has shape {tuple(value.shape)}, the vision model's {dest!r} "
                f"has {tuple(target[dest].shape)}"
            )
        copied[dest] = value
    missing, unexpected = vision_model.load_state_dict(copied, strict=False)
    unfilled = [name for name in missing if name.startswith("model.language_model.") or name == "lm_head.weight"]
    if unexpected or unfilled:
        raise ValueError(
            f"incomplete text graft: {len(unfilled)} missing language weights, {len(unexpected)} unexpected weights"
        )
    return len(copied)
