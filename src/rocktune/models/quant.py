"""QLoRA: a bitsandbytes-quantised base (nf4 / fp4 4-bit, int8) under the LoRA adapter, where it is sound.

The gate runs before anything is loaded: the knowledge base (``qlora`` and ``bnb_builds`` in
platform/knowledge.yaml) decides whether the installed bitsandbytes can run the mode on this arch. A refusal names
each reason, the bitsandbytes build that would work, and what the planner says the model (or a smaller one) needs
without quantisation. Loading goes through transformers' ``BitsAndBytesConfig``; PEFT's k-bit preparation then
freezes the base, keeps norms and the head in fp32 and wires input gradients for checkpointing.
"""

from __future__ import annotations

import importlib.metadata
import logging

from rocktune.errors import UserError, first_line
from rocktune.platform.advise import quant_findings
from rocktune.platform.detect import Platform


def installed_bnb() -> str | None:
    try:
        return importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return None


def gate(plat: Platform, quantization: str, model: str, precision: str, vram_bytes: int | None, max_length: int,
         lora_r: int) -> list[str]:
    """Refuse (UserError) what the knowledge says cannot run here; return the other findings as log lines."""
    if quantization == "none":
        return []
    findings = quant_findings(plat, quantization)
    refusals = [f for f in findings if f.level == "error" and f.confidence == "documented"]
    if refusals:
        fixes = list(dict.fromkeys(f.fix for f in refusals if f.fix))
        alternative = unquantised_alternative(model, precision, vram_bytes, max_length, lora_r)
        raise UserError(
            f"model.quantization={quantization} is refused on this machine ({plat.arch}, {plat.os}, torch "
            f"{plat.torch}, bitsandbytes {plat.libraries.get('bitsandbytes', 'not installed')}): "
            + "; ".join(f"{f.message} [{f.id}]" for f in refusals) + ". What works instead: " + "; ".join(fixes)
            + (f"; or without quantisation: {alternative}" if alternative else "")
            + ". Set model.quantization=none to train plain LoRA (see docs/qlora.md).")
    return [f"{quantization}: {f.level}: {f.message}" + (f" — {f.fix}" if f.fix else "") for f in findings]


def unquantised_alternative(model: str, precision: str, vram_bytes: int | None, max_length: int,
                            lora_r: int) -> str:
    """The planner's figure for LoRA in ``precision`` of this model and of the largest same-family preset that fits."""
    from rocktune.planner.estimate import GIB, RunSpec, estimate
    from rocktune.planner.fit import MARGIN
    from rocktune.planner.shapes import load_shape, presets, shape_from_config

    spec = RunSpec(micro_batch=1, seq_len=max_length, lora_r=lora_r, precision=precision, checkpointing=True)
    how = f"LoRA in {precision}, micro-batch 1, checkpointing, max_length {max_length}"
    try:
        shape = load_shape(model)
    except UserError:
        shape = None
    parts = [f"{model} needs {estimate(shape, spec).total_bytes / GIB:.1f} GiB ({how})"] if shape else []
    if vram_bytes:
        usable = vram_bytes * (1 - MARGIN)
        fits = []
        for name, cfg in presets().items():
            cand = shape_from_config(cfg, name)
            if shape is not None and (cand.model_type != shape.model_type or cand.n_params >= shape.n_params):
                continue
            need = estimate(cand, spec).total_bytes
            if need <= usable:
                fits.append((cand.n_params, name, need))
        if fits:
            _, name, need = max(fits)
            parts.append(f"{name} fits: {need / GIB:.1f} GiB of {vram_bytes / GIB:.1f} GiB ({how})")
    return "; ".join(parts)


def bnb_config(quantization: str, double_quant: bool, compute_dtype):
    """transformers' BitsAndBytesConfig for a mode; 4-bit matmuls compute in ``compute_dtype`` (the precision)."""
    from transformers import BitsAndBytesConfig

    quiet_bnb()
    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantization,
                              bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=compute_dtype)


def check_installed(quantization: str) -> None:
    """Before loading: bitsandbytes must import (a build without this machine's library fails here, not later)."""
    if installed_bnb() is None:
        raise UserError(f"model.quantization={quantization} needs bitsandbytes >= 0.50, which is not installed: "
                        "pip install 'rocktune[qlora]' (see docs/qlora.md for the ROCm builds).")
    quiet_bnb()
    try:
        import bitsandbytes  # noqa: F401 -- imported to prove it loads here (its native library)
    except (ImportError, OSError, RuntimeError) as exc:
        raise UserError(f"bitsandbytes is installed but does not load here: {first_line(exc, 300)}. "
                        "Run `rocktune doctor` for the bitsandbytes build this platform needs.") from None


def prepare(model, gradient_checkpointing: bool):
    """PEFT's k-bit preparation: base frozen, non-quantised weights (norms, embeddings, head) in fp32, and with
    checkpointing the non-reentrant variant (it needs no input-gradient hook)."""
    from peft import prepare_model_for_kbit_training

    for module in model.modules():
        # bitsandbytes 0.50 on AVX512-BF16 CPUs repacks 4-bit weights for inference at the first eval-mode forward,
        # for good: training after an eval pass then fails ("a view of a leaf Variable ... in-place operation").
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing,
                                           gradient_checkpointing_kwargs={"use_reentrant": False})


def quiet_bnb() -> None:
    """bitsandbytes logs an optional CPU kernel it could not fetch and the fp16 cast of int8 inputs on every
    matmul; neither is the user's to fix (the int8 cast is said once, by the gate's info finding)."""
    for name in ("bitsandbytes.backends.cpu.ops", "bitsandbytes.autograd._functions"):
        logging.getLogger(name).setLevel(logging.ERROR)
