"""Dtype names as users write them: rocktune's short ones (fp32, bf16, fp16) and torch's spellings of the same.

Every place that asks for a dtype (``training.precision``, ``export --dtype``, ``plan --precision``, a GGUF
``--quant`` of a float type) reads it through here, so ``float32`` / ``torch.bfloat16`` / ``half`` work wherever
``fp32`` / ``bf16`` / ``fp16`` do, and an unknown name is refused with the list of accepted ones.
"""

from __future__ import annotations

SHORT = ("fp32", "bf16", "fp16")
_SPELLINGS = {
    "fp32": ("fp32", "float32", "float", "f32"),
    "bf16": ("bf16", "bfloat16"),
    "fp16": ("fp16", "float16", "half", "f16"),
}
ALIASES = {alias: short for short, names in _SPELLINGS.items() for alias in names}
GGUF_FLOAT = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}  # llama.cpp's names for the float file types


def canonical(value: object) -> object:
    """The short name of a dtype spelling (``torch.float32``, ``float32``, ``FP32`` -> ``fp32``); anything else is
    returned unchanged, for the caller's own check to refuse with its list of choices."""
    if not isinstance(value, str):
        return value
    key = value.strip().lower().removeprefix("torch.")
    return ALIASES.get(key, value)


def gguf_float(value: str | None) -> str | None:
    """A GGUF ``--quant`` with float dtypes spelt as torch or rocktune spells them (float16, fp16) -> f16; quantised
    types (q8_0, q4_k_m) pass unchanged."""
    if value is None:
        return None
    short = canonical(value)
    return GGUF_FLOAT.get(short, value) if isinstance(short, str) else value
