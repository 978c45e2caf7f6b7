"""Build a tiny random-init Qwen2.5-VL (or Qwen3-VL, Qwen2-VL; Gemma 3, SmolVLM and Idefics3 through
tasks/vlm/demo/tiny_vlm_families.py) and its processor offline, saved as an HF model directory.

The language model is a few layers wide and deep, the vision tower one block; the tokenizer is the demo's byte-level
one (``demo/tiny.py``) with Qwen's vision special tokens added, and the processor is transformers' own
``Qwen2_5_VLProcessor`` around a real ``Qwen2VLImageProcessor``. The directory loads through
``Qwen2_5_VLForConditionalGeneration`` / ``AutoProcessor`` like a hub checkpoint, so tests exercise the loading a
real run does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rocktune.demo.tiny import EOS_ID, SPECIALS, build_tokenizer
from rocktune.tasks.vlm.vision import table

VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# A ChatML template for content parts: an image part renders as Qwen's vision start, one image pad (which the
# processor widens to the image's token count) and vision end; a plain string content renders as text.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_vl_tokenizer():
    """The demo's byte-level tokenizer with Qwen's vision specials (ids 259-262) and the content-part template."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[1:] + VISION_SPECIALS})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _token_ids(tokenizer) -> dict[str, int]:
    return {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
            (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
             ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}


@dataclass(frozen=True)
class QwenTiny:
    """A Qwen-style family's tiny model: the vision config's family keys, the mrope keys, the patch size, and the
    language model's own keys (Qwen3.5's Gated DeltaNet layers). The config class is transformers' for the family's
    model_type, the model class its tasks/vlm/vision/table.py entry's."""
    vision: dict
    rope: dict
    patch: int
    text: dict = field(default_factory=dict)
    layer_kinds: tuple[str, ...] = ()  # the language model's layer_types, repeated to its depth (empty: all attention)


# Qwen3.5's language model: one Gated DeltaNet layer, then one full-attention layer (gated, q/k norms), rotating half
# of each 16-wide head (4 pairs) in interleaved sections that cover every pair as llama.cpp's imrope does (time gets
# pairs 0 and 3, height 1, width 2); the released [11, 11, 10] cover 32 pairs the same way
QWEN35_TEXT = {"linear_conv_kernel_dim": 4,
               "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
               "linear_num_value_heads": 4}
QWEN35_ROPE = {"mrope_interleaved": True, "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5}
# Qwen3.5-MoE: the same, with 4 routed experts (2 a token) and a shared one in every layer's MLP; expert widths of 64
# as the text families' fixture has them
QWEN35_MOE_TEXT = {**QWEN35_TEXT, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "shared_expert_intermediate_size": 64}
HYBRID = ("linear_attention", "full_attention")


# the Qwen-style families' tiny models, keyed by model_type as tasks/vlm/vision/table.py's entries (the others' are
# tasks/vlm/demo/tiny_vlm_families.py's TINY); the language model's mrope splits half the head dimension (8 of 16) into
# temporal, height and width sections
FAMILIES: dict[str, QwenTiny] = {
    "qwen2_5_vl": QwenTiny({"window_size": 56, "fullatt_block_indexes": [0]}, {}, 14),
    "qwen3_vl": QwenTiny({"num_position_embeddings": 64, "deepstack_visual_indexes": [0]}, {"mrope_interleaved": True},
                         16),
    "qwen2_vl": QwenTiny({"embed_dim": 32, "mlp_ratio": 2}, {}, 14),
    "qwen3_5": QwenTiny({"num_position_embeddings": 64}, QWEN35_ROPE, 16, QWEN35_TEXT, HYBRID),
    "qwen3_5_moe": QwenTiny({"num_position_embeddings": 64}, QWEN35_ROPE, 16, QWEN35_MOE_TEXT, HYBRID),
}


def tiny_vl_config(tokenizer, family: str = "qwen2_5_vl", hidden: int = 128, layers: int = 2, vision_hidden: int = 32,
                   vision_depth: int = 1, vision: dict | None = None, rope: dict | None = None):
    import transformers

    tiny = FAMILIES[family]
    vision_keys, rope_keys, patch = tiny.vision, tiny.rope, tiny.patch
    head_dim = 16
    text: dict[str, Any] = {
        "vocab_size": 320, "hidden_size": hidden, "intermediate_size": hidden * 2, "num_hidden_layers": layers,
        "num_attention_heads": hidden // head_dim, "num_key_value_heads": hidden // head_dim // 2 or 1,
        "head_dim": head_dim, "max_position_embeddings": 4096, "initializer_range": 0.1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                            **rope_keys, **(rope or {})},
        "eos_token_id": EOS_ID, "bos_token_id": None, "pad_token_id": None, "tie_word_embeddings": True, **tiny.text}
    if tiny.layer_kinds:
        text["layer_types"] = [tiny.layer_kinds[i % len(tiny.layer_kinds)] for i in range(layers)]
    if int(transformers.__version__.split(".")[0]) < 5:  # transformers 4.x (torch 2.4/2.5 stacks) reads rope_scaling
        text["rope_scaling"] = {"type": "mrope", **text["rope_parameters"]}
        text["rope_theta"] = text["rope_parameters"]["rope_theta"]
    overrides = vision or {}  # e.g. Qwen2.5-VL's window attention: {"fullatt_block_indexes": [1], "window_size": 112}
    vision = {"depth": vision_depth, "hidden_size": vision_hidden, "intermediate_size": vision_hidden * 2,
              "num_heads": 2, "out_hidden_size": hidden, "patch_size": patch, "spatial_merge_size": 2,
              "temporal_patch_size": 2, **vision_keys, **overrides}
    if "embed_dim" in vision_keys:  # Qwen2-VL names the tower's width embed_dim, and hidden_size is its output's
        vision["hidden_size"] = hidden
    return transformers.AutoConfig.for_model(family, text_config=text, vision_config=vision, tie_word_embeddings=True,
                                             **_token_ids(tokenizer))


def build_image_processor(patch: int = 14, min_tokens: int = 4, max_tokens: int = 16):
    """Qwen's own image processor (its Pillow backend where torchvision is absent), saved as a hub model's
    ``preprocessor_config.json`` is: ``patch``-pixel patches merged 2 x 2 into one token, 4 to 16 tokens an image."""
    from transformers import Qwen2VLImageProcessor

    side = patch * 2
    return Qwen2VLImageProcessor(min_pixels=side * side * min_tokens, max_pixels=side * side * max_tokens,
                                 patch_size=patch, merge_size=2, temporal_patch_size=2)


def build_tiny_vlm(out_dir: str | Path, seed: int = 0, family: str = "qwen2_5_vl", max_image_tokens: int = 16,
                   **shape) -> Path:
    """Write a random-init tiny vision-language model of ``family`` (a model_type of tasks/vlm/vision/table.py), its
    tokenizer and its image processor (Qwen's: at most ``max_image_tokens`` an image) to ``out_dir`` and return the
    path."""
    import torch
    import transformers

    from rocktune.models.load import quiet_transformers

    quiet_transformers()
    out = Path(out_dir)
    if family not in FAMILIES:
        from rocktune.tasks.vlm.demo.tiny_vlm_families import build_family_vlm

        return build_family_vlm(out, seed, family, **shape)
    tokenizer = build_vl_tokenizer()
    torch.manual_seed(seed)
    model_cls = getattr(transformers, table.FAMILIES[family].model_class)
    model = model_cls._from_config(tiny_vl_config(tokenizer, family, **shape), dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    build_image_processor(FAMILIES[family].patch, max_tokens=max_image_tokens).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
