"""Vision-language models: the supported families, their processor parts and LoRA targets, loaded from a model
directory the way a hub checkpoint is (used by task=vlm and by ``rocktune generate --image``).

Supported families are listed in ``vision_families.FAMILIES`` (transformers' model_type -> a typed ``Family``);
another model_type is refused with the list, never trained half-understood. The processor is taken as its parts:
the tokenizer (with its chat template) and the image processor, with ``data.min_pixels``/``data.max_pixels`` applied
(Qwen's). (transformers' combined processor class also builds a video processor, which needs torchvision; images need
only the image processor.)
"""

from __future__ import annotations

import re

import torch

from rocktune.tasks.vlm.data.vision import VisionTokens
from rocktune.errors import UserError, first_line
from rocktune.models.load import DTYPES, check_model_source
from rocktune.tasks.vlm.vision import families as vision_families
from rocktune.tasks.vlm.vision.families import FAMILIES, Family


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
        names = ", ".join(f.name for f in FAMILIES.values())
        raise UserError(f"task=vlm supports {', '.join(FAMILIES)} ({names}) so far; {name_or_path} is a {kind!r} "
                        "model (docs/vision.md lists what is planned).")
    import transformers

    fam = FAMILIES[kind]
    if not hasattr(transformers, fam.model_class):
        raise UserError(f"{name_or_path} is a {kind} model, which transformers {transformers.__version__} does not "
                        f"know ({fam.model_class}); upgrade transformers.")
    if int(transformers.__version__.split(".")[0]) < fam.transformers:
        raise UserError(f"{name_or_path} is a {fam.name} model, which task=vlm is tested with on transformers "
                        f"{fam.transformers} only (this is {transformers.__version__}); upgrade transformers (torch 2.6"
                        " or later), or train a Qwen-VL model.")
    return kind


def family(config) -> Family | None:
    """The supported family of a model config, None for any other model."""
    return FAMILIES.get(getattr(config, "model_type", ""))  # "": no model_type (transformers' own default)


def model_class(config):
    """transformers' class for a supported vision-language config, None for any other model."""
    import transformers

    fam = family(config)
    return getattr(transformers, fam.model_class, None) if fam else None


def check_data_settings(kind: str, min_pixels: int | None, max_pixels: int | None, packing: str = "") -> None:
    """The data settings a family does not take, refused with the reason before anything is read. ``packing``: the
    setting that packs conversations into rows (``data.packing``, ``training.batching=tokens``), "" for none."""
    fam = FAMILIES[kind]
    if packing and not fam.packing:
        undo = "set data.packing: false" if packing == "data.packing" else "set training.batching: examples"
        raise UserError(f"{packing} with task=vlm packs Qwen-VL conversations (their 3-D positions are made per "
                        f"conversation); {fam.name} would need its own, so {undo}.")
    if not fam.pixel_limits and (min_pixels is not None or max_pixels is not None):
        raise UserError(f"data.min_pixels/max_pixels set the resolution of Qwen's image processors; {fam.name}'s "
                        "sets it in the model's preprocessor_config.json (Gemma 3: one fixed size; Idefics3/SmolVLM: "
                        "size.longest_edge, in tiles of max_image_size). Remove them from the config.")


def recurrent_notes(name_or_path: str, packing: str) -> list[str]:
    """A language model with recurrent layers (Qwen3.5's Gated DeltaNet): ``packing`` (the setting that packs
    conversations into rows, "" for none) refused, since the layers' state and short convolution would run on from
    one packed conversation into the next (their masks and rocktune's per-conversation positions reach the attention
    layers only); padded rows are exact, their padding being on the right. Returns the run log's note when the layers
    run on transformers' torch reference kernels."""
    from rocktune.models.recurrent import describe, kernel_note, recurrent_layers

    layers = recurrent_layers(name_or_path, False)
    if layers and packing:
        undo = "set data.packing: false" if packing == "data.packing" else "set training.batching: examples"
        raise UserError(f"{packing} with task=vlm packs conversations into rows, but {name_or_path} has recurrent "
                        f"layers ({describe(layers)}) whose state and short convolution would run on from one packed "
                        "conversation into the next (rocktune does not keep packed conversations apart in them yet); "
                        f"{undo} (padded micro-batches train it correctly).")
    return [n for n in (kernel_note(layers),) if n]


