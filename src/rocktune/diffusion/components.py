"""Load a diffusers Wan 2.1/2.2 text-to-video checkpoint by part, and put LoRA on its transformer.

A checkpoint is a hub id (``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``) or a local directory in the same layout:
``transformer/``, ``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/`` and ``model_index.json``. Each part is
loaded only while it is needed: the VAE and the text encoder for the latent cache, then the transformer alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rocktune.errors import UserError

# The blocks' attention and feed-forward linears: what Wan LoRAs in the wild adapt and what ComfyUI maps. The patch
# embedding, time/text embedders, time projection, norms and the head are left out (PEFT matches the whole name).
DEFAULT_TARGETS = r"blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)|blocks\.\d+\.ffn\.net\.(0\.proj|2)"
PARTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")


@dataclass(frozen=True)
class Layout:
    """What the run needs to know of a checkpoint before loading any weights."""

    source: str
    transformer: dict  # transformer/config.json
    vae: dict  # vae/config.json
    scheduler: dict  # scheduler/scheduler_config.json

    @property
    def spatial(self) -> int:
        """Pixels per latent cell (8 for Wan 2.1's VAE, 16 for Wan 2.2 TI2V-5B's)."""
        return int(self.vae.get("scale_factor_spatial", 8))

    @property
    def temporal(self) -> int:
        return int(self.vae.get("scale_factor_temporal", 4))

    @property
    def patch(self) -> tuple[int, int, int]:
        return tuple(self.transformer.get("patch_size", (1, 2, 2)))

    @property
    def spatial_multiple(self) -> int:
        """Width and height must divide into whole latent cells and whole transformer patches."""
        return self.spatial * max(self.patch[1], self.patch[2])

    @property
    def text_dim(self) -> int:
        return int(self.transformer.get("text_dim", 4096))

    def shift(self, setting: float | str) -> float:
        """The flow shift: the config's number, else the scheduler's (FlowMatchEuler ``shift``, UniPC
        ``flow_shift``)."""
        if setting != "auto":
            return float(setting)
        return float(self.scheduler.get("flow_shift") or self.scheduler.get("shift") or 1.0)


def read_layout(source: str) -> Layout:
    """Read the three configs (small JSON files); a missing part is named with what a Wan checkpoint holds."""
    from rocktune.model import check_model_source

    check_model_source(source)
    local = Path(source).expanduser()
    if local.is_dir():
        missing = [p for p in PARTS if not (local / p).is_dir()]
        if missing:
            raise UserError(f"model.name_or_path={source} is not a diffusers Wan checkpoint: it has no "
                            f"{', '.join(p + '/' for p in missing)} folder. A Wan text-to-video checkpoint in "
                            f"diffusers layout has {', '.join(p + '/' for p in PARTS)} (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers).")
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    def config(cls, subfolder: str) -> dict:
        try:
            return dict(cls.load_config(source, subfolder=subfolder))
        except (OSError, ValueError) as exc:
            raise UserError(f"could not read {subfolder}/ of {source}: {str(exc).strip().splitlines()[0][:200]} "
                            "(offline? pass a local diffusers directory)") from None

    transformer = config(WanTransformer3DModel, "transformer")
    if transformer.get("_class_name") not in (None, "WanTransformer3DModel"):
        raise UserError(f"{source}: transformer/ holds a {transformer.get('_class_name')}, not a "
                        "WanTransformer3DModel; task video-lora/image-lora trains Wan 2.1/2.2 text-to-video models.")
    if transformer.get("image_dim"):
        raise UserError(f"{source} is an image-to-video Wan model (its transformer takes CLIP image features); "
                        "rocktune trains text-to-video Wan LoRAs only (docs/diffusion.md).")
    return Layout(source, transformer, config(AutoencoderKLWan, "vae"),
                  config(FlowMatchEulerDiscreteScheduler, "scheduler"))


def quiet() -> None:
    """rocktune draws its own progress: the libraries' per-file loading bars would interleave with it."""
    from diffusers.utils import logging as diffusers_logging

    from rocktune.model import quiet_transformers

    quiet_transformers()
    diffusers_logging.disable_progress_bar()
    diffusers_logging.set_verbosity_error()


def load_transformer(source: str, dtype, device: str):
    from diffusers import WanTransformer3DModel

    quiet()
    model = WanTransformer3DModel.from_pretrained(source, subfolder="transformer", torch_dtype=dtype)
    return model.to(device).requires_grad_(False)


def load_vae(source: str, device: str):
    """Always fp32: bf16 VAE encodes are where Wan users on ROCm got zero latents (seed 004)."""
    import torch
    from diffusers import AutoencoderKLWan

    quiet()
    return AutoencoderKLWan.from_pretrained(source, subfolder="vae", torch_dtype=torch.float32).to(device).eval()


def load_text_encoder(source: str, dtype, device: str):
    """(tokenizer, UMT5 encoder) as WanPipeline loads them."""
    from transformers import AutoTokenizer, UMT5EncoderModel

    quiet()
    tokenizer = AutoTokenizer.from_pretrained(source, subfolder="tokenizer")
    encoder = UMT5EncoderModel.from_pretrained(source, subfolder="text_encoder", dtype=dtype)
    return tokenizer, encoder.to(device).eval()


def targets(target_modules: str | list[str]) -> str | list[str]:
    """``all-linear`` (the config default) means the blocks' attention and feed-forward linears here."""
    return DEFAULT_TARGETS if target_modules == "all-linear" else target_modules


def apply_lora(transformer, r: int, alpha: float, dropout: float, target_modules, checkpointing: bool):
    """PEFT LoRA on the transformer; returns the PeftModel (adapter-only save_pretrained, as for LMs)."""
    from peft import LoraConfig, get_peft_model

    if checkpointing:
        transformer.enable_gradient_checkpointing()
    try:
        model = get_peft_model(transformer, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                                                       target_modules=targets(target_modules)))
    except ValueError as exc:  # PEFT: no module matched
        raise UserError(f"lora.target_modules={target_modules!r} matches no linear layer of the Wan transformer "
                        f"({str(exc).splitlines()[0][:160]}); use all-linear (the blocks' attention and "
                        "feed-forward) or module names such as [to_q, to_k, to_v, to_out.0].") from None
    return model


def lora_module_names(model) -> list[str]:
    """Names (as in the plain transformer) of the modules that carry LoRA, for the ComfyUI name check."""
    prefix = "base_model.model."
    return [name.removeprefix(prefix) for name, module in model.named_modules()
            if hasattr(module, "lora_A") and len(getattr(module, "lora_A", {})) > 0]


def planned_targets(layout: Layout, target_modules) -> list[str]:
    """The modules LoRA will adapt, found on a weightless copy of the transformer (no memory, no download): checked
    before the media are encoded, so a target ComfyUI cannot load stops the run before any work."""
    import torch
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        skeleton = WanTransformer3DModel.from_config(layout.transformer)
    return lora_module_names(apply_lora(skeleton, 1, 1.0, 0.0, target_modules, False))
