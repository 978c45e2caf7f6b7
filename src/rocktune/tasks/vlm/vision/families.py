"""The vision-language families task=vlm trains, one typed entry each (keyed by transformers' ``model_type``): the
model class, where the vision tower and the projector sit in its module tree (LoRA targets, ``lora.vision``, the
freeze log), whether its image processor takes ``min_pixels``/``max_pixels``, and how its processor widens an image
placeholder (a rule of tasks/vlm/data/vision_rules.py, with the token strings read from the model's own config and
tokenizer). The facts are tasks/vlm/vision/table.py's entries (standard library only, read by the planner and the export
too); this module builds their runtime objects (the placeholder rule, ``VisionTokens``) from them.
Below the trainer and the export alike, it also holds a run's image-token range in llama.cpp's terms (``ImageTokens``):
the export prints it on llama.cpp's command line and the adapter card (train/model_card.py) writes the same flags.

A family not listed here is refused with the list; nothing is trained half-understood.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from rocktune.tasks.vlm.data.vision import VisionTokens
from rocktune.tasks.vlm.data.vision_rules import FixedTokens, PatchGrid, SplitTiles
from rocktune.errors import UserError
from rocktune.tasks.vlm.vision import table
from rocktune.tasks.vlm.vision.table import FamilyEntry


@dataclass(frozen=True)
class ImageTokens:
    """The run's image-token range in llama.cpp's terms. mtmd resizes a Qwen image as transformers' processor does
    (aspect kept, sides a multiple of patch x merge) but between limits of its own, 8 to 4096 tokens in
    llama-cpp-python 0.3.36, and reads no limit from the mmproj for these projectors: only its context parameters
    (``--image-min-tokens`` / ``--image-max-tokens``) move them. Without them a 56 x 56 image the processor keeps
    at 4 tokens is enlarged to 9."""
    low: int                 # fewest tokens an image is resized to (the processor's min_pixels, in tokens)
    high: int                # most tokens (max_pixels, in tokens)
    pixels: tuple[int, int]  # the processor's (min_pixels, max_pixels)
    area: int                # pixels per image token: (patch size x merge size) squared

    @property
    def exact(self) -> bool:
        """Whether the processor's limits are whole tokens, so that mtmd resizes every image to the same size."""
        return self.pixels == (self.low * self.area, self.high * self.area)

    def flags(self) -> list[str]:
        return ["--image-min-tokens", str(self.low), "--image-max-tokens", str(self.high)]

    def note(self) -> str | None:
        """What the flags cannot say exactly: limits that are not whole tokens."""
        if self.exact:
            return None
        return (f"the image processor's min_pixels/max_pixels {self.pixels[0]}/{self.pixels[1]} are not whole image "
                f"tokens of {self.area} pixels; llama.cpp takes {self.low} to {self.high} tokens, which resizes "
                "images at those limits to within a row or column of the processor's size (set data.min_pixels and "
                "data.max_pixels to multiples of it for the same count)")


