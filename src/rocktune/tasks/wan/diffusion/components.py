"""Load a diffusers Wan 2.1/2.2 text-to-video checkpoint by part, and put LoRA on its transformer.

A checkpoint is a hub id (``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``) or a local directory in the same layout:
``transformer/``, ``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/`` and ``model_index.json``. Each part is
loaded only while it is needed: the VAE and the text encoder for the latent cache, then the transformer alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rocktune.errors import UserError, first_line
from rocktune.tasks.wan.plan import LORA_TARGETS

# The blocks' attention and feed-forward linears: what Wan LoRAs in the wild adapt and what ComfyUI maps. The patch
# embedding, time/text embedders, time projection, norms and the head are left out (PEFT matches the whole name).
# One pattern for training and the planner, which sizes exactly these.
DEFAULT_TARGETS = LORA_TARGETS
PARTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
# Text positions the transformer's cross-attention sees at inference: WanPipeline pads prompt embeddings with zeros
# to 512 (its max_sequence_length), and the attention has no mask, so training must see the same 512.
PIPELINE_TEXT_TOKENS = 512


@dataclass(frozen=True)
class Layout:
    """What the run needs to know of a checkpoint before loading any weights."""

    source: str
    transformer: dict  # transformer/config.json (or transformer_2/ for the low-noise expert)
    vae: dict  # vae/config.json
    scheduler: dict  # scheduler/scheduler_config.json
    subfolder: str = "transformer"  # the transformer this run trains
    sigma_range: tuple[float, float] = (0.0, 1.0)  # the noise levels it denoises (Wan 2.2 A14B: its expert's share)

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


def require_video_extra() -> None:
    """diffusers, PyAV and Pillow come with the video extra; say so instead of an ImportError deep in a run."""
    import importlib.util

    missing = [name for module, name in (("diffusers", "diffusers"), ("av", "av (PyAV)"), ("PIL", "pillow"))
               if importlib.util.find_spec(module) is None]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise UserError(f"task video-lora/image-lora needs {', '.join(missing)}, which {verb} not installed: "
                        "pip install 'rocktune[video]'.")


def read_layout(source: str, expert: str = "auto") -> Layout:
    """Read the configs (small JSON files); a missing part is named with what a Wan checkpoint holds. ``expert``
    picks the transformer of a two-expert checkpoint (Wan 2.2 A14B) and its noise levels."""
    from rocktune.models.load import check_model_source

    require_video_extra()
    check_model_source(source)
    local = Path(source).expanduser()
    if local.is_dir():
        missing = [p for p in PARTS if not (local / p).is_dir()]
        if missing:
            raise UserError(f"model.name_or_path={source} is not a diffusers Wan checkpoint: it has no "
                            f"{', '.join(p + '/' for p in missing)} folder. A Wan text-to-video checkpoint in "
                            f"diffusers layout has {', '.join(p + '/' for p in PARTS)} "
                            "(e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers).")
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    def config(cls, subfolder: str | None) -> dict:
        try:
            return dict(cls.load_config(source, subfolder=subfolder) if subfolder else cls.load_config(source))
        except (OSError, ValueError) as exc:
            what = f"{subfolder}/" if subfolder else "model_index.json"
            raise UserError(f"could not read {what} of {source}: {first_line(exc)} "
                            "(offline? pass a local diffusers directory)") from None

    from diffusers import DiffusionPipeline

    subfolder, sigma_range = _expert(source, config(DiffusionPipeline, None), expert)
    transformer = config(WanTransformer3DModel, subfolder)
    if transformer.get("_class_name") not in (None, "WanTransformer3DModel"):
        raise UserError(f"{source}: transformer/ holds a {transformer.get('_class_name')}, not a "
                        "WanTransformer3DModel; task video-lora/image-lora trains Wan 2.1/2.2 text-to-video models.")
    if transformer.get("image_dim"):
        raise UserError(f"{source} is an image-to-video Wan model (its transformer takes CLIP image features); "
                        "rocktune trains text-to-video Wan LoRAs only (docs/diffusion.md).")
    return Layout(source, transformer, config(AutoencoderKLWan, "vae"),
                  config(FlowMatchEulerDiscreteScheduler, "scheduler"), subfolder, sigma_range)


def _expert(source: str, index: dict, expert: str) -> tuple[str, tuple[float, float]]:
    """(subfolder, sigma range) of the transformer to train. WanPipeline hands timestep t to transformer/ when
    t >= boundary_ratio x 1000 and to transformer_2/ below: each expert only ever sees its share of noise levels."""
    two = (index.get("transformer_2") or [None])[0] is not None
    boundary = index.get("boundary_ratio")
    if not two:
        if expert != "auto":
            raise UserError(f"diffusion.expert={expert}: {source} has one transformer, not Wan 2.2 A14B's two "
                            "experts; leave diffusion.expert at auto.")
        return "transformer", (0.0, 1.0)
    if boundary is None:
        raise UserError(f"{source} has two transformers but its model_index.json has no boundary_ratio, so which "
                        "noise levels each one denoises is unknown; add the value the checkpoint was released with "
                        "(0.875 for Wan 2.2 T2V A14B).")
    if expert == "auto":
        raise UserError(f"{source} has two transformers (Wan 2.2 A14B: transformer/ for high noise, transformer_2/ "
                        f"for low noise, boundary_ratio {boundary}); set diffusion.expert=high_noise or low_noise to "
                        "choose which one this LoRA trains (train twice for both).")
    return ("transformer", (float(boundary), 1.0)) if expert == "high_noise" else \
        ("transformer_2", (0.0, float(boundary)))


def quiet() -> None:
    """rocktune draws its own progress: the libraries' per-file loading bars would interleave with it."""
    from diffusers.utils import logging as diffusers_logging

    from rocktune.models.load import quiet_transformers

    quiet_transformers()
    diffusers_logging.disable_progress_bar()
    diffusers_logging.set_verbosity_error()


def load_transformer(source: str, dtype, device: str, subfolder: str = "transformer"):
    from diffusers import WanTransformer3DModel

    quiet()
    model = WanTransformer3DModel.from_pretrained(source, subfolder=subfolder, torch_dtype=dtype)
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
    # transformers types ``to`` through a decorator that mypy reads as taking a model, not a device
    return tokenizer, encoder.to(device).eval()  # type: ignore[arg-type]


def targets(target_modules: str | list[str]) -> str | list[str]:
    """``all-linear`` (the config default) means the blocks' attention and feed-forward linears here."""
    return DEFAULT_TARGETS if target_modules == "all-linear" else target_modules


def apply_lora(transformer, r: int, alpha: float, dropout: float, target_modules, checkpointing: bool):
    """PEFT LoRA on the transformer; returns the PeftModel (adapter-only save_pretrained, as for LMs)."""
    from peft import LoraConfig, get_peft_model

    if checkpointing:
        transformer.enable_gradient_checkpointing()
    try:
        config = LoraConfig(r=r, lora_alpha=alpha,  # type: ignore[arg-type]  # PEFT annotates int; it is alpha / r
                            lora_dropout=dropout, target_modules=targets(target_modules))
        model = get_peft_model(transformer, config)
    except ValueError as exc:  # PEFT: no module matched
        raise UserError(f"lora.target_modules={target_modules!r} matches no linear layer of the Wan transformer "
                        f"({first_line(exc, 160)}); use all-linear (the blocks' attention and "
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
