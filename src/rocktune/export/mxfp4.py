"""A base checkpoint's MXFP4 expert stacks written into the GGUF as they are, where the export's experts still hold
exactly their values.

llama.cpp's converter writes an MXFP4 checkpoint's ``<stack>_blocks`` / ``<stack>_scales`` as GGUF tensors of ggml
type MXFP4, whatever ``--outtype`` says (its gpt-oss model skips dequantisation): the checkpoint's bits, only
relaid. An export reaches this module with every tensor merged in fp32 (export/merge.py), the experts dequantised
at load (models/mxfp4.py): a stack whose values still equal its decoded blocks (the adapter left it alone) is
written from those blocks, so the file equals the converter's on the base byte for byte; a stack the merge changed
is not (export/gpt_oss.py writes it as unquantised experts: docs/moe.md says why).

The layouts, from the OCP Microscaling formats and ggml's ``block_mxfp4``: a checkpoint's 32-value block is 16
bytes, byte j holding value 2j in its low nibble and 2j + 1 in its high one, with the e8m0 exponent in ``_scales``;
ggml's block is the exponent byte, then 16 bytes whose byte j holds value j low and value j + 16 high. The 4-bit
codes (a sign bit over the e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) and the exponent byte are the same in both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


@dataclass(frozen=True)
class Packed:
    """A tensor written in ggml's MXFP4 type, from the checkpoint's ``blocks`` [experts, rows, n/32, 16] and
    ``scales`` [experts, rows, n/32]: ``data`` the bytes gguf-py's writer takes, ``values`` the same tensor as fp32
    for a file llama.cpp's quantiser makes from an f32 one (it requantises no block type). Both are made when asked:
    the packed form is what stays in memory until the file is written (4.25 bits a value, not 32)."""
    blocks: np.ndarray
    scales: np.ndarray

    @property
    def ggml_type(self) -> int:
        import gguf

        return gguf.GGMLQuantizationType.MXFP4

    @property
    def data(self) -> np.ndarray:
        return to_ggml(self.blocks, self.scales)

    @property
    def values(self) -> np.ndarray:
        return decode(self.blocks, self.scales)


def decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A checkpoint's (blocks [..., n/32, 16], scales [..., n/32]) -> fp32 rows [..., n], exactly."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    mag = E2M1[codes & 7] * np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
    return np.where(codes & 8, -mag, mag).reshape(*blocks.shape[:-2], -1)


def to_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A checkpoint's blocks and scales of [experts, rows, n/32] -> ggml's MXFP4 bytes [experts, rows, n/32 * 17]."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales[..., None], qs.astype(np.uint8)], axis=-1)
    return np.ascontiguousarray(out.reshape(*out.shape[:-2], -1))


def packed(blocks: np.ndarray, scales: np.ndarray) -> Packed:
    """One GGUF tensor of the checkpoint's rows ([experts, rows, ...]), as llama.cpp's converter writes it."""
    return Packed(blocks, scales)


def base_stack(name_or_path: str, key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The checkpoint's (blocks, scales) of the stack ``key`` (e.g. ``model.layers.0.mlp.experts.down_proj``), None
    when it does not store that stack as MXFP4 (an unquantised checkpoint, a merged directory)."""
    from safetensors import safe_open

    from rocktune.models.mxfp4 import quant_config, weight_files

    if quant_config(name_or_path) is None:
        return None
    for file in weight_files(name_or_path):
        with safe_open(str(file), framework="numpy") as f:
            names = set(f.keys())
            if f"{key}_blocks" in names and f"{key}_scales" in names:
                return f.get_tensor(f"{key}_blocks"), f.get_tensor(f"{key}_scales")
    return None  # a sharded checkpoint with the two parts in different files: written unquantised


def unchanged(stack: np.ndarray, blocks: np.ndarray, scales: np.ndarray) -> bool:
    """Whether ``stack`` (transformers' ``x @ W`` layout, [experts, in, out]) holds exactly the values of the
    checkpoint's rows (``W @ x``: [experts, out, in]); one expert at a time, to bound the copy."""
    return all(np.array_equal(stack[e].T, decode(blocks[e], scales[e])) for e in range(stack.shape[0]))


def unpacked(tensors: dict) -> dict:
    """``tensors`` with every ``Packed`` one as its fp32 values."""
    return {k: v.values if isinstance(v, Packed) else v for k, v in tensors.items()}


def file_type(tensors: dict, plain: int) -> int:
    """The file's ``general.file_type``: ``plain`` (the one ``--quant`` names), or llama.cpp's MXFP4-MoE type for a
    float file that holds packed experts, as the converter labels a float file of an MXFP4 checkpoint."""
    import gguf

    floats = (gguf.LlamaFileType.ALL_F32, gguf.LlamaFileType.MOSTLY_F16, gguf.LlamaFileType.MOSTLY_BF16)
    if plain in floats and any(isinstance(t, Packed) for t in tensors.values()):
        return int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    return plain
