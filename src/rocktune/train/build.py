"""Builders of the engine's components from config values: seeds, optimizer, schedule, autocast. Flat arguments."""

from __future__ import annotations

import contextlib
import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def optimizer(params, kind: str, lr: float, weight_decay: float, device: str) -> torch.optim.Optimizer:
    if kind == "auto":
        kind = "adamw_fused" if device == "cuda" else "adamw_foreach"
    flags: dict[str, Any] = {"adamw_fused": {"fused": True}, "adamw_foreach": {"foreach": True},
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
