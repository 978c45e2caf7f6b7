"""Which transformers architectures map onto which llama.cpp architecture, and how their hyper-parameters and
tensors are laid out in GGUF (names from gguf-py's tables; nothing here is copied from a converter).

Checked before any weight is loaded, so an unsupported model fails in a second, naming itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rocktune.errors import UserError


@dataclass(frozen=True)
class Arch:
    gguf_name: str        # llama.cpp's architecture name
    interleaved_rope: bool  # llama.cpp rotates adjacent pairs here, HF rotates halves: q/k rows are reordered


# HF model_type -> llama.cpp arch. Mistral's dense models run on llama.cpp's llama graph.
ARCHS = {
    "qwen2": Arch("qwen2", False),
    "qwen3": Arch("qwen3", False),
    "llama": Arch("llama", True),
    "mistral": Arch("llama", True),
}


def arch_for(cfg) -> Arch:
    model_type = getattr(cfg, "model_type", "?")
    if model_type not in ARCHS:
        raise UserError(f"GGUF export does not support the {model_type} architecture yet (supported: "
                        f"{', '.join(sorted(ARCHS))}); use --to merged for a transformers model directory.")
    _check_rope(cfg)
    return ARCHS[model_type]


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def rope_params(cfg) -> dict:
    """transformers 5 keeps theta and scaling in ``rope_parameters``; 4.x in ``rope_theta`` / ``rope_scaling``."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _check_rope(cfg) -> None:
    kind = rope_params(cfg)["rope_type"]
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise UserError(f"GGUF export does not support rope scaling {kind!r} of this {cfg.model_type} model yet "
                        "(supported: none, linear, llama3, yarn); use --to merged.")


def add_hparams(writer, cfg, arch: Arch) -> None:
    import gguf

    rope = rope_params(cfg)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    writer.add_key_length(head_dim(cfg))
    writer.add_value_length(head_dim(cfg))
    writer.add_rope_dimension_count(head_dim(cfg))
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))


def extra_tensors(cfg) -> dict[str, np.ndarray]:
    """Tensors GGUF needs that the checkpoint does not hold: Llama 3.1's per-frequency rope divisors."""
    rope = rope_params(cfg)
    if rope["rope_type"] != "llama3":
        return {}
    return {"rope_freqs.weight": llama3_rope_divisors(head_dim(cfg), float(rope["rope_theta"]),
                                                      float(rope["factor"]), float(rope["low_freq_factor"]),
                                                      float(rope["high_freq_factor"]),
                                                      int(rope["original_max_position_embeddings"]))}


def llama3_rope_divisors(dim: int, theta: float, factor: float, low: float, high: float, old_ctx: int) -> np.ndarray:
    """Llama 3.1's frequency scaling as divisors of each rotary frequency: 1 for short wavelengths, ``factor`` for
    long ones, a smooth blend between (the published scheme; llama.cpp divides each frequency by this)."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def write_out(writer) -> None:
    """Header, metadata and tensors of a filled GGUFWriter, in that order, and the file closed whatever happens."""
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def tensor_namer(cfg, arch: Arch):
    """HF parameter name -> GGUF tensor name (None for what GGUF does not store)."""
    import gguf

    enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch.gguf_name)
    table = gguf.get_tensor_name_map(enum, cfg.num_hidden_layers)

    def name(hf_name: str) -> str | None:
        return table.get_name(hf_name, try_suffixes=(".weight", ".bias"))

    return name


def to_gguf_layout(gguf_name: str, data: np.ndarray, cfg, arch: Arch) -> np.ndarray:
    """Reorder q/k output rows from HF's half-split rotary layout to llama.cpp's interleaved one (llama arch)."""
    if not arch.interleaved_rope:
        return data
    if ".attn_q." in gguf_name:
        return _interleave(data, cfg.num_attention_heads)
    if ".attn_k." in gguf_name:
        return _interleave(data, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    return data


def _interleave(w: np.ndarray, n_head: int) -> np.ndarray:
    # rows of one head: [x0..x(d/2-1), y0..y(d/2-1)] -> [x0, y0, x1, y1, ...]
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
