"""Builders: turn config values into the loop's components. Each takes flat arguments."""

from __future__ import annotations

import contextlib
import importlib.util
import random

import numpy as np
import torch

from rocktune.data.batching import collate, with_loss_index
from rocktune.data.dataset import Examples
from rocktune.data.packing import collate_packed
from rocktune.errors import UserError
from rocktune.model import apply_lora, load_model


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_collate(examples: Examples, packing: bool, pad_id: int, one_row: bool = False, pin: bool = False,
                 width: int = 0):
    """Index structure from the stream -> host tensors; ``one_row`` joins packed rows into a single row, ``pin``
    puts them in page-locked memory (faster, asynchronous copies where the platform advice allows it), ``width``
    pads packed rows to at least that many tokens (static shapes)."""
    def finish(batch):
        batch = with_loss_index(batch)
        return {k: v.pin_memory() for k, v in batch.items()} if pin else batch

    if packing:
        def collate_rows(rows):
            rows = [[i for row in rows for i in row]] if one_row else rows
            return finish(collate_packed([[(examples.input_ids[i], examples.labels[i]) for i in row] for row in rows],
                                         pad_id, 0 if one_row else width))
        return collate_rows

    def collate_idx(idx):
        return finish(collate([examples.input_ids[i] for i in idx], [examples.labels[i] for i in idx], pad_id))
    return collate_idx


def idle_batch(pad_id: int) -> dict[str, torch.Tensor]:
    """One pad token with no loss position: a rank whose share of a small step is empty still runs one forward and
    backward (zero gradient), so DDP's once-per-step all-reduce sees every rank."""
    ids = torch.tensor([[pad_id]])
    return with_loss_index({"input_ids": ids, "labels": torch.full_like(ids, -100),
                            "position_ids": torch.zeros_like(ids)})


def optimizer(params, kind: str, lr: float, weight_decay: float, device: str) -> torch.optim.Optimizer:
    if kind == "auto":
        kind = "adamw_fused" if device == "cuda" else "adamw_foreach"
    flags = {"adamw_fused": {"fused": True}, "adamw_foreach": {"foreach": True},
             "adamw_torch": {"foreach": False}}[kind]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **flags)


def scheduler(opt, kind: str, warmup: int, total: int):
    from transformers import get_scheduler

    return get_scheduler(kind if kind != "constant" else "constant_with_warmup", opt,
                         num_warmup_steps=min(warmup, total), num_training_steps=total)


def autocast(device: str, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device_type=device, dtype=dtype)


def model_with_adapter(name_or_path: str, precision: str, attn_implementation: str, trust_remote_code: bool,
                       device: str, liger_mode: str, r: int, alpha: float, dropout: float, target_modules,
                       gradient_checkpointing: bool, compile_: bool, quantization: str = "none",
                       double_quant: bool = True) -> tuple[object, list[str]]:
    """Base model on the device (quantised when asked, after ``quant_gate``), kernels patched, LoRA applied;
    returns it with notes on what was done."""
    model = load_model(name_or_path, precision, attn_implementation, trust_remote_code, device, quantization,
                       double_quant)
    notes = [n for n in (liger(model, liger_mode, device),) if n]  # patches the base, so before PEFT wraps it
    model = apply_lora(model, r, alpha, dropout, target_modules, gradient_checkpointing)
    if compile_:
        notes.append(compile_decoder(model))
    return model, notes


def liger(model, mode: str, device: str) -> str | None:
    """Patch Liger's fused RMSNorm/SwiGLU/RoPE into the model; returns a message, None when not applied."""
    available = importlib.util.find_spec("liger_kernel") is not None
    if mode == "off" or (mode == "auto" and (device != "cuda" or not available)):
        return None
    if device != "cuda":
        raise UserError("model.liger=on needs a ROCm or CUDA device (Liger kernels are Triton GPU kernels); "
                        "use model.liger=auto or off on CPU.")
    if not available:
        raise UserError("model.liger=on but liger-kernel is not installed: pip install 'rocktune[liger]'.")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    # rocktune's own chunked loss already avoids full logits, so Liger's fused cross-entropy is not needed.
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True,
                                    fused_linear_cross_entropy=False, cross_entropy=False)
    return "liger kernels applied (RMSNorm, SwiGLU, RoPE)"


def want_compile(setting, platform_sound: bool, device: str, batching: str, world: int = 1) -> bool:
    """``training.compile: auto`` compiles only where the platform knowledge calls it sound, on a GPU fed fixed-width
    token rows (few distinct shapes, so few recompilations), in one process: a rank of several cannot fall back to
    eager alone when compilation fails. true/false are taken as given."""
    if setting != "auto":
        return bool(setting)
    return platform_sound and device == "cuda" and batching in ("auto", "tokens") and world == 1


def uncompile_decoder(model) -> None:
    """Undo ``nn.Module.compile``: the module's plain forward is called again."""
    model.get_base_model().get_decoder()._compiled_call_impl = None


def compile_decoder(model) -> str:
    base = model.get_base_model()
    base.get_decoder().compile()
    return "torch.compile applied to the decoder (the first steps include compilation)"
