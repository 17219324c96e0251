"""Tiny random-weight Qwen3.5 models for offline tests.

Everything here is built from scratch (no model hub) and saved to a folder so the
real ``from_pretrained`` code paths load it:

* ``build_tokenizer()`` -> ``Qwen3_5Tokenizer`` (byte-level BPE, Qwen split regex,
  ChatML chat template).  Every label ``A..Z`` and ``AA..ZZ`` is one token, so
  ``prompt + label`` tokenizes to ``prompt ids + [label id]``.
* ``build_qwen35_text(folder)`` -> ``Qwen3_5ForCausalLM`` (``qwen3_5_text``),
  layers ``[linear, full, linear, full]``.  Reload with
  ``AutoModelForCausalLM.from_pretrained(folder)`` and
  ``AutoTokenizer.from_pretrained(folder)``.
* ``build_qwen35_vision(folder)`` -> ``Qwen3_5ForConditionalGeneration``
  (``qwen3_5``).  Reload with ``AutoModelForImageTextToText.from_pretrained``,
  ``AutoTokenizer`` and ``AutoImageProcessor`` (resolves to
  ``Qwen2VLImageProcessorPil``; ``AutoProcessor`` / ``Qwen3VLProcessor`` need
  torchvision, which is not installed).

Running a prompt with images (what ``run_image_prompt`` does):

1. Render the chat template; each image part becomes
   ``<|vision_start|><|image_pad|><|vision_end|>`` (one pad per image).
2. ``image_processor(images=..., return_tensors="pt")`` gives ``pixel_values``
   (num_patches, 3 * temporal_patch * patch * patch) and ``image_grid_thw``
   (num_images, 3), in patches.
3. Expand the i-th ``<|image_pad|>`` to ``grid_thw[i].prod() // merge_size**2``
   pads (``expand_image_pads``), then tokenize.
4. ``mm_token_type_ids`` = 1 where ``input_ids == image_token_id`` (0 elsewhere,
   including the vision start/end tokens; 2 would mark video pads).
5. ``model(input_ids=..., attention_mask=..., pixel_values=..., image_grid_thw=...,
   mm_token_type_ids=...)``.  Without ``mm_token_type_ids`` the forward raises
   ``ValueError`` whenever ``image_grid_thw`` is given (M-RoPE positions).

``Qwen3_5Model.rope_deltas`` (``model.model.rope_deltas``) persists between calls:
it is recomputed only when a call carries image inputs with ``mm_token_type_ids``
and the cache is empty (or rope_deltas is None); a later call with a non-empty cache
(or with only ``inputs_embeds``) reuses the stored value, even for text-only input.
Reset it to ``None`` before an unrelated prompt.

Caches (``use_cache=True``; forward takes ``cache=`` and returns ``.cache``): a
``DynamicCache`` whose ``layers[i]`` is a ``DynamicLayer`` (``keys``/``values`` of
shape (batch, kv_heads, seq, head_dim)) for full-attention layers and a
``LinearAttentionLayer`` for linear-attention layers, holding dicts keyed by state
index 0: ``conv_states[0]`` (batch, conv_dim, conv_kernel) and
``recurrent_states[0]`` (batch, linear_v_heads, key_head_dim, value_head_dim).

Weight-name mapping from the text checkpoint to the vision model:
``model.X`` -> ``model.language_model.X``; ``lm_head.weight`` unchanged
(``graft_reference`` checks this gives identical text logits).
"""

from __future__ import annotations

import json
import random
import string
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import (
    Qwen2VLImageProcessorPil,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
    Qwen3_5Tokenizer,
)
from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

LETTERS: list[str] = list(string.ascii_uppercase)
LABELS: list[str] = LETTERS + [a + b for a in LETTERS for b in LETTERS]
SPECIAL_TOKENS: list[str] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
THINK_TOKENS: list[str] = ["<think>", "</think>"]
NAMED_SPECIAL_TOKENS: dict[str, str] = {  # as in Qwen3.5's tokenizer_config.json (tokenizer.image_token_id etc.)
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
}
HIDDEN_SIZE = 64
PATCH_SIZE = 16
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
MIN_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2 * 4  # 4096: at least 2x2 merged tokens
MAX_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2 * 64  # 65536: at most 64 merged tokens

CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'text' -%}{{ part.text }}"
    "{%- elif part.type == 'image' or part.type == 'image_url' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part.type == 'video' -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message.role + '\\n' }}{{ render(message.content) }}{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else -%}{{ '<think>\\n' }}{%- endif -%}"
    "{%- endif -%}"
)

WORDS = (
    "the a an of and to in is you that it for on with as are this be at or have from by not but what all "
    "were when we there can your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who now "
    "people my made over did down only way find use may water long little very after words called just where "
    "most know answer label choose option question image picture describe best correct letter reply classify "
    "system user assistant think json true false null value name type text input output select one following"
).split()


def _corpus(seed: int = 0) -> list[str]:
    """Generate a small English-ish / JSON / digits / chat-markup training corpus."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(400):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ":", ","]))
    for _ in range(150):
        obj = {
            rng.choice(WORDS): rng.choice([rng.randint(0, 9999), rng.choice(LABELS), rng.choice(WORDS), True, None])
            for _ in range(rng.randint(1, 4))
        }
        lines.append(json.dumps(obj) + "\n")
    lines += [" ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(8)) for _ in range(50)]
    lines += ["<|im_start|>system\nYou are a classifier.<|im_end|>\n<|im_start|>user\n", "<think>\n\n</think>\n\n"] * 20
    lines += [" ".join(LETTERS), " ".join(LABELS[26:])]
    return lines


def _train_bpe(lines: list[str], vocab_size: int = 900) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a Qwen-pre-tokenized byte-level BPE; return its vocab and merges."""
    tok = Tokenizer(BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(lines, trainer)
    model = json.loads(tok.to_str())["model"]
    return dict(model["vocab"]), [tuple(m) for m in model["merges"]]


def _force_merges(vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
    """Add vocab entries and merges so each two-letter label (and "\\n\\n") is one token."""
    have = set(merges)
    for word in LABELS[26:] + ["\u010a\u010a"]:  # byte-level "\n\n" is "ĊĊ"
        pair = (word[0], word[1])
        if pair not in have:
            merges.append(pair)
            have.add(pair)
        if word not in vocab:
            vocab[word] = len(vocab)


def build_tokenizer() -> Qwen3_5Tokenizer:
    """Build the tiny Qwen3.5 tokenizer (deterministic, well under a second)."""
    vocab, merges = _train_bpe(_corpus())
    _force_merges(vocab, merges)
    for token in SPECIAL_TOKENS + THINK_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen3_5Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=NAMED_SPECIAL_TOKENS,
        model_max_length=4096,
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.add_tokens([AddedToken("<|im_start|>", special=True, normalized=False)], special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tokenizer


def text_config(tokenizer: Qwen3_5Tokenizer) -> Qwen3_5TextConfig:
    """The tiny Qwen3.5 text config: hidden 64, layers [linear, full, linear, full]."""
    return Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=4096,
        initializer_range=0.2,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,  # rotary dim 8 -> 4 frequencies
            "mrope_section": [2, 1, 1],  # sums to the 4 frequencies
            "mrope_interleaved": True,
        },
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )


def vision_config() -> dict:
    """The tiny Qwen3.5 vision tower config (2 blocks, hidden 32, out 64)."""
    return {
        "model_type": "qwen3_5_vision",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "out_hidden_size": HIDDEN_SIZE,
        "num_position_embeddings": 64,  # must be a square (8 x 8 learned grid)
        "initializer_range": 0.2,
    }


def build_image_processor() -> Qwen2VLImageProcessorPil:
    """PIL Qwen2-VL image processor matching the tiny vision tower."""
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        merge_size=MERGE_SIZE,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def build_qwen35_text(folder: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> str:
    """Save a seeded random tiny Qwen3_5ForCausalLM plus tokenizer to folder; return folder."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(text_config(tokenizer)).to(dtype).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def build_qwen35_vision(folder: str | Path, seed: int = 0, text_folder: str | Path | None = None) -> str:
    """Save a seeded random tiny Qwen3_5ForConditionalGeneration, tokenizer and image processor."""
    tokenizer = build_tokenizer()
    text_cfg = Qwen3_5TextConfig.from_pretrained(text_folder) if text_folder else text_config(tokenizer)
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3_5Config(
        text_config=text_cfg.to_dict(),
        vision_config=vision_config(),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config).to(text_cfg.dtype or torch.float32).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    build_image_processor().save_pretrained(folder)
    return str(folder)


def expand_image_pads(text: str, grids: torch.Tensor, merge_size: int, pad: str = "<|image_pad|>") -> str:
    """Replace the i-th pad in text by grids[i].prod() // merge_size**2 pads."""
    pieces = text.split(pad)
    if len(pieces) - 1 != len(grids):
        raise ValueError(f"{len(pieces) - 1} {pad} in text but {len(grids)} images")
    out = pieces[0]
    for grid, piece in zip(grids, pieces[1:]):
        out += pad * (int(torch.as_tensor(grid).prod()) // merge_size**2) + piece
    return out


def run_image_prompt(
    model: Qwen3_5ForConditionalGeneration,
    tokenizer: Qwen3_5Tokenizer,
    image_processor: Qwen2VLImageProcessorPil,
    prompt_text_with_pads: str,
    images: list[Image.Image],
) -> torch.Tensor:
    """Reference path: last-position logits (vocab,) for a prompt with one <|image_pad|> per image."""
    vision = image_processor(images=images, return_tensors="pt")
    grids = vision["image_grid_thw"]
    text = expand_image_pads(prompt_text_with_pads, grids, image_processor.merge_size)
    enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    input_ids = enc["input_ids"]
    mm_token_type_ids = (input_ids == model.config.image_token_id).to(torch.int32)
    model.model.rope_deltas = None
    with torch.no_grad():
        out = model(
            input_ids=input_ids,
            attention_mask=enc["attention_mask"],
            pixel_values=vision["pixel_values"],
            image_grid_thw=grids,
            mm_token_type_ids=mm_token_type_ids,
            use_cache=False,
        )
    return out.logits[0, -1]


def map_text_key(key: str) -> str:
    """Map a Qwen3_5ForCausalLM state-dict key to its Qwen3_5ForConditionalGeneration key."""
    return "model.language_model." + key[len("model.") :] if key.startswith("model.") else key


def graft_reference(
    text_model: Qwen3_5ForCausalLM, vision_model: Qwen3_5ForConditionalGeneration, input_ids: torch.Tensor | None = None
) -> float:
    """Test reference only: load text weights into vision_model (mapped keys); return max text-logit diff."""
    state = {map_text_key(k): v for k, v in text_model.state_dict().items()}
    result = vision_model.load_state_dict(state, strict=False)
    if result.unexpected_keys or any(not k.startswith("model.visual.") for k in result.missing_keys):
        raise AssertionError(f"bad key mapping: {result}")
    if input_ids is None:
        input_ids = torch.arange(3, 40).unsqueeze(0)
    vision_model.model.rope_deltas = None
    with torch.no_grad():
        a = text_model(input_ids=input_ids).logits
        b = vision_model(input_ids=input_ids).logits
    return float((a - b).abs().max())


def describe_cache(cache: object) -> list[str]:
    """One line per cache layer: class, and tensor shapes it holds."""
    lines = [type(cache).__name__]
    for i, layer in enumerate(getattr(cache, "layers", [])):
        parts = []
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor):
                parts.append(f"{name}={tuple(value.shape)}")
            elif isinstance(value, dict):
                inner = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v for k, v in value.items()}
                parts.append(f"{name}={inner}")
            elif isinstance(value, (int, bool, str)) or value is None:
                parts.append(f"{name}={value}")
        lines.append(f"  [{i}] {type(layer).__name__}: " + ", ".join(parts))
    return lines


def build_letterless_tokenizer(folder: str | Path) -> str:
    """A word-level tokenizer with no uppercase letters at all, saved to a folder: none of blink's labels verify."""
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate('<>|_ abcdefghijklmnopqrstuvwxyz\n{}":,.')}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="_"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="_")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(folder)
    return str(folder)


