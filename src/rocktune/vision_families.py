"""The vision-language families task=vlm trains, one typed entry each (keyed by transformers' ``model_type``): the
model class, where the vision tower and the projector sit in its module tree (LoRA targets, ``lora.vision``, the
freeze log), whether its image processor takes ``min_pixels``/``max_pixels``, and how its processor widens an image
placeholder (a rule of data/vision_rules.py, with the token strings read from the model's own config and tokenizer).

A family not listed here is refused with the list; nothing is trained half-understood.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rocktune.data.vision import VisionTokens
from rocktune.data.vision_rules import FixedTokens, PatchGrid, SplitTiles
from rocktune.errors import UserError


@dataclass(frozen=True)
class Family:
    name: str  # as people call it
    model_class: str  # transformers' class
    image_processors: tuple[str, ...]  # the image processor classes it takes (their Pillow/fast variants too)
    roots: tuple[str, ...]  # the module names under which the vision side lives, the tower's first
    projector: str  # the part of a vision-side module's name that makes it the projector (Qwen's inside the tower)
    tokens: Callable[[object, object, object], VisionTokens]  # (config, tokenizer, image processor) -> tokens
    pixel_limits: bool = False  # the image processor takes min_pixels / max_pixels
    transformers: int = 4  # the lowest transformers major it is tested with (the torch 2.4/2.5 stacks have 4.57)
    packing: bool = False  # data.packing: conversations packed in a row (Qwen: 3-D positions per conversation)

    def in_vision(self, name: str) -> bool:
        return any(root in name.split(".") for root in self.roots)

    def part(self, name: str) -> str:
        """language | projector (what maps image features into the language model's width) | tower."""
        if not self.in_vision(name):
            return "language"
        return "projector" if self.projector in name else "tower"


def _names(tokenizer, config, keys: tuple[str, ...]) -> list[str]:
    out = []
    for key in keys:
        token = tokenizer.convert_ids_to_tokens(getattr(config, key))
        if token is None:
            raise UserError(f"the tokenizer has no token {getattr(config, key)} (the config's {key}); use the model's "
                            "own tokenizer.")
        out.append(token)
    return out


def _qwen(config, tokenizer, images) -> VisionTokens:
    keys = ("image_token_id", "vision_start_token_id", "vision_end_token_id")
    (image, *_) = _names(tokenizer, config, keys)
    return VisionTokens(images, config.image_token_id, image, frozenset(getattr(config, k) for k in keys),
                        PatchGrid(image, images.merge_size))


def _gemma3(config, tokenizer, images) -> VisionTokens:
    if getattr(images, "do_pan_and_scan", False):
        raise UserError("Gemma 3's pan-and-scan (extra crops of a large image) is not supported yet; set "
                        "do_pan_and_scan: false in the model's preprocessor_config.json.")
    keys = ("image_token_id", "boi_token_id", "eoi_token_id")
    image, begin, end = _names(tokenizer, config, keys)
    return VisionTokens(images, config.image_token_id, begin, frozenset(getattr(config, k) for k in keys),
                        FixedTokens(image, begin, end, config.mm_tokens_per_image))


def _tiles(config, tokenizer, images) -> VisionTokens:
    """Idefics3 / SmolVLM: the tile's token count as the model's connector makes it (pixel shuffle by scale_factor)."""
    (image,) = _names(tokenizer, config, ("image_token_id",))
    v = config.vision_config
    count = (v.image_size // v.patch_size) ** 2 // config.scale_factor**2
    around = getattr(tokenizer, "fake_image_token", None) or "<fake_token_around_image>"
    whole = getattr(tokenizer, "global_image_token", None) or "<global-img>"
    vocab = tokenizer.get_vocab()
    tags = [around, whole, image] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    return VisionTokens(images, config.image_token_id, image, frozenset(vocab[t] for t in tags if t in vocab),
                        SplitTiles(image, around, whole, count))


QWEN = ("Qwen2VLImageProcessor",)
TILES = ("SmolVLMImageProcessor", "Idefics3ImageProcessor")  # SmolVLM's first release is an idefics3 model
FAMILIES: dict[str, Family] = {
    # Qwen's mergers (Qwen3-VL's deepstack mergers too) sit inside visual.*
    "qwen2_5_vl": Family("Qwen2.5-VL", "Qwen2_5_VLForConditionalGeneration", QWEN, ("visual",), "merger", _qwen,
                         True, packing=True),
    "qwen3_vl": Family("Qwen3-VL", "Qwen3VLForConditionalGeneration", QWEN, ("visual",), "merger", _qwen, True,
                       packing=True),
    "qwen2_vl": Family("Qwen2-VL", "Qwen2VLForConditionalGeneration", QWEN, ("visual",), "merger", _qwen, True,
                       packing=True),
    "gemma3": Family("Gemma 3", "Gemma3ForConditionalGeneration", ("Gemma3ImageProcessor",),
                     ("vision_tower", "multi_modal_projector"), "multi_modal_projector", _gemma3, transformers=5),
    "smolvlm": Family("SmolVLM", "SmolVLMForConditionalGeneration", TILES, ("vision_model", "connector"),
                      "connector", _tiles, transformers=5),
    "idefics3": Family("Idefics3", "Idefics3ForConditionalGeneration", TILES, ("vision_model", "connector"),
                       "connector", _tiles, transformers=5),
}
