"""``train --auto``: let the planner choose micro-batch, accumulation, checkpointing and length for the budget."""

from __future__ import annotations

import dataclasses

from rocktune.kernels.attention import VARLEN
from rocktune.config import RunConfig
from rocktune.data.flat import cu_slots, flat_width
from rocktune.errors import UserError
from rocktune.tasks.causal.feed import Feeding, resolve_mode, rows_per_step, token_rows


def apply_fit(cfg: RunConfig, precision: str, attn_implementation: str, vram_bytes: int | None
              ) -> tuple[RunConfig, list[str], int]:
    """A copy of ``cfg`` with the planner's settings, the reasons to log, and the predicted peak allocated bytes.
    The global batch is kept."""
    import torch

    from rocktune.planner import suggest_settings

    t = cfg.training
    on_gpu = t.device != "cpu" and torch.cuda.is_available()  # what resolve_auto decides, for the overheads
    sug = suggest_settings(cfg.model.name_or_path, vram_bytes, planner_spec(cfg, precision, attn_implementation),
                           t.micro_batch_size * t.grad_accum, device="gpu" if on_gpu else "cpu")
    fitted = cfg.model_copy(deep=True)
    fitted.model.quantization = sug.quant  # type: ignore[assignment]  # the planner proposes config values; nf4 only when the planner proposed it: nothing else fits
    fitted.training.micro_batch_size = sug.micro_batch_size
    fitted.training.grad_accum = sug.grad_accum
    fitted.model.gradient_checkpointing = sug.gradient_checkpointing
    fitted.data.max_length = sug.max_length
    rank = ""
    if sug.lora_r and sug.lora_r != cfg.lora.r:  # an MoE model's expert adapters did not fit: alpha/r is kept
        fitted.lora.r, fitted.lora.alpha = sug.lora_r, cfg.lora.alpha * sug.lora_r / cfg.lora.r
        rank = f"lora.r={fitted.lora.r} lora.alpha={fitted.lora.alpha:g} "
    chosen = (f"--auto: {'model.quantization=nf4 ' if sug.quant != cfg.model.quantization else ''}{rank}"
              f"micro_batch_size={sug.micro_batch_size} grad_accum={sug.grad_accum} "
              f"gradient_checkpointing={sug.gradient_checkpointing} max_length={sug.max_length}: needs "
              f"{_gib(sug.total_bytes)} of the {_gib(sug.budget_bytes)} budget ({_gib(sug.predicted_peak_bytes)} peak "
              f"allocated, the figure the run measures, + {_gib(sug.total_bytes - sug.predicted_peak_bytes)} "
              "allocator overhead and device context)")
    # The planner's own "chosen:" line states the same choice with the total alone: one figure, said once.
    return fitted, [chosen, *[x for x in sug.reasons if not x.startswith("chosen:")]], sug.predicted_peak_bytes


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def planner_spec(cfg: RunConfig, precision: str, attn_implementation: str, **changes):
    """The planner's description of this run (``planner.RunSpec``); ``changes`` set the fields a question varies."""
    from rocktune.planner import RunSpec

    from rocktune.kernels.attention import VARLEN, repeats_kv

    m, lora = cfg.model, cfg.lora
    if attn_implementation == VARLEN:
        changes.setdefault("kv_copies", repeats_kv())
    return RunSpec(seq_len=cfg.data.max_length, lora_r=lora.r, targets=lora.target_modules, precision=precision,  # type: ignore[arg-type]  # any sequence
                   attn=_planner_attn(attn_implementation), lora_dropout=lora.dropout, loss_mode=cfg.training.loss_impl,
                   quant=m.quantization, double_quant=m.double_quant, **changes)


def _planner_attn(attn_implementation: str) -> str:
    """rocktune's varlen attention is sized by what it saves (planner/varlen.py); flex attention keeps no dense mask
    but is sized as SDPA, which errs on the large side."""
    from rocktune.kernels.attention import VARLEN

    if attn_implementation == VARLEN:
        return "varlen"
    return attn_implementation if attn_implementation in ("sdpa", "eager", "flash_attention_2") else "sdpa"


def oom_advice(cfg: RunConfig, precision: str, attn_implementation: str) -> str:
    from rocktune.planner import describe_fit

    t = cfg.training
    try:
        return describe_fit(cfg.model.name_or_path, None, planner_spec(cfg, precision, attn_implementation),
                            t.micro_batch_size * t.grad_accum)
    except Exception as exc:  # noqa: BLE001 -- the planner may not know this architecture; the OOM message must go out
        return f"(rocktune plan could not size this model: {exc})"


# Loss positions per head + cross-entropy chunk when `training.loss_chunk_size: auto`: 256 rows was measured
# fastest on the CPU; a GPU wants few large head matmuls (2048 x vocab fp32 logits: 1.2 GiB at Qwen's 152k vocab).
LOSS_CHUNK = {"cpu": 256, "cuda": 2048}


def loss_chunk(setting, device: str) -> int:
    return setting if isinstance(setting, int) else LOSS_CHUNK[device]