def image_tokens(cfg, preprocessor: dict) -> ImageTokens | None:
    """The processor's pixel limits as whole image tokens (None: a family whose processor sets the size itself).
    A limit that is not a whole number of tokens is rounded so that mtmd enlarges or shrinks exactly the images
    the processor does (a resized side is a multiple of patch x merge, so its token count is whole)."""
    if not FAMILIES[cfg.model_type].pixel_limits:
        return None
    vision = cfg.vision_config
    side = int(vision.patch_size) * int(getattr(vision, "spatial_merge_size", 2) or 2)
    low_px, high_px = preprocessor.get("min_pixels"), preprocessor.get("max_pixels")
    if not low_px or not high_px:
        raise UserError(f"GGUF export: the image processor of this {cfg.model_type} model has no min_pixels/"
                        "max_pixels (size.shortest_edge/longest_edge), which llama.cpp needs to make as many image "
                        "tokens as training did. Restore the model's preprocessor_config.json.")
    area = side * side
    low, high = max(1, -(-int(low_px) // area)), int(high_px) // area
    if high < low:
        raise UserError(f"GGUF export: the image processor's max_pixels {high_px} is below its min_pixels "
                        f"{low_px} (in whole {side} x {side} tokens: {high} < {low}); llama.cpp refuses such "
                        "limits. Fix data.min_pixels/data.max_pixels or the model's preprocessor_config.json.")
    return ImageTokens(low, high, (int(low_px), int(high_px)), area)


def processor_pixels(images) -> dict:
    """A loaded image processor's pixel limits, ``{"min_pixels", "max_pixels"}`` (None where it has none): Qwen's
    ``size.shortest_edge`` / ``longest_edge`` in transformers 5, ``min_pixels`` / ``max_pixels`` in 4.x."""
    size = getattr(images, "size", None)
    return {"min_pixels": getattr(images, "min_pixels", None) or size_of(size, "shortest_edge"),
            "max_pixels": getattr(images, "max_pixels", None) or size_of(size, "longest_edge")}


def size_of(size, key: str):
    """One entry of an image processor's ``size`` (a dict, or transformers 5's SizeDict)."""
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def run_image_tokens(name_or_path: str, data: dict) -> ImageTokens | None:
    """:func:`image_tokens` of a run: the base's image processor loaded with the run's ``data.min_pixels`` /
    ``data.max_pixels``, as training loaded it (nothing is loaded for a family without pixel limits)."""
    from transformers import AutoConfig, AutoImageProcessor

    cfg = AutoConfig.from_pretrained(name_or_path)
    if not FAMILIES[cfg.model_type].pixel_limits:
        return None
    limits = {k: data[k] for k in ("min_pixels", "max_pixels") if data.get(k) is not None}
    return image_tokens(cfg, processor_pixels(AutoImageProcessor.from_pretrained(name_or_path, **limits)))


@dataclass(frozen=True)
class Family:
    """A family's runtime view: its entry of tasks/vlm/vision/table.py with the placeholder rule that widens its
    images."""
    entry: FamilyEntry

    def __getattr__(self, key: str):  # name, model_class, image_processors, roots, projector, pixel_limits, ...
        if key == "entry":  # not yet set (a copy being built): no recursion
            raise AttributeError(key)
        return getattr(self.entry, key)

    def tokens(self, config, tokenizer, images) -> VisionTokens:
        """(config, tokenizer, image processor) -> the family's vision tokens, by its placeholder rule."""
        return RULES[self.entry.placeholder.kind](self.entry.placeholder.token_keys, config, tokenizer, images)

    def in_vision(self, name: str) -> bool:
        return any(root in name.split(".") for root in self.entry.roots)

    def part(self, name: str) -> str:
        """language | projector (what maps image features into the language model's width) | tower."""
        if not self.in_vision(name):
            return "language"
        return "projector" if self.entry.projector in name else "tower"


def _names(tokenizer, config, keys: tuple[str, ...]) -> list[str]:
    out = []
    for key in keys:
        token = tokenizer.convert_ids_to_tokens(getattr(config, key))
        if token is None:
            raise UserError(f"the tokenizer has no token {getattr(config, key)} (the config's {key}); use the model's "
                            "own tokenizer.")
        out.append(token)
    return out


def _patch_grid(keys: tuple[str, ...], config, tokenizer, images) -> VisionTokens:
    (image, *_) = _names(tokenizer, config, keys)
    return VisionTokens(images, getattr(config, keys[0]), image, frozenset(getattr(config, k) for k in keys),
                        PatchGrid(image, images.merge_size))


def _fixed_tokens(keys: tuple[str, ...], config, tokenizer, images) -> VisionTokens:
    if getattr(images, "do_pan_and_scan", False):
        raise UserError("Gemma 3's pan-and-scan (extra crops of a large image) is not supported yet; set "
                        "do_pan_and_scan: false in the model's preprocessor_config.json.")
    image, begin, end = _names(tokenizer, config, keys)
    return VisionTokens(images, getattr(config, keys[0]), begin, frozenset(getattr(config, k) for k in keys),
                        FixedTokens(image, begin, end, config.mm_tokens_per_image))


def _split_tiles(keys: tuple[str, ...], config, tokenizer, images) -> VisionTokens:
    """Idefics3 / SmolVLM: the tile's token count as the model's connector makes it (pixel shuffle by scale_factor)."""
    (image,) = _names(tokenizer, config, keys[:1])
    count = _tile_tokens(config)
    around = getattr(tokenizer, "fake_image_token", None) or "<fake_token_around_image>"
    whole = getattr(tokenizer, "global_image_token", None) or "<global-img>"
    vocab = tokenizer.get_vocab()
    tags = [around, whole, image] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    return VisionTokens(images, getattr(config, keys[0]), image, frozenset(vocab[t] for t in tags if t in vocab),
                        SplitTiles(image, around, whole, count))


# the placeholder rules of tasks/vlm/vision/table.py's entries (Placeholder.kind), built from the model's config and
# tokenizer
RULES: dict[str, Callable[[tuple[str, ...], object, object, object], VisionTokens]] = {
    "patch_grid": _patch_grid, "fixed_tokens": _fixed_tokens, "split_tiles": _split_tiles}


def _tile_tokens(config) -> int:
    v = config.vision_config
    return (v.image_size // v.patch_size) ** 2 // config.scale_factor**2


def processor_settings(config) -> dict:
    """The settings of transformers' combined processor (its ``processor_config.json``) that make it widen an image
    placeholder as rocktune does, from the model's own config: Gemma 3's and Idefics3/SmolVLM's processors otherwise
    take their class defaults (256, 169 tokens an image) whatever the model's tower makes. Qwen's count from the grid
    needs none. Written beside a merged model, so ``AutoProcessor.from_pretrained`` of it agrees with the model."""
    entry = table.FAMILIES.get(getattr(config, "model_type", ""))  # "": no model_type (transformers' own default)
    if entry is None:
        return {}
    return {key: _tile_tokens(config) if source == "tile_tokens" else getattr(config, source)
            for key, source in entry.processor_settings.items()}


class _Families(Mapping[str, Family]):
    """tasks/vlm/vision/table.py's entries as ``Family`` objects, read live (an entry added to the table is a family
    here)."""

    def __getitem__(self, kind: str) -> Family:
        return Family(table.FAMILIES[kind])

    def __iter__(self) -> Iterator[str]:
        return iter(table.FAMILIES)

    def __len__(self) -> int:
        return len(table.FAMILIES)


FAMILIES: Mapping[str, Family] = _Families()


def vision_family(name_or_path: str) -> tuple[str, Family] | None:
    """(model_type, family) when ``name_or_path`` is a vision-language checkpoint of this table, read from its
    config.json (a local directory, or a hub id's cached copy) by the planner's own test; None for any other
    model."""
    from rocktune.tasks.vlm.planner.vlm import vlm_model_type

    kind = vlm_model_type(name_or_path)
    return (kind, FAMILIES[kind]) if kind is not None and kind in FAMILIES else None


def vision_checkpoint(name_or_path: str) -> tuple[str, Family] | None:
    """:func:`vision_family` of a checkpoint only task=vlm trains: what ``train`` and ``data preview`` take as
    task=vlm when the config sets no task, what a text task refuses, what ``generate`` answers about images without
    ``--image``. None for any other model, and for a family the text tasks train too (Qwen3.5: they load its
    language model; task=vlm is then asked for, and ``generate --image`` answers about images)."""
    found = vision_family(name_or_path)
    return found if found is not None and not found[1].text_task else None


def text_task_refusal(task: str, where: str, name_or_path: str, kind: str) -> UserError:
    """The one refusal of a text task (lm, dpo, orpo, grpo) on a vision-language checkpoint: transformers would fail
    later with "Unrecognized configuration class ... AutoModelForCausalLM", which does not say what to change.
    ``where``: what set the task (the config's key, a run's saved config)."""
    fam = FAMILIES[kind]
    return UserError(f"task={task} ({where}) trains a text-only model, but {name_or_path} is a {fam.name} "
                     f"vision-language model (config.json: model_type {kind}, transformers' {fam.model_class}), which "
                     "a text task cannot load or feed its images. Set task: vlm (in the config, or the override "
                     "task=vlm) to fine-tune it on conversations with images (docs/vision.md), or give a text model.")
