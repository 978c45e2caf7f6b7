"""``train --auto``: let the planner choose micro-batch, accumulation, checkpointing and length for the budget."""

from __future__ import annotations

from rocktune.config import RunConfig


def apply_fit(cfg: RunConfig, precision: str, attn_implementation: str, vram_bytes: int | None
              ) -> tuple[RunConfig, list[str], int]:
    """A copy of ``cfg`` with the planner's settings, the reasons to log, and the predicted peak allocated bytes.
    The global batch is kept."""
    from rocktune.planner import suggest_settings

    t = cfg.training
    sug = suggest_settings(cfg.model.name_or_path, vram_bytes, cfg.data.max_length, cfg.lora.r,
                           cfg.lora.target_modules, precision, attn_implementation,
                           t.micro_batch_size * t.grad_accum, loss_mode=t.loss_impl, lora_dropout=cfg.lora.dropout)
    fitted = cfg.model_copy(deep=True)
    fitted.training.micro_batch_size = sug.micro_batch_size
    fitted.training.grad_accum = sug.grad_accum
    fitted.model.gradient_checkpointing = sug.gradient_checkpointing
    fitted.data.max_length = sug.max_length
    chosen = (f"--auto: micro_batch_size={sug.micro_batch_size} grad_accum={sug.grad_accum} "
              f"gradient_checkpointing={sug.gradient_checkpointing} max_length={sug.max_length} "
              f"(predicted peak {sug.predicted_peak_bytes / 2**30:.2f} GiB of {sug.budget_bytes / 2**30:.2f} GiB)")
    return fitted, [chosen, *sug.reasons], sug.predicted_peak_bytes


def oom_advice(model: str, max_length: int, lora_r: int, target_modules, precision: str, attn_implementation: str,
               global_batch: int, loss_impl: str) -> str:
    from rocktune.planner import describe_fit

    try:
        return describe_fit(model, None, max_length, lora_r, target_modules, precision, attn_implementation,
                            global_batch, loss_impl)
    except Exception as exc:  # the planner may not know this architecture; the OOM message must still go out
        return f"(rocktune plan could not size this model: {exc})"
