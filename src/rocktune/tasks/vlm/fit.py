"""task=vlm's fit (``train --auto``, ``plan --task vlm``'s ``fit``): the largest resolution at which some micro-batch
fits the budget, then the fastest micro-batch and checkpointing at it, by the vision-language planner's estimate
(tasks/vlm/planner/vlm.py, which sizes one step from config.json alone). Used by the vlm task only (tasks/vlm/plan.py,
tasks/vlm/autofit.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import cast

from rocktune.errors import UserError
from rocktune.planner.shapes import ModelShape
from rocktune.tasks.vlm.planner.vlm import VisionShape, VLMEstimate, VLMSpec, estimate_vlm, facts

# --- the fit: the largest resolution, then the fastest micro-batch and checkpointing --------------------------------

# What a resolution gives one micro-batch: (max_pixels, micro_batch) -> (tokens of its longest conversation, the
# patches of each of its images, the most loss-bearing tokens of a conversation). The caller derives it from the data
# (or an assumed image) and the processor.
Sizes = Callable[[int, int], tuple[int, tuple[int, ...], int]]


def sized(base: VLMSpec, sizes: Sizes, max_pixels: int, micro_batch: int, checkpointing: bool) -> VLMSpec:
    seq, patches, loss = sizes(max_pixels, micro_batch)
    return replace(base, micro_batch=micro_batch, seq_len=seq, patches=patches, checkpointing=checkpointing,
                   loss_fraction=min(1.0, loss / max(1, seq - 1)))


@dataclass
class VLMFit:
    max_pixels: int | None  # None: the processor's own resolution (a family without pixel limits)
    micro_batch_size: int
    grad_accum: int
    gradient_checkpointing: bool
    seq_len: int  # tokens of the longest conversation at max_pixels
    image_tokens: int  # of the micro-batch's images at max_pixels
    predicted_peak_bytes: int
    total_bytes: int
    budget_bytes: int
    reasons: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Resolution:
    """The pixel limits a fit may choose from: ``max_pixels`` is the most asked for (the config's, or the processor's
    own), lowered in steps of one token's pixels (``VisionShape.factor`` squared), never below ``min_pixels``."""

    max_pixels: int
    min_pixels: int


def fit_vlm(text: ModelShape, vision: VisionShape, base: VLMSpec, sizes: Sizes, limits: Resolution | None,
            budget: tuple[int, str], global_batch: int) -> VLMFit:
    """The largest max_pixels at which some micro-batch (a divisor of ``global_batch``) with or without
    checkpointing fits ``budget`` (bytes, where the figure came from; ``MARGIN`` kept free), then the fastest
    setting at it. A resolution is worth more than speed: the micro-batch is chosen second. ``limits`` None: the
    resolution is the processor's own (Gemma 3's one size, Idefics3's/SmolVLM's longest_edge), so only the
    micro-batch and checkpointing are chosen."""
    from rocktune.planner.fit import MARGIN, throughput

    usable = int(budget[0] * (1 - MARGIN))
    unit = vision.factor**2
    micro = [d for d in range(1, max(1, global_batch) + 1) if global_batch % d == 0]

    def candidates(n: int) -> list[VLMEstimate]:
        return [estimate_vlm(text, vision, sized(base, sizes, n * unit, m, ckpt)) for m in micro
                for ckpt in (False, True)]

    def fits(n: int) -> list[VLMEstimate]:
        return [e for e in candidates(n) if e.total_bytes <= usable]

    hi, lo = (0, 0) if limits is None else (limits.max_pixels // unit, max(1, -(-limits.min_pixels // unit)))
    if hi < lo:
        given = cast(Resolution, limits)  # hi < lo only where limits were given
        raise UserError(f"data.max_pixels={given.max_pixels} is below min_pixels={given.min_pixels} (one token is "
                        f"{vision.factor}x{vision.factor} pixels); raise data.max_pixels.")
    if not fits(lo):
        smallest = min(candidates(lo), key=lambda e: e.total_bytes)
        at = ("at the processor's resolution" if limits is None else
              f"even at max_pixels={lo * unit} (the lowest above min_pixels={limits.min_pixels})")
        lower = "data.max_length" if limits is None else "data.min_pixels or data.max_length"
        raise UserError(f"{text.name} does not fit in {_gib(budget[0])} ({budget[1]}) {at} with micro-batch 1 and "
                        f"checkpointing: it needs {_gib(smallest.total_bytes)}, so a budget of at least "
                        f"{_gib(smallest.total_bytes / (1 - MARGIN))} would work. Lower {lower}, or use a smaller "
                        "model.")
    best = hi if fits(hi) else _largest(lo, hi, lambda n: bool(fits(n)))
    chosen = max(fits(best), key=throughput)
    s, vs = chosen.spec, chosen.vspec
    tokens = vs.total_patches // vision.merge**2
    setting = ("the processor's resolution" if limits is None else
               f"data.max_pixels={best * unit} (at most {best} tokens per image, {best} x "
               f"{vision.factor}x{vision.factor} pixels)")
    why = (f"{setting}, micro-batch {s.micro_batch}, checkpointing {'on' if s.checkpointing else 'off'}: the longest "
           f"conversation {s.seq_len} tokens, {tokens} image tokens in the micro-batch; needs "
           f"{_gib(chosen.total_bytes)} of {_gib(budget[0])} ({budget[1]}, {MARGIN:.0%} kept free)")
    reasons = [f"chosen: {why}", _resolution_reason(vision, limits, (best, hi), candidates, usable)]
    return VLMFit(None if limits is None else best * unit, s.micro_batch, global_batch // s.micro_batch,
                  s.checkpointing, s.seq_len, tokens, chosen.peak_allocated, chosen.total_bytes, budget[0], reasons)


def _resolution_reason(vision: VisionShape, limits: Resolution | None, chosen: tuple[int, int], candidates,
                       usable: int) -> str:
    """Why the resolution is what it is. ``chosen``: (the tokens' worth of pixels chosen, the most asked)."""
    best, hi = chosen
    if limits is None:
        return (f"the resolution is {vision.family}'s processor's (its preprocessor_config.json: "
                + ("one size for every image" if facts(vision.family).pooled else
                   "size.longest_edge, in tiles of max_image_size") + "): --auto chooses the micro-batch and "
                "checkpointing only")
    if best < hi:
        over = min(candidates(best + 1), key=lambda e: e.total_bytes)
        return (f"max_pixels={(best + 1) * vision.factor**2} (one token more per image) does not fit with any "
                f"micro-batch or checkpointing: the smallest needs {over.total_bytes / 2**20:,.1f} MiB > "
                f"{usable / 2**20:,.1f} MiB usable")
    return f"the asked max_pixels={limits.max_pixels} fits: the resolution is kept"


def _largest(lo: int, hi: int, ok) -> int:
    """The largest n in [lo, hi] with ok(n), given ok(lo) and that ok holds below any n where it holds."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
