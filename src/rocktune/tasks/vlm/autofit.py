"""``train --auto`` for task=vlm: the planner chooses data.max_pixels (Qwen's families; Gemma 3's and
Idefics3's/SmolVLM's resolution is their processor's), the micro-batch (a divisor of the global batch, which is kept)
and gradient checkpointing for the budget, from the data's own images (tasks/vlm/plan.py). Also how a step is cut
into forwards (``plan_feeding``: training.batching and, for tokens, micro_batch_tokens)."""

from __future__ import annotations

import dataclasses
import math

from rocktune.config import RunConfig
from rocktune.data.encode import IGNORE
from rocktune.tasks.vlm.data.vision import VisionExample, VisionTokens
from rocktune.errors import UserError
from rocktune.tasks.causal.feed import Feeding, rows_per_step, token_rows


def apply_fit(cfg: RunConfig, precision: str, vram_bytes: int | None, data: tuple[list[VisionExample], VisionTokens],
              device: str) -> tuple[RunConfig, list[str], int]:
    """A copy of ``cfg`` with the planner's settings, the reasons to log, and the predicted peak allocated bytes.
    ``data``: the examples as encoded at the config's pixel limits, and the processor they were encoded with."""
    from rocktune.planner.budget import detect_budget
    from rocktune.planner.report import fmt_bytes as _gib
    from rocktune.tasks.vlm.planner.vlm import VLMSpec, load_vlm_shape
    from rocktune.tasks.vlm.fit import fit_vlm
    from rocktune.tasks.causal.autofit import loss_chunk
    from rocktune.tasks.vlm.plan import DataSizes, from_examples, resolution

    if cfg.lora.vision != "none":
        raise UserError(f"--auto plans the vision tower frozen; with lora.vision={cfg.lora.vision} set data.max_pixels "
                        "and training.micro_batch_size yourself, or drop --auto.")
    examples, vision = data
    t, d = cfg.training, cfg.data
    text, shape = load_vlm_shape(cfg.model.name_or_path)
    limits = resolution(vision)  # None: the processor's own (Gemma 3, Idefics3, SmolVLM): micro-batch only
    sizes = DataSizes(from_examples(examples, vision), vision, (d.max_length, limits.min_pixels if limits else 0),
                      shape)
    if vram_bytes:
        budget = (vram_bytes, "given")
    else:
        found, _, source = detect_budget()
        budget = (found, source)
    on_gpu = device != "cpu"
    base = VLMSpec(lora_r=cfg.lora.r, precision=precision, device="gpu" if on_gpu else "cpu",
                   loss_chunk=loss_chunk(t.loss_chunk_size, device))
    fit = fit_vlm(text, shape, base, sizes, limits, budget, t.micro_batch_size * t.grad_accum)
    fitted = cfg.model_copy(deep=True)
    # the asked resolution fits: the config's value (or its absence) is kept
    if limits and fit.max_pixels < limits.max_pixels:
        fitted.data.max_pixels = fit.max_pixels
    fitted.training.micro_batch_size = fit.micro_batch_size
    fitted.training.grad_accum = fit.grad_accum
    fitted.model.gradient_checkpointing = fit.gradient_checkpointing
    pixels = f"data.max_pixels={fit.max_pixels} " if limits else ""
    chosen = (f"--auto: {pixels}micro_batch_size={fit.micro_batch_size} "
              f"grad_accum={fit.grad_accum} gradient_checkpointing={fit.gradient_checkpointing}: needs "
              f"{_gib(fit.total_bytes)} of the {_gib(fit.budget_bytes)} budget ({_gib(fit.predicted_peak_bytes)} peak "
              f"allocated, the figure the run measures, + {_gib(fit.total_bytes - fit.predicted_peak_bytes)} "
              "allocator overhead and device context)")
    # The planner's own "chosen:" line states the same choice: one figure, said once.
    return fitted, [chosen, *fit.reasons[1:]], fit.predicted_peak_bytes


# --- training.batching: tokens -------------------------------------------------------------------------------------


