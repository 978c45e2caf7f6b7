"""GGUF tensor types: plain floats and the block quantisations gguf-py implements are written directly; k-quants
are produced by llama.cpp's own quantiser (through llama-cpp-python), which gguf-py does not implement.

1-D tensors (norms, biases) always stay f32, as llama.cpp expects. Every check runs before any work.
"""

from __future__ import annotations

import importlib.util

import numpy as np

from rocktune.errors import UserError

# name -> (ggml type name, llama.cpp file type name, k-quant)
QUANTS = {
    "f32": ("F32", "ALL_F32", False),
    "f16": ("F16", "MOSTLY_F16", False),
    "bf16": ("BF16", "MOSTLY_BF16", False),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0", False),
    "q5_0": ("Q5_0", "MOSTLY_Q5_0", False),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0", False),
    "q6_k": ("Q6_K", "MOSTLY_Q6_K", True),
    "q5_k_m": ("Q5_K", "MOSTLY_Q5_K_M", True),
    "q4_k_m": ("Q4_K", "MOSTLY_Q4_K_M", True),
}


def check_quant(quant: str, row_lengths: dict[str, int]) -> None:
    """Refuse an unknown type, or a k-quant the shapes or the installation cannot give, before any work."""
    if quant not in QUANTS:
        raise UserError(f"--quant {quant} is not supported; choose one of {', '.join(QUANTS)}.")
    if not QUANTS[quant][2]:
        return
    import gguf

    block = gguf.GGML_QUANT_SIZES[ggml_type(quant)][0]
    bad = [f"{n} ({k})" for n, k in row_lengths.items() if k % block]
    if bad:
        raise UserError(f"--quant {quant} packs rows in blocks of {block} values, and these tensors' rows are not a "
                        f"multiple of {block}: {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}. Use q8_0, "
                        "q5_0 or q4_0 (blocks of 32) or f16 for this model.")
    if importlib.util.find_spec("llama_cpp") is None:
        raise UserError(f"--quant {quant} (a k-quant) is made by llama.cpp's quantiser, which needs "
                        "llama-cpp-python: run `make llama-cpp` (builds it into .venv), or export q8_0/q4_0.")


def ggml_type(quant: str):
    import gguf

    return gguf.GGMLQuantizationType[QUANTS[quant][0]]


def file_type(quant: str) -> int:
    import gguf

    return int(gguf.LlamaFileType[QUANTS[quant][1]])


def encode(data: np.ndarray, quant: str) -> tuple[np.ndarray, object | None]:
    """``data`` (fp32) -> (array to write, raw ggml type or None when numpy's dtype says it)."""
    import gguf

    if data.ndim < 2 or quant == "f32" or QUANTS[quant][2]:
        return data.astype(np.float32), None  # k-quants: written f32 here, quantised by llama.cpp afterwards
    if quant == "f16":
        return data.astype(np.float16), None
    qtype = ggml_type(quant)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if data.shape[-1] % block:
        return data.astype(np.float16), None  # rows that do not fill whole blocks stay f16, as llama.cpp does
    return gguf.quants.quantize(data, qtype), qtype


def llama_cpp_quantize(src: str, dst: str, quant: str) -> None:
    """Quantise the f32 GGUF ``src`` into ``dst`` with llama.cpp's own code."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = file_type(quant)
    params.nthread = 0
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)) != 0:
        raise UserError(f"llama.cpp's quantiser failed to make {quant} from {src}; see its messages above.")
