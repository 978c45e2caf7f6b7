"""``rocktune generate RUN --prompt TEXT`` for a video-lora / image-lora run: render with ``RUN/wan_lora.safetensors``.

Size and length default to the run's first resolution and frame bucket, so the sample looks like what it trained on;
``--compare`` renders the base too, from the same seed, so the two differ only by the LoRA.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from rocktune.tasks.wan.diffusion.comfy import LORA_FILE
from rocktune.errors import UserError
from rocktune.readers.yaml_file import read_yaml
from rocktune import task_registry

CONFIG_NAME = "config.yaml"  # the run directory's resolved config (train/rundir.py, a layer above this one)


@dataclass
class Request:
    """One ``generate`` call; None means the run's own value."""

    prompt: str
    out: str | None = None
    base: str | None = None
    compare: bool = False
    size: str | None = None  # "WIDTHxHEIGHT"
    frames: int | None = None
    steps: int = 30
    seed: int = 0
    guidance: float = 5.0
    negative_prompt: str = ""


def run_config(path: str) -> dict | None:
    """The run's resolved config when ``path`` is a diffusion run directory, else None (an LM run or a model)."""
    saved = Path(path) / CONFIG_NAME
    if not saved.is_file():
        return None
    config = read_yaml(saved, "restore the run directory from a copy, or train again.")[0] or {}
    return config if isinstance(config, dict) and config.get("task") in task_registry.DIFFUSION else None


def generate(run: str, request: Request, device: str) -> list[Path]:
    """Render the prompt (and, with compare, the base alone) into RUN/samples/; returns the files written."""
    from rocktune.tasks.wan.diffusion.render import add_lora, load_pipeline, sample, write_media

    config = run_config(run)
    if config is None:
        raise UserError(f"{Path(run) / CONFIG_NAME} does not describe a video-lora or image-lora run.")
    lora = _lora_file(Path(run))
    base = request.base or config.get("model", {}).get("name_or_path")
    if not base:
        raise UserError(f"{Path(run) / CONFIG_NAME} names no model.name_or_path; pass the base Wan checkpoint as "
                        "--base.")
    from rocktune.tasks.wan.diffusion.components import read_layout

    expert = (config.get("diffusion") or {}).get("expert", "auto")
    shot = _shot(request, config, read_layout(base, expert).spatial_multiple)
    out = _out_path(Path(run), request, shot)
    pipe = load_pipeline(base, device)
    written = []
    if request.compare:
        written.append(write_media(sample(pipe, shot), out.with_name(f"{out.stem}-base{out.suffix}")))
    add_lora(pipe, lora, config.get("diffusion", {}).get("expert", "auto"))
    written.insert(0, write_media(sample(pipe, shot), out))
    return written


def main(run: str, request: Request, device: str) -> int:
    for path in generate(run, request, device):
        sys.stdout.write(f"{path}\n")
    return 0


def _lora_file(run: Path) -> Path:
    lora = run / LORA_FILE
    if not lora.is_file():
        raise UserError(f"{lora} not found: the run has not finished. Train first, or finish an interrupted run "
                        "with `rocktune train --resume`.")
    return lora


def _shot(request: Request, config: dict, multiple: int = 16):
    """``multiple``: the checkpoint's side multiple (16 for Wan 2.1; 32 for the Wan 2.2 TI2V-5B VAE)."""
    from rocktune.planner.budget import parse_size
    from rocktune.tasks.wan.config import DiffusionConfig
    from rocktune.tasks.wan.diffusion.render import Shot

    # Only the two bucket fields: a run written by another rocktune version may carry keys this one lacks.
    saved = config.get("diffusion") or {}
    buckets = DiffusionConfig(**{key: saved[key] for key in ("resolutions", "frames") if key in saved})
    width, height = parse_size(request.size, "--size") if request.size else buckets.resolutions[0]
    # `is None`, not `or`: --frames 0 is a mistake to name, not a request for the default
    frames = request.frames if request.frames is not None else (
        1 if config.get("task") == "image-lora" else buckets.frames[0])
    if width % multiple or height % multiple:
        raise UserError(f"--size {width}x{height}: this Wan checkpoint renders sides that are multiples of "
                        f"{multiple}; try {_round(width, multiple)}x{_round(height, multiple)}.")
    if frames < 1 or (frames - 1) % 4:
        raise UserError(f"--frames {frames}: Wan's VAE needs 4k+1 frames (1, 5, 9, 13, 17, ..., 33, 49, 81); use "
                        f"{_nearest_frames(frames)}.")
    if request.steps < 1:
        raise UserError("--steps must be at least 1.")
    return Shot(request.prompt, int(width), int(height), frames, request.steps, request.seed, request.guidance,
                request.negative_prompt)


def _nearest_frames(frames: int) -> str:
    """The valid counts either side of ``frames`` (4k+1), both in the list the message gives."""
    if frames < 1:
        return "1 (one image) or more"
    lower = (frames - 1) // 4 * 4 + 1
    return f"{lower} or {lower + 4}"


def _round(side: int, multiple: int) -> int:
    return max(multiple, round(side / multiple) * multiple)


def _out_path(run: Path, request: Request, shot) -> Path:
    if request.out:
        return Path(request.out)
    slug = "-".join(re.findall(r"[a-z0-9]+", request.prompt.lower()))[:48].strip("-") or "sample"
    return run / "samples" / f"{slug}-seed{shot.seed}{'.png' if shot.frames == 1 else '.mp4'}"
