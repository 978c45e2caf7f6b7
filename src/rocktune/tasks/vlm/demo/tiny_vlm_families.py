"""Tiny random-init Gemma 3 and SmolVLM / Idefics3 models, built offline as HF model directories (the Qwen families
are tasks/vlm/demo/tiny_vlm.py's): a few layers of language model, one vision block, the demo's byte-level tokenizer
with the family's image tokens and a chat template in its style, and transformers' own image processor of the family
(``Gemma3ImageProcessor``; ``SmolVLMImageProcessor`` / ``Idefics3ImageProcessor``, which split an image into tiles).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rocktune.demo.tiny import EOS_ID, SPECIALS, build_tokenizer
from rocktune.tasks.vlm.vision import table


@dataclass(frozen=True)
class SiglipTiny:
    """A SigLIP-tower family's tiny model: its style ("gemma": Gemma 3's tokens, template and pooled projector;
    "tiles": Idefics3/SmolVLM's tiles) and transformers' image processor class. The config class is transformers'
    for the family's model_type, the model class its tasks/vlm/vision/table.py entry's."""
    style: str
    image_processor: str


# keyed by model_type as tasks/vlm/vision/table.py's entries (the Qwen-style ones are tasks/vlm/demo/tiny_vlm.py's
# FAMILIES)
TINY: dict[str, SiglipTiny] = {"gemma3": SiglipTiny("gemma", "Gemma3ImageProcessor"),
                               "smolvlm": SiglipTiny("tiles", "SmolVLMImageProcessor"),
                               "idefics3": SiglipTiny("tiles", "Idefics3ImageProcessor")}

GEMMA_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
TILE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]

# Gemma's turns (<start_of_turn>role ... <end_of_turn>, the assistant named "model"); an image part is
# <start_of_image>, which the processor widens to the image's soft tokens
GEMMA_TEMPLATE = (
    "{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# SmolVLM's style: "User:<image> question<end_of_utterance>\nAssistant: answer<end_of_utterance>\n"
TILE_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %} {{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %} {{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def build_family_tokenizer(family: str):
    """The demo's byte-level tokenizer with ``family``'s image tokens (Gemma 3's also named as its tokenizer names
    them: ``boi_token``, ``eoi_token``, ``image_token``) and a chat template in its style."""
    from transformers import PreTrainedTokenizerFast

    base = build_tokenizer()
    gemma = TINY[family].style == "gemma"
    added = ["<start_of_turn>", "<end_of_turn>", *GEMMA_TOKENS.values()] if gemma else TILE_TOKENS
    base.add_special_tokens({"additional_special_tokens": SPECIALS[1:] + added})
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token=SPECIALS[0],
                                  pad_token=SPECIALS[0], extra_special_tokens=GEMMA_TOKENS if gemma else None,
                                  chat_template=GEMMA_TEMPLATE if gemma else TILE_TEMPLATE)
    # after the named ones: a list given with them at construction would be replaced by them
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[1:] + added}, replace_extra_special_tokens=False)
    return tok


def _text_config(hidden: int, layers: int) -> dict:
    head_dim = 16
    return {"vocab_size": 320, "hidden_size": hidden, "intermediate_size": hidden * 2, "num_hidden_layers": layers,
            "num_attention_heads": hidden // head_dim, "num_key_value_heads": hidden // head_dim // 2 or 1,
            "head_dim": head_dim, "max_position_embeddings": 4096, "initializer_range": 0.1,
            "eos_token_id": EOS_ID, "bos_token_id": None, "pad_token_id": None, "tie_word_embeddings": True}


def tiny_family_config(tokenizer, family: str, hidden: int = 128, layers: int = 2, vision_hidden: int = 32,
                       vision_depth: int = 1):
    """32x32-pixel views in 8-pixel patches: Gemma 3 pools the 4x4 patches to 4 soft tokens an image; Idefics3 and
    SmolVLM shuffle them (scale_factor 2) to 4 tokens a tile."""
    import transformers

    ids = tokenizer.convert_tokens_to_ids
    vision = {"hidden_size": vision_hidden, "intermediate_size": vision_hidden * 2, "num_hidden_layers": vision_depth,
              "num_attention_heads": 2, "image_size": 32, "patch_size": 8}
    text = _text_config(hidden, layers)
    if TINY[family].style == "gemma":
        vision["vision_use_head"] = False  # as Gemma 3's checkpoints: the projector pools the patches itself
        text.update({"sliding_window": 512, "query_pre_attn_scalar": 16,
                     "layer_types": (["sliding_attention", "full_attention"] * layers)[:layers]})
        return transformers.AutoConfig.for_model(family, text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                 boi_token_index=ids(GEMMA_TOKENS["boi_token"]),
                                                 eoi_token_index=ids(GEMMA_TOKENS["eoi_token"]),
                                                 image_token_index=ids(GEMMA_TOKENS["image_token"]),
                                                 tie_word_embeddings=True)
    return transformers.AutoConfig.for_model(family, text_config={**text, "model_type": "llama"}, vision_config=vision,
                                             scale_factor=2, image_token_id=ids("<image>"), tie_word_embeddings=True)


def build_family_image_processor(family: str):
    """The family's own image processor (Pillow backend without torchvision): Gemma 3's resizes to 32x32; the
    tiling ones make 32-pixel tiles of an image resized to at most 64 pixels a side, plus its global view."""
    import transformers

    cls = getattr(transformers, TINY[family].image_processor)
    if TINY[family].style == "gemma":
        return cls(size={"height": 32, "width": 32})
    return cls(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True)


def build_family_vlm(out: Path, seed: int, family: str, **shape) -> Path:
    import torch
    import transformers

    from rocktune.tasks.vlm.vision.model import save_processor_settings

    tokenizer = build_family_tokenizer(family)
    torch.manual_seed(seed)
    model_cls = getattr(transformers, table.FAMILIES[family].model_class)
    model = model_cls._from_config(tiny_family_config(tokenizer, family, **shape), dtype=torch.float32)
    if TINY[family].style == "gemma":  # its init zeroes the projection (a blind model); a checkpoint's is trained
        weight = model.model.multi_modal_projector.mm_input_projection_weight
        with torch.no_grad():
            weight.normal_(0.0, weight.shape[0] ** -0.5)  # unit-scale features from the normed vision outputs
    model.save_pretrained(out, safe_serialization=True)
    build_family_image_processor(family).save_pretrained(out)
    save_processor_settings(model.config, out)  # as a hub checkpoint's: AutoProcessor widens as the model expects
    tokenizer.save_pretrained(out)
    return out
