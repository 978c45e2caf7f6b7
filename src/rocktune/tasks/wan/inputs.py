"""The Wan task's inputs, checked before anything is written: the media
listed and assigned to buckets, the eval split, and the planner's peak for the largest bucket."""

from __future__ import annotations

import random

from rocktune.config import RunConfig
from rocktune.tasks.wan.diffusion import components, media
from rocktune.errors import UserError


def assigned(source, cfg: RunConfig, frames: list[int]) -> list[tuple[media.MediaItem, media.Bucket]]:
    diff = cfg.diffusion
    items = media.list_items(source, diff.media_field, diff.caption_field)
    return media.assign_buckets(items, diff.resolutions, frames, cfg.task)


def split(assigned: list, eval_file: str | None, eval_fraction: float, seed: int, read) -> tuple[list, list]:
    """A separate eval source, else a seeded share of the training files (at least one when a share is asked and
    at least two files exist, so that eval loss is never silently absent)."""
    if eval_file:
        return assigned, read(eval_file)
    n_eval = min(max(round(len(assigned) * eval_fraction), 1 if eval_fraction > 0 else 0), len(assigned) - 1)
    if n_eval <= 0:
        return assigned, []
    order = list(range(len(assigned)))
    random.Random(seed).shuffle(order)
    held = set(order[:n_eval])
    return [a for i, a in enumerate(assigned) if i not in held], [a for i, a in enumerate(assigned) if i in held]


def predicted_peak(cfg: RunConfig, buckets: list[media.Bucket], precision: str,
                    device_bytes: int | None) -> tuple[int | None, str]:
    """The planner's estimate for the largest bucket in use, at the configured micro batch; when it exceeds the
    device (``device_bytes``), the note says so and what gradient checkpointing would need instead."""
    from rocktune.tasks.wan.plan import WanSpec, estimate_wan, load_wan_shape

    largest = max(buckets, key=lambda b: b.width * b.height * b.frames)
    try:
        shape = load_wan_shape(cfg.model.name_or_path)
    except UserError as exc:
        return None, f"planner: no estimate ({exc})"

    def peak(checkpointing: bool):
        return estimate_wan(shape, WanSpec(largest.width, largest.height, largest.frames, cfg.training.micro_batch_size,
                                           components.PIPELINE_TEXT_TOKENS, cfg.lora.r, precision, checkpointing))

    est = peak(cfg.model.gradient_checkpointing)
    note = (f"planner: {size(est.total_bytes)} predicted peak at {largest} x{cfg.training.micro_batch_size} "
            f"({est.tokens:,} latent tokens per forward)")
    if device_bytes and est.total_bytes > device_bytes:
        note = f"warning: {note}, more than this device's {size(device_bytes)}"
        if not cfg.model.gradient_checkpointing:
            note += (f"; with model.gradient_checkpointing=true it is {size(peak(True).total_bytes)}, "
                     "set it before the run reaches its first step")
    return est.total_bytes, note


def size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
