"""Render a clip or an image with a Wan pipeline (and the run's LoRA file), and write it as .mp4 or .png."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rocktune.errors import UserError, first_line

VIDEO_SUFFIXES = (".mp4",)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


@dataclass(frozen=True)
class Shot:
    """What one render draws; the same Shot with the same seed draws the same noise."""

    prompt: str
    width: int
    height: int
    frames: int
    steps: int
    seed: int
    guidance: float
    negative_prompt: str = ""


def load_pipeline(base: str, device: str):
    """WanPipeline on ``device``: fp32 on the CPU; on a GPU a bf16 transformer and text encoder with an fp32 VAE
    (the VAE's decode in bf16 shows as colour banding and blotches)."""
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        vae = AutoencoderKLWan.from_pretrained(base, subfolder="vae", dtype=torch.float32)
        pipe = WanPipeline.from_pretrained(base, vae=vae, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise UserError(f"could not load the Wan pipeline {base}: {first_line(exc)} (offline? pass "
                        "a local diffusers directory with model_index.json as --base)") from None
    return pipe.to(device)


def add_lora(pipe, lora_file: Path, expert: str = "auto") -> None:
    """``expert`` low_noise: a Wan 2.2 A14B LoRA trained on transformer_2/ (diffusion.expert) goes there."""
    try:
        pipe.load_lora_weights(str(lora_file), load_into_transformer_2=expert == "low_noise")
    except (ValueError, KeyError, RuntimeError) as exc:
        raise UserError(f"{lora_file}: diffusers could not load this Wan LoRA ({str(exc).strip()[:200]}); was it "
                        "trained on this base? Pass the run's base model as --base.") from None


def sample(pipe, shot: Shot) -> np.ndarray:
    """uint8 frames [frames, height, width, 3]."""
    import torch

    # A CPU generator draws the same starting noise on every device, so a seed means one clip.
    generator = torch.Generator("cpu").manual_seed(shot.seed)
    out = pipe(prompt=shot.prompt, negative_prompt=shot.negative_prompt or None, width=shot.width,
               height=shot.height, num_frames=shot.frames, num_inference_steps=shot.steps,
               guidance_scale=shot.guidance, generator=generator, output_type="np")
    frames = np.asarray(out.frames[0], dtype=np.float32)
    return (frames.clip(0.0, 1.0) * 255.0).round().astype(np.uint8)


def render(base: str, lora_file: Path | None, shot: Shot, device: str) -> np.ndarray:
    """One clip (or image, frames=1) from ``base``, with the LoRA file when given: uint8 [frames, H, W, 3]."""
    pipe = load_pipeline(base, device)
    if lora_file is not None:
        add_lora(pipe, lora_file)
    return sample(pipe, shot)


def write_media(frames: np.ndarray, out: Path, fps: int = 16) -> Path:
    """Several frames -> .mp4 (H.264 where this PyAV has it, else MPEG-4 Part 2); one frame -> an image by suffix.
    Written under a temp name and renamed, so ``out`` is never half-written."""
    out = Path(out)
    suffix = out.suffix.lower()
    if len(frames) > 1 and suffix not in VIDEO_SUFFIXES:
        raise UserError(f"{out}: {len(frames)} frames make a video; name the output .mp4 (or render --frames 1).")
    if len(frames) == 1 and suffix not in VIDEO_SUFFIXES + IMAGE_SUFFIXES:
        raise UserError(f"{out}: name the output .png, .jpg or .webp (or .mp4 for a one-frame video).")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.stem}.", suffix=out.suffix)
    os.close(fd)
    try:
        if suffix in VIDEO_SUFFIXES:
            _write_video(_even(frames), Path(tmp), fps)
        else:
            from PIL import Image

            Image.fromarray(frames[0]).save(tmp)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def _even(frames: np.ndarray) -> np.ndarray:
    """yuv420p halves the chroma resolution, so encoders need even sides: repeat the last row/column if odd."""
    _, height, width, _ = frames.shape
    pad = ((0, 0), (0, height % 2), (0, width % 2), (0, 0))
    return np.pad(frames, pad, mode="edge") if height % 2 or width % 2 else frames


def _write_video(frames: np.ndarray, path: Path, fps: int) -> None:
    import av

    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "18"}
        else:
            stream.bit_rate = 8_000_000  # MPEG-4 Part 2's default rate smears fine detail into blocks
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())
