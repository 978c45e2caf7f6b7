"""Resolve the ``auto`` fields of a run for the machine at hand.

Called before the model is built, with the platform snapshot taken when the environment advice was applied
(train/context.py); without one it applies the advice itself while the device is still untouched. Returns concrete
choices plus messages that explain each one.

``precision: auto`` follows the arch's precision policy from the knowledge base, then proves it on the device:
a failed bf16 conversion or matmul self-test falls back (fp16 where the arch has fp16 units, else fp32).
``torch.cuda.is_bf16_supported()`` is not consulted: it returns True on every ROCm device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rocktune.errors import UserError
from rocktune.platform.advise import Advice, advise
from rocktune.platform.detect import Platform

_DTYPE = {"bf16": "bfloat16", "fp16": "float16"}


@dataclass
class AutoChoices:
    device: str  # "cpu" or "cuda" (ROCm builds of torch also say "cuda")
    precision: str  # "fp32" | "bf16" | "fp16"
    attn_implementation: str  # "sdpa" | "eager" | "flash_attention_2"
    messages: list[str] = field(default_factory=list)
    num_workers: int = 0
    pin_memory: bool = False
    compile: bool = False
    grad_scaler: bool = False  # True with fp16
    warnings: list[str] = field(default_factory=list)  # error/warning findings for this platform


def resolve_auto(device: str, precision: str, attn_implementation: str, *, self_test: bool = True,
                 platform: Platform | None = None) -> AutoChoices:
    """Turn ``auto`` values into concrete ones; values that are not ``auto`` pass through unchanged."""
    import torch

    messages: list[str] = []
    plat = platform
    if plat is None and not torch.cuda.is_initialized():  # the caller did not: do it while the device is untouched
        from rocktune.platform.environment import prepare_environment

        plat, messages = prepare_environment()
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("training.device=cuda but this torch build sees no GPU "
                        f"(torch {torch.__version__}, hip {torch.version.hip}, cuda {torch.version.cuda}); "
                        "install the ROCm/CUDA build for your GPU (rocktune doctor tells which) or use device=cpu.")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        messages.append(f"device auto -> {device}")
    plat = _platform_for(device, plat)
    advice = advise(plat)
    if precision == "auto":
        precision = advice.defaults.precision
        messages.append(f"precision auto -> {precision} ({advice.reasons['precision']})")
        if device != "cpu" and precision != "fp32" and self_test:
            precision = _proven_precision(device, precision, advice, messages)
    elif device != "cpu" and precision != "fp32" and advice.defaults.precision == "fp32":
        messages.append(f"warning: {precision} requested on {advice.arch}, whose policy is fp32 "
                        f"({advice.reasons['precision']})")
    if attn_implementation == "auto":
        attn_implementation = advice.defaults.attn_implementation
        messages.append(f"attn_implementation auto -> {attn_implementation} ({advice.reasons['attn_implementation']})")
    warnings = [f"{f.level}: {f.message}" + (f" — fix: {f.fix}" if f.fix else "")
                for f in advice.findings if f.level in ("error", "warning")]
    d = advice.defaults
    return AutoChoices(device=device, precision=precision, attn_implementation=attn_implementation,
                       messages=messages + warnings, num_workers=d.num_workers, pin_memory=d.pin_memory,
                       compile=d.compile, grad_scaler=precision == "fp16", warnings=warnings)


def _platform_for(device: str, plat: Platform | None) -> Platform:
    """The platform as the chosen device sees it: on CPU no GPU arch applies; on a GPU ask torch (env is set)."""
    from rocktune.platform.detect import torch_devices, detect

    if plat is None:
        plat = detect("passive")
    if device == "cpu":
        return dataclasses.replace(plat, devices=[])
    index = int(device.split(":")[1]) if ":" in device else 0
    devices = [d for d in torch_devices() if d.index == index] or plat.devices[index:index + 1]
    return dataclasses.replace(plat, devices=devices, probe="device")


def _proven_precision(device: str, precision: str, advice: Advice, messages: list[str]) -> str:
    """Run the conversion and matmul self-tests for ``precision``; fall back while they fail."""
    from rocktune.doctor.checks import check_conversion, check_matmul

    tried: list = []
    for candidate in dict.fromkeys([precision, advice.fallback_precision, "fp32"]):
        if candidate == "fp32":
            break
        dt = _DTYPE[candidate]
        results = [check_conversion(device, "float32", dt), check_conversion(device, dt, "float32"),
                   check_matmul(device, dt)]
        failed = [r.detail for r in results if r.status == "fail"]
        if not failed:
            if tried:
                messages.append(f"precision {candidate}: its self-test passed")
            return candidate
        tried.append(candidate)
        messages.append(f"precision {candidate} failed its self-test on {device} ({failed[0]}): falling back")
    messages.append("precision -> fp32 (no lower precision passed its self-test)")
    return "fp32"
