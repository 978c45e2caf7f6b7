"""A tiny gpt-oss checkpoint whose experts are stored as the released gpt-oss checkpoints store theirs: MXFP4.

Each expert stack is written as ``<stack>_blocks`` (uint8, two FP4 e2m1 codes a byte, the even element in the low
nibble) and ``<stack>_scales`` (uint8, one e8m0 exponent, bias 127, per 32 values along the input), rows in the
``W @ x`` layout (gate_up: [experts, 2 x width, hidden / 32, 16]; down: [experts, hidden, width / 32, 16]), and
config.json carries ``quantization_config: {quant_method: mxfp4, modules_to_not_convert: [...]}``. The encoder here
is written from the OCP Microscaling (MX) v1.0 formats: e2m1 is a sign bit and the magnitudes 0, 0.5, 1, 1.5, 2, 3,
4, 6; a block's exponent is floor(log2(max |v|)) - 2, so that the largest magnitude lands in [4, 8) and rounds to 6
at most. Every fifth block takes one more than that exponent (its values halve, its largest code is 3 or less): a
quantiser may choose so, and it makes "the same values" and "the same bytes" different claims in the tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)
STACKS = ("gate_up_proj", "down_proj")
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def encode(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., n] float rows (n a multiple of 32) -> (blocks [..., n / 32, 16] uint8, scales [..., n / 32] uint8)."""
    v = rows.astype(np.float64).reshape(*rows.shape[:-1], rows.shape[-1] // 32, 32)
    amax = np.abs(v).max(axis=-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, 0).astype(np.int64)
    exp[..., ::5] += 1  # a coarser exponent than needed on every fifth block (module docstring)
    scaled = np.abs(v) / np.exp2(exp)[..., None]
    mag = np.abs(scaled[..., None] - E2M1).argmin(axis=-1)  # nearest magnitude; ties to the smaller one
    codes = (mag | np.where((v < 0) & (mag > 0), 8, 0)).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # C order: safetensors writes an array's memory as it lies, and a swapped-axes input leaves these strided
    return np.ascontiguousarray(blocks, dtype=np.uint8), np.ascontiguousarray(exp + 127, dtype=np.uint8)


def decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(blocks, scales) -> [..., n] float64 rows: sign x magnitude x 2^(scale - 127), one nibble at a time."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    values = np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7] * np.exp2(scales.astype(np.float64) - 127)[..., None]
    return values.reshape(*blocks.shape[:-2], -1)


def stack_rows(name: str, stack: np.ndarray) -> np.ndarray:
    """transformers' ``x @ W`` stack [experts, in, out] -> the checkpoint's rows [experts, out, in]."""
    return np.swapaxes(stack, -1, -2)


def quantise_checkpoint(model_dir: Path) -> dict[str, np.ndarray]:
    """Rewrite the gpt-oss checkpoint in ``model_dir`` with MXFP4 experts, in place; returns the stacks' decoded values
    in transformers' layout (what loading must give), keyed by parameter name."""
    from safetensors.numpy import load_file, save_file

    file = model_dir / "model.safetensors"
    tensors = load_file(file)
    decoded = {}
    for key in [k for k in tensors if k.endswith(STACKS)]:
        blocks, scales = encode(stack_rows(key, tensors.pop(key)))
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
        decoded[key] = np.swapaxes(decode(blocks, scales), -1, -2)
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return decoded


def build_mxfp4_gpt_oss(out: Path, seed: int = 0) -> tuple[Path, dict[str, np.ndarray]]:
    """The family fixtures' tiny gpt-oss (hidden 64, expert width 128, 4 experts, 2 layers) with MXFP4 experts."""
    from tests.family_fixtures import BY_NAME, build_family

    build_family(BY_NAME["gpt-oss"], out, seed)
    return out, quantise_checkpoint(out)
