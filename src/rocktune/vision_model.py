"""Vision-language models: the supported families, their processor parts and LoRA targets, loaded from a model
directory the way a hub checkpoint is (used by task=vlm and by ``rocktune generate --image``).

Supported families are listed in ``FAMILIES`` (transformers' model_type -> class name); another model_type is refused
with the list, never trained half-understood. The processor is taken as its parts: the tokenizer (with its chat
template) and the image processor, with ``data.min_pixels``/``data.max_pixels`` applied. (transformers' combined
processor class also builds a video processor, which needs torchvision; images need only the image processor.)
"""

from __future__ import annotations

import re

import torch

from rocktune.data.vision import VisionTokens
from rocktune.errors import UserError, first_line
from rocktune.model import DTYPES, check_model_source

FAMILIES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration",
            "qwen2_vl": "Qwen2VLForConditionalGeneration"}
VISION_PREFIX = "visual"  # the vision tower and its projector (visual.merger) in Qwen2.5-VL's module tree


def model_type(name_or_path: str) -> str:
    """The checkpoint's model_type, refused unless it is a supported family."""
    from transformers import AutoConfig

    check_model_source(name_or_path)
    try:
        kind = AutoConfig.from_pretrained(name_or_path).model_type
    except (OSError, ValueError) as exc:
        raise UserError(f"could not read the config of model {name_or_path}: {first_line(exc)} (offline? pass a "
                        "local model directory)") from None
    if kind not in FAMILIES:
        raise UserError(f"task=vlm supports {', '.join(FAMILIES)} (Qwen2.5-VL, Qwen3-VL, Qwen2-VL) so far; "
                        f"{name_or_path} is a {kind!r} model (docs/vision.md lists what is planned).")
    import transformers

    if not hasattr(transformers, FAMILIES[kind]):
        raise UserError(f"{name_or_path} is a {kind} model, which transformers {transformers.__version__} does not "
                        f"know ({FAMILIES[kind]}); upgrade transformers.")
    return kind


def model_class(config):
    """transformers' class for a supported vision-language config, None for any other model."""
    import transformers

    name = FAMILIES.get(getattr(config, "model_type", None))
    return getattr(transformers, name, None) if name else None


def vision_tokens(name_or_path: str, config, min_pixels: int | None, max_pixels: int | None) -> VisionTokens:
    from transformers import AutoImageProcessor

    limits = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
    try:
        images = AutoImageProcessor.from_pretrained(name_or_path, **limits)
    except (OSError, ValueError) as exc:
        raise UserError(f"the image processor of {name_or_path} does not load ({first_line(exc)}); the model "
                        "directory needs its preprocessor_config.json.") from None
    masked = frozenset(getattr(config, k) for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id"))
    return VisionTokens(images, config.image_token_id, masked, images.merge_size)


def with_processor_template(tokenizer, name_or_path: str):
    """The tokenizer with a chat template: its own, else the processor's (``chat_template.json`` or
    ``chat_template.jinja`` of a local model directory, where vision-language checkpoints keep it)."""
    from pathlib import Path

    from rocktune.readers.json_file import read_json

    folder = Path(name_or_path)
    if getattr(tokenizer, "chat_template", None) or not folder.is_dir():
        return tokenizer
    if (folder / "chat_template.json").is_file():
        template = read_json(folder / "chat_template.json", "download the model again.").get("chat_template")
        tokenizer.chat_template = template if isinstance(template, str) else None
    elif (folder / "chat_template.jinja").is_file():
        tokenizer.chat_template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return tokenizer


def load_vlm(name_or_path: str, precision: str, attn_implementation: str, device: str):
    from transformers import AutoConfig

    model_type(name_or_path)
    config = AutoConfig.from_pretrained(name_or_path)
    cls = model_class(config)
    try:
        model = cls.from_pretrained(name_or_path, dtype=DTYPES[precision],
                                    attn_implementation=language_attention(config, attn_implementation))
    except (OSError, ValueError) as exc:
        raise UserError(f"could not load model {name_or_path}: {first_line(exc)} (offline? pass a local model "
                        "directory)") from None
    model.config.use_cache = False
    return model.to(device)


def language_attention(config, attn_implementation: str) -> str | dict[str, str]:
    """``attn_implementation`` for the language model only, SDPA for every other part (the vision tower: varlen
    attention is rocktune's for packed text rows, and the tower's attention has its own per-image bounds).
    transformers 5 takes one implementation per sub-config."""
    if attn_implementation == "sdpa":
        return attn_implementation
    return {name: attn_implementation if name == "text_config" else "sdpa" for name in config.sub_configs}


def language_targets(model, vision: str = "none") -> str:
    """PEFT's target_modules for LoRA on the language model's linear layers (never the head), plus, when asked
    (``lora.vision``), the projector's (``projector``) or every linear layer of the vision side (``all``)."""
    head = model.get_output_embeddings()
    names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and m is not head and not in_vision(name)})
    language = rf"(?!{VISION_PREFIX}\.|.*\.{VISION_PREFIX}\.).*\.({'|'.join(names)})"
    if vision == "none":
        return f"^{language}$"
    extra = [re.escape(name) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
             and in_vision(name) and (vision == "all" or vision_part(name) == "projector")]
    return f"^(?:{language}|{'|'.join(extra)})$"


def in_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIX + ".") or f".{VISION_PREFIX}." in name


def vision_part(name: str) -> str:
    """language | projector (the mergers that map vision features into the language model's width) | tower."""
    if not in_vision(name):
        return "language"
    return "projector" if "merger" in name else "tower"


INPUTS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")


def model_inputs(module, batch: dict) -> dict:
    """The batch's model inputs that ``module``'s forward takes (Qwen3-VL needs ``mm_token_type_ids``; a transformers
    release whose Qwen2.5-VL forward does not know it computes the same from the ids)."""
    import inspect

    params = inspect.signature(module.forward).parameters
    return {k: batch[k] for k in INPUTS if k in batch and k in params}


def patch_embed_as_linear(model) -> int:
    """Run every Conv3d of the vision tower whose stride equals its kernel (no padding, dilation or groups) as one
    matmul: each output is the dot product of one whole patch with each filter, so ``F.linear`` on the flattened
    patch computes the same. The module and its weights stay (state_dict, adapters and saved files unchanged); only
    this instance's forward is replaced. Returns how many were replaced."""
    import types

    count = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Conv3d) and in_vision(name) and _whole_patches(module):
            module.forward = types.MethodType(_conv3d_as_linear, module)
            count += 1
    return count


def _whole_patches(conv) -> bool:
    return (tuple(conv.stride) == tuple(conv.kernel_size) and tuple(conv.padding) == (0, 0, 0)
            and tuple(conv.dilation) == (1, 1, 1) and conv.groups == 1 and conv.padding_mode == "zeros")


def _conv3d_as_linear(self, x):
    """(N, C, T, H, W) with (T, H, W) a multiple of the kernel -> the Conv3d's output, by one matmul per patch."""
    import torch.nn.functional as F

    kt, kh, kw = self.kernel_size
    n, c, t, h, w = x.shape
    patches = x.reshape(n, c, t // kt, kt, h // kh, kh, w // kw, kw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    out = F.linear(patches.reshape(-1, c * kt * kh * kw), self.weight.reshape(self.out_channels, -1), self.bias)
    return out.reshape(n, t // kt, h // kh, w // kw, self.out_channels).permute(0, 4, 1, 2, 3)
