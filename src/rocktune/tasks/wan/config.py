"""The ``diffusion:`` config section of task: video-lora / image-lora; config.py composes it into the run config
from the task's registry row."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt

from rocktune.config_base import _Section


class DiffusionConfig(_Section):
    """task: video-lora / image-lora only (docs/diffusion.md); the LM path ignores this section."""

    resolutions: list[tuple[PositiveInt, PositiveInt]] = Field(
        default_factory=lambda: [(832, 480), (480, 832), (624, 624)],
        description="Resolution buckets as [width, height]. Each file goes to the bucket nearest its aspect ratio, "
        "is resized to cover it and centre-cropped. Both sides must be multiples of the VAE's spatial factor times "
        "the transformer's patch size (16 for Wan 2.1; 32 for the Wan 2.2 TI2V-5B VAE).",
    )
    frames: list[PositiveInt] = Field(
        default_factory=lambda: [33], description="Frame-count buckets for video-lora: each must be 4k+1 (the VAE "
        "compresses 4 frames into one latent frame after the first), e.g. 1, 17, 33, 49, 81. A clip takes the largest "
        "bucket it can fill from its first frames; a clip shorter than the smallest bucket is reported. image-lora "
        "uses 1.",
    )
    media_field: str = Field("path", description="JSONL manifest: the field with the media file (relative to the "
                             "manifest's folder).")
    caption_field: str = Field("caption", description="JSONL manifest: the field with the caption. In a folder the "
                               "caption is the .txt file beside each media file.")
    max_text_tokens: int = Field(
        512, gt=0, le=512, description="Caption tokens kept; longer captions are cut. The transformer always sees "
        "512 text positions, the caption's then zeros, as WanPipeline and ComfyUI feed it at inference.",
    )
    timestep_sampling: Literal["shift", "uniform", "logit_normal"] = Field(
        "shift", description="How a training timestep is drawn. shift: u ~ U(0,1) mapped by the flow shift, "
        "sigma = s*u / (1 + (s-1)*u), as Wan's scheduler spaces its inference timesteps; uniform: sigma = u; "
        "logit_normal: sigma = sigmoid(N(0,1)), then shifted.",
    )
    shift: float | Literal["auto"] = Field(
        "auto", description="Flow shift s. auto: the checkpoint's scheduler config (shift, or flow_shift for UniPC).",
    )
    expert: Literal["auto", "high_noise", "low_noise"] = Field(
        "auto", description="Wan 2.2 A14B has two transformers: transformer/ denoises the high-noise timesteps (t >= "
        "boundary_ratio x 1000) and transformer_2/ the rest. A LoRA trains one of them, on its own noise levels only: "
        "high_noise or low_noise (train twice for both; ComfyUI loads one file per model). auto: the only transformer "
        "of a one-transformer checkpoint; refused for a two-expert one.",
    )
    cache_device: Literal["auto", "cpu"] = Field(
        "auto", description="Where the VAE and text encoder run to build the latent cache. auto: the training device "
        "(on a GPU the first item is encoded again on the CPU in fp32 and compared); cpu: encode on the CPU "
        "(slow, and the way around a device whose encodes fail the checks).",
    )
