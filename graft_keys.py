"""Weight names of a Qwen3.5 text checkpoint and their names in the Qwen3.5 vision-language model.

A text fine-tune (Qwen3_5ForCausalLM) keeps its decoder under `model.`; the vision-language model
(Qwen3_5ForConditionalGeneration) keeps the same decoder under `model.language_model.` beside its vision tower
`model.visual.`, and the output head `lm_head.weight` has the same name in both. Every name a dense Qwen3.5 text
model holds is listed below; anything else (an MoE expert, an MTP head, a vision weight, a typo) is refused, so a
graft never guesses where a weight belongs.
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
        rest = name[len(TEXT_PREFIX):]
        layer = _LAYER.fullmatch(rest)
        if rest in TOP_LEVEL or (layer is not None and layer.group(1) in LAYER_WEIGHTS):
            return VISION_PREFIX + rest
    raise ValueError(f"graft_keys does not know the text weight {name!r}")
