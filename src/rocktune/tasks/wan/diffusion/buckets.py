"""Resolution and frame-count buckets: which shapes the Wan VAE and transformer accept, and which bucket a file takes.

Wan's VAE downsamples each side by its spatial factor (8) and the transformer patches latents by 2, so a side must
be a multiple of 16 (32 for the Wan 2.2 TI2V-5B VAE, factor 16). In time the VAE keeps the first frame and folds
each following group of 4 into one latent frame, so a clip has 4k+1 frames (1, 5, 9, 17, 33, 49, 81).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rocktune.errors import UserError


@dataclass(frozen=True)
class Bucket:
    """The shape a file is resized, cropped and trimmed to: every file in a batch shares one bucket."""

    width: int
    height: int
    frames: int

    def __str__(self) -> str:
        return f"{self.width}x{self.height}x{self.frames}"


def frame_buckets(frames: Sequence[int], task: str) -> list[int]:
    """The frame counts in use, ascending: image-lora trains on single frames whatever diffusion.frames says (its
    default is a video length), so images need no config change."""
    return [1] if task == "image-lora" else sorted(set(frames))


def check_buckets(resolutions: Sequence[Sequence[int]], frames: Sequence[int], spatial_multiple: int,
                  temporal_factor: int, task: str) -> None:
    """Raise one UserError listing every bucket the model cannot take, with the nearest valid values.

    ``spatial_multiple`` is the VAE's spatial factor times the transformer's patch size; ``temporal_factor`` is the
    VAE's temporal compression. For task ``image-lora`` diffusion.frames is not checked: it is treated as [1].
    """
    problems = [_resolution_problem(int(w), int(h), spatial_multiple) for w, h in resolutions]
    if not resolutions:
        problems.append("diffusion.resolutions is empty; list at least one [width, height], e.g. [[832, 480]]")
    if task != "image-lora":
        problems += [_frames_problem(int(f), temporal_factor) for f in frames]
        if not frames:
            problems.append(f"diffusion.frames is empty; list at least one {temporal_factor}k+1 count, e.g. [33]")
    problems = [p for p in problems if p]
    if problems:
        raise UserError("; ".join(problems) + ".")


def _resolution_problem(width: int, height: int, multiple: int) -> str:
    if width % multiple == 0 and height % multiple == 0:
        return ""
    return (f"diffusion.resolutions: {width}x{height} has a side that is not a multiple of {multiple} (the VAE's "
            f"spatial factor times the transformer's patch size); the nearest valid size is "
            f"{_nearest_multiple(width, multiple)}x{_nearest_multiple(height, multiple)}")


def _nearest_multiple(value: int, multiple: int) -> int:
    return max(multiple, (value + multiple // 2) // multiple * multiple)


def _frames_problem(count: int, factor: int) -> str:
    if count % factor == 1 % factor:
        return ""
    below = (count - 1) // factor * factor + 1
    return (f"diffusion.frames: {count} is not {factor}k+1 (the VAE keeps the first frame and compresses each "
            f"{factor} after it into one latent frame); use {below} or {below + factor}")


def nearest_resolution(width: int, height: int, resolutions: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The bucket closest in aspect ratio (distance of log-ratios, so 2:1 and 1:2 are equally far from 1:1); the
    first listed wins a tie, so the choice never depends on set order."""
    ratio = math.log(width / height)
    best = min(range(len(resolutions)), key=lambda i: (abs(math.log(resolutions[i][0] / resolutions[i][1]) - ratio), i))
    return int(resolutions[best][0]), int(resolutions[best][1])


# A file is resized to cover its bucket and centre-cropped (ImageOps.fit). Past these factors what is trained on is
# mostly invented pixels (a 1x1 image becomes a flat colour) or a sliver of the file (a 1000x10 strip in a 512x512
# bucket keeps 1% of it): the file is named and refused rather than trained on without a word.
MAX_UPSCALE = 4.0  # bucket side / file side
MAX_CROP = 4.0  # file's aspect ratio / bucket's (either way): more than three quarters cropped away


def degenerate(width: int, height: int, bucket: Bucket) -> str | None:
    """Why a ``width`` x ``height`` file cannot fairly fill ``bucket``, or None."""
    upscale = max(bucket.width / width, bucket.height / height)
    if upscale > MAX_UPSCALE:
        return (f"is {width}x{height} pixels, far below its bucket {bucket.width}x{bucket.height} (it would be "
                f"enlarged {upscale:.0f}x, more than {MAX_UPSCALE:.0f}x); use a larger file, add a smaller size to "
                "diffusion.resolutions, or remove it")
    crop = (width / height) / (bucket.width / bucket.height)
    crop = max(crop, 1 / crop)
    if crop > MAX_CROP:
        return (f"is {width}x{height} pixels, an aspect ratio so far from its nearest bucket {bucket.width}x"
                f"{bucket.height} that cropping would keep {100 / crop:.0f}% of it; crop it yourself, add a "
                "resolution of that shape to diffusion.resolutions, or remove it")
    return None


def frames_for(available: int, buckets: Sequence[int]) -> int | None:
    """The largest frame bucket a clip of ``available`` frames fills from its start; None if it fills none."""
    fitting = [f for f in buckets if f <= available]
    return max(fitting) if fitting else None