def choose_parallel(cfg: RunConfig, world: int, device: str, precision: str, attn_implementation: str,
                    vram_bytes: int | None) -> tuple[str, list[str]]:
    """``training.parallel: auto``: DDP (fastest for LoRA) unless the planner says one packed row does not fit a
    device with the base replicated but does with the decoder layers sharded over the ranks."""
    chosen = cfg.training.parallel
    if world == 1 or chosen != "auto":
        return chosen if chosen != "auto" else "ddp", []
    if device != "cuda" or cfg.model.quantization != "none":
        return "ddp", ["parallel auto -> ddp"]
    if _fits(cfg, precision, attn_implementation, vram_bytes, world, "ddp") or \
            not _fits(cfg, precision, attn_implementation, vram_bytes, world, "fsdp"):
        return "ddp", ["parallel auto -> ddp (the base fits each device)"]
    return "fsdp", [f"parallel auto -> fsdp: the base does not fit one device replicated, but does sharded over "
                    f"{world} ranks (rocktune plan --nproc {world} --parallel fsdp)"]


def _fits(cfg: RunConfig, precision: str, attn_implementation: str, vram_bytes: int | None, ranks: int,
          parallel: str) -> bool:
    from rocktune.planner import suggest_token_budget

    try:
        suggest_token_budget(cfg.model.name_or_path, vram_bytes, _budget_spec(cfg, precision, attn_implementation,
                                                                               ranks, parallel), 1)
        return True
    except UserError:
        return False
    except Exception:  # noqa: BLE001 -- a model the planner cannot size: the replicated default
        return True


def plan_feeding(cfg: RunConfig, choices, lengths: list[int], vram_bytes: int | None, static_width: bool,
                 ranks: int = 1, parallel: str = "ddp", attn: str | None = None
                 ) -> tuple[Feeding, list[str], int | None]:
    """How this run cuts its steps into forwards (see ``tasks/causal/feed.py``), the reasons to log, and the planner's
    predicted peak when it chose the token budget. ``choices``: the resolved device, precision and attention;
    ``attn``: the attention the model loads with, when already chosen (varlen is sized by what it saves);
    ``static_width``: the run compiles (rows padded to max_length)."""
    t, d = cfg.training, cfg.data
    device, precision, attn_implementation = choices.device, choices.precision, attn or choices.attn_implementation
    mode = resolve_mode(t.batching, device)
    feeding = Feeding(mode=mode, micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum,
                      max_length=d.max_length, packing=d.packing, seed=t.seed, batch_order=d.batch_order)
    if mode == "examples":
        why = " (auto: small forwards are fastest on a CPU)" if t.batching == "auto" else ""
        return feeding, [feeding.describe() + why], None
    cap = rows_per_step(lengths, feeding.examples_per_step, d.max_length)
    rows, peak, notes = token_rows(t.micro_batch_tokens, d.max_length, device, cap, lambda: _planned_rows(
        cfg, (precision, attn_implementation, static_width), vram_bytes, cap, ranks, parallel))
    feeding = dataclasses.replace(feeding, rows_per_forward=rows, static_width=static_width)
    if attn == VARLEN:  # varlen reads document bounds, not rows: the same token budget as one flat row
        width = flat_width(rows * d.max_length, d.max_length)
        feeding = dataclasses.replace(feeding, flat_width=width, cu_slots=cu_slots(lengths, width))
    return feeding, [feeding.describe(), *notes], peak


def _budget_spec(cfg: RunConfig, precision: str, attn_implementation: str, ranks: int, parallel: str,
                 compiled: bool = False):
    """A token budget is asked for the run's own checkpointing, GPU loss chunk and compilation."""
    return planner_spec(cfg, precision, attn_implementation, checkpointing=cfg.model.gradient_checkpointing,
                        loss_chunk=loss_chunk(cfg.training.loss_chunk_size, "cuda"), ranks=ranks, parallel=parallel,
                        compiled=compiled)


def _planned_rows(cfg: RunConfig, run: tuple[str, str, bool], vram_bytes: int | None,
                  cap: int, ranks: int, parallel: str) -> tuple[int, int | None, str]:
    """``run``: (precision, attention, compiled)."""
    from rocktune.planner import suggest_token_budget

    try:
        precision, attn_implementation, compiled = run
        plan = suggest_token_budget(cfg.model.name_or_path, vram_bytes, _budget_spec(
            cfg, precision, attn_implementation, ranks, parallel, compiled), cap)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 -- a model the planner cannot size still trains, on a fixed budget
        rows = max(1, min(cap, FALLBACK_TOKENS // cfg.data.max_length))
        return rows, None, (f"micro_batch_tokens auto: the planner cannot size this model ({exc}); using {rows} "
                            f"rows — set training.micro_batch_tokens to use more of the device")
    return plan.rows, plan.predicted_peak_bytes, f"micro_batch_tokens auto: {plan.reason}"


FALLBACK_TOKENS = 8192