def plan_feeding(cfg: RunConfig, device: str, precision: str, examples: list[VisionExample],
                 vram_bytes: int | None) -> tuple[Feeding, list[str], int | None]:
    """How task=vlm cuts its steps into forwards (tasks/vlm/feed.py), the lines to log, and the planner's predicted
    peak when it sized the forwards. ``batching: auto`` stays ``examples`` on every device: token batching was not
    measured against it for vision-language runs on a GPU, so the default is not changed without that measurement."""
    t, d = cfg.training, cfg.data
    mode = "tokens" if t.batching == "tokens" else "examples"
    feeding = Feeding(mode=mode, micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum,
                      max_length=d.max_length, packing=d.packing, seed=t.seed, batch_order=d.batch_order)
    if mode == "examples":
        why = " (auto: examples for task=vlm on every device)" if t.batching == "auto" else ""
        return feeding, [feeding.describe() + why], None
    lengths = [len(e.input_ids) for e in examples]
    cap = rows_per_step(lengths, feeding.examples_per_step, d.max_length)
    rows, peak, notes = token_rows(t.micro_batch_tokens, d.max_length, device, cap,
                                   lambda: _planned_rows(cfg, precision, examples, vram_bytes, cap))
    feeding = dataclasses.replace(feeding, rows_per_forward=rows)
    return feeding, [feeding.describe(), *notes], peak


def densest(examples: list[VisionExample], tokens: int) -> tuple[int, ...]:
    """The patches of each image of the most image-dense conversations that fill ``tokens`` (the last one taken whole,
    so it may overfill): more than any forward of that many tokens can hold, whatever the packer puts together. A
    Qwen grid is (t, h, w) patches before the merge."""
    ranked = sorted(examples, key=lambda e: e.image_tokens / max(1, len(e.input_ids)), reverse=True)
    out: list[int] = []
    for e in ranked:
        if tokens <= 0:
            break
        out += [math.prod(g) for g in e.grids]
        tokens -= len(e.input_ids)
    return tuple(out)


def _planned_rows(cfg: RunConfig, precision: str, examples: list[VisionExample], vram_bytes: int | None,
                  cap: int) -> tuple[int, int | None, str]:
    """``micro_batch_tokens: auto`` on a GPU: the most rows of max_length (at most ``cap``) whose forward the vlm
    planner fits in the budget with its headroom. Conservative twice over, and said so: every forward is assumed to
    carry the data's most image-dense conversations (the vision tower's pixels and activations), and the language
    model is sized as SDPA with a materialised mask (varlen attention keeps none)."""
    from rocktune.planner.budget import detect_budget
    from rocktune.planner.fit import MARGIN
    from rocktune.tasks.vlm.planner.vlm import VLMSpec, estimate_vlm, load_vlm_shape
    from rocktune.tasks.causal.autofit import FALLBACK_TOKENS, loss_chunk

    d = cfg.data
    try:
        text, shape = load_vlm_shape(cfg.model.name_or_path)
    except Exception as exc:  # noqa: BLE001 -- a model the planner cannot size still trains, on a fixed budget
        rows = max(1, min(cap, FALLBACK_TOKENS // d.max_length))
        return rows, None, (f"micro_batch_tokens auto: the vlm planner cannot size this model ({exc}); using {rows} "
                            "rows — set training.micro_batch_tokens to use more of the device")
    if vram_bytes:
        budget, source = vram_bytes, "given"
    else:
        budget, _, source = detect_budget()
    usable = int(budget * (1 - MARGIN))
    share = max(sum(x != IGNORE for x in e.labels[1:]) / max(1, len(e.input_ids) - 1) for e in examples)
    base = VLMSpec(seq_len=d.max_length, lora_r=cfg.lora.r, precision=precision, device="gpu",
                   checkpointing=cfg.model.gradient_checkpointing, loss_fraction=min(1.0, share), padded=True,
                   loss_chunk=loss_chunk(cfg.training.loss_chunk_size, "cuda"))

    def estimate(rows: int):
        return estimate_vlm(text, shape, dataclasses.replace(base, micro_batch=rows,
                                                             patches=densest(examples, rows * d.max_length)))

    fitting = [e for e in (estimate(r) for r in range(1, cap + 1)) if e.total_bytes <= usable]
    if not fitting:
        need = estimate(1).total_bytes
        raise UserError(f"one packed row of data.max_length={d.max_length} with the data's most image-dense "
                        f"conversations needs {need / 2**30:.2f} GiB of the {budget / 2**30:.2f} GiB budget "
                        f"({source}, {MARGIN:.0%} kept free): lower data.max_length or data.max_pixels, turn on "
                        "model.gradient_checkpointing, or use training.batching: examples.")
    chosen = fitting[-1]
    rows = chosen.vspec.micro_batch
    held = " (all a step holds)" if rows == cap else ""
    return rows, chosen.peak_allocated, (
        f"micro_batch_tokens auto: {rows} rows of {d.max_length}{held}, {len(chosen.vspec.patches)} images of the "
        f"data's most image-dense conversations a forward, need {chosen.total_bytes / 2**30:.2f} GiB of "
        f"{budget / 2**30:.2f} GiB ({source}, {MARGIN:.0%} kept free); sized by the vlm planner as SDPA with a "
        "materialised mask, so a varlen run has room to spare")