def check_labels(tokenizer: Qwen3_5Tokenizer, prompt: str | None = None) -> str:
    """Assert prompt+label tokenizes to prompt ids + one token decoding to label, for all 702 labels."""
    if prompt is None:
        messages = [
            {"role": "system", "content": "You are a classifier. Answer with one label."},
            {"role": "user", "content": [{"type": "text", "text": "Which option is best? A, B or AB."}]},
        ]
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), prompt
    base = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    for label in LABELS:
        ids = tokenizer(prompt + label, add_special_tokens=False)["input_ids"]
        assert ids[:-1] == base and len(ids) == len(base) + 1, label
        assert tokenizer.decode(ids[-1:]) == label, label
    return prompt


def _self_check() -> None:
    """Build both models into a temp dir, reload via Auto classes and run prompts end to end."""
    from transformers import AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    t = time.perf_counter()

    def lap(msg: str) -> None:
        nonlocal t
        now = time.perf_counter()
        print(f"{now - t:7.3f}s  {msg}")
        t = now

    with tempfile.TemporaryDirectory() as tmp:
        text_dir, vision_dir = f"{tmp}/text", f"{tmp}/vision"
        build_qwen35_text(text_dir)
        lap("built text model")
        build_qwen35_vision(vision_dir, text_folder=text_dir)
        lap("built vision model")
        for d in (text_dir, vision_dir):
            size = sum(p.stat().st_size for p in Path(d).iterdir())
            print(f"         {d}: {size / 1e6:.2f} MB: {sorted(p.name for p in Path(d).iterdir())}")

        tokenizer = AutoTokenizer.from_pretrained(text_dir)
        text_model = AutoModelForCausalLM.from_pretrained(text_dir).eval()
        lap(f"reloaded text: {type(tokenizer).__name__}, {type(text_model).__name__}, vocab {len(tokenizer)}")
        prompt = check_labels(tokenizer)
        lap(f"702 labels are single tokens (prompt {len(tokenizer(prompt)['input_ids'])} tokens)")

        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = text_model(input_ids=ids, use_cache=True)
        label_ids = tokenizer.convert_tokens_to_ids(LABELS[:4])
        print("         text label logits A..D:", [round(x, 3) for x in out.logits[0, -1, label_ids].tolist()])
        print("\n".join("         " + line for line in describe_cache(out.cache)))
        lap("text prompt forward")

        vision_model = AutoModelForImageTextToText.from_pretrained(vision_dir).eval()
        vtok = AutoTokenizer.from_pretrained(vision_dir)
        processor = AutoImageProcessor.from_pretrained(vision_dir)
        lap(f"reloaded vision: {type(vision_model).__name__}, {type(vtok).__name__}, {type(processor).__name__}")

        diff = graft_reference(text_model, vision_model, ids)
        assert diff == 0.0, diff
        lap(f"graft_reference text-logit max diff {diff}")

        image = Image.new("RGB", (96, 64))
        image.putdata([((x * 3) % 256, (y * 4) % 256, (x * y) % 256) for y in range(64) for x in range(96)])
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which label fits? A or B."}]}
        ]
        image_prompt = vtok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        logits = run_image_prompt(vision_model, vtok, processor, image_prompt, [image])
        grid = processor(images=[image], return_tensors="pt")["image_grid_thw"]
        check_labels(vtok, expand_image_pads(image_prompt, grid, processor.merge_size))
        print(f"         image grid_thw {grid.tolist()}, rope_deltas {vision_model.model.rope_deltas.tolist()}")
        print("         image label logits A..D:", [round(x, 3) for x in logits[label_ids].tolist()])
        lap("image prompt forward")


if __name__ == "__main__":
    _self_check()
