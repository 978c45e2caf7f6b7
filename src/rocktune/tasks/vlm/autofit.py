"""``train --auto`` for task=vlm: the planner chooses data.max_pixels (Qwen's families; Gemma 3's and
Idefics3's/SmolVLM's resolution is their processor's), the micro-batch (a divisor of the global batch, which is kept)
and gradient checkpointing for the budget, from the data's own images (tasks/vlm/plan.py)."""

from __future__ import annotations

from rocktune.config import RunConfig
from rocktune.data.vision import VisionExample, VisionTokens
from rocktune.errors import UserError


def apply_fit(cfg: RunConfig, precision: str, vram_bytes: int | None, data: tuple[list[VisionExample], VisionTokens],
              device: str) -> tuple[RunConfig, list[str], int]:
    """A copy of ``cfg`` with the planner's settings, the reasons to log, and the predicted peak allocated bytes.
    ``data``: the examples as encoded at the config's pixel limits, and the processor they were encoded with."""
    from rocktune.planner.budget import detect_budget
    from rocktune.planner.report import fmt_bytes as _gib
    from rocktune.planner.vlm import VLMSpec, fit_vlm, load_vlm_shape
    from rocktune.tasks.lm.autofit import loss_chunk
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