def vision_tokens(name_or_path: str, config, tokenizer, min_pixels: int | None,
                  max_pixels: int | None) -> VisionTokens:
    """The image processor of ``name_or_path`` (pixel limits applied) and its family's vision tokens, named in
    ``tokenizer``."""
    from transformers import AutoImageProcessor

    fam = FAMILIES[config.model_type]
    check_data_settings(config.model_type, min_pixels, max_pixels)
    limits = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
    try:
        images = AutoImageProcessor.from_pretrained(name_or_path, **limits)
    except (OSError, ValueError) as exc:
        raise UserError(f"the image processor of {name_or_path} does not load ({first_line(exc)}); the model "
                        "directory needs its preprocessor_config.json.") from None
    if not type(images).__name__.startswith(fam.image_processors):
        raise UserError(f"{name_or_path} is a {fam.name} model, whose images need {' or '.join(fam.image_processors)}"
                        f"; its preprocessor_config.json gives {type(images).__name__}. Restore the model's own file.")
    return fam.tokens(config, tokenizer, images)


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


def save_processor_settings(config, out) -> None:
    """``out``/processor_config.json with the combined processor's settings that match ``config``'s model
    (``tasks/vlm/vision/families.py``: ``processor_settings``); nothing for a family that needs none."""
    import json
    from pathlib import Path

    settings = vision_families.processor_settings(config)
    if settings:
        (Path(out) / "processor_config.json").write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


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
    model = model.to(device)
    from rocktune.kernels import recurrent as recurrent_kernels

    recurrent_kernels.apply(model, device)  # Qwen3.5's Gated DeltaNet layers: fast kernels that pass a self-test
    return model


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
    fam = family(model.config)
    # its callers' models are of a supported family: load_vlm refuses any other model_type, and the benchmarks
    # (tasks/vlm/bench/hf_vlm.py, bench/plain_loop.py) have read FAMILIES[model_type] in vision_tokens first
    assert fam is not None
    head = model.get_output_embeddings()
    names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and m is not head and not fam.in_vision(name)})
    roots = "|".join(fam.roots)
    language = rf"(?!(?:{roots})\.|.*\.(?:{roots})\.).*\.({'|'.join(names)})"
    if vision == "none":
        return f"^{language}$"
    extra = [re.escape(name) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
             and fam.in_vision(name) and (vision == "all" or fam.part(name) == "projector")]
    if not extra:
        raise UserError(f"lora.vision={vision}: {fam.name}'s {'projector' if vision == 'projector' else 'vision side'} "
                        "has no linear layer for LoRA (Gemma 3's projector is a bare weight matrix); use lora.vision: "
                        "all (the vision tower's linear layers) or none.")
    return f"^(?:{language}|{'|'.join(extra)})$"


INPUTS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids", "token_type_ids",
          "pixel_attention_mask")


def model_inputs(module, batch: dict) -> dict:
    """The batch's model inputs that ``module``'s forward takes (Qwen3-VL needs ``mm_token_type_ids``, Gemma 3
    ``token_type_ids``, Idefics3 ``pixel_attention_mask``; a transformers release whose Qwen2.5-VL forward does not
    know ``mm_token_type_ids`` computes the same from the ids)."""
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
        vision = any(fam.in_vision(name) for fam in FAMILIES.values())
        if isinstance(module, torch.nn.Conv3d) and vision and _whole_patches(module):
            patched: torch.nn.Module = module  # nn.Module declares forward a Callable attribute, an instance's own
            patched.forward = types.MethodType(_conv3d_as_linear, module)
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
