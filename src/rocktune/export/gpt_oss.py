"""gpt-oss in llama.cpp's layout (its gpt-oss graph), for a merged (bf16 / fp32) model.

transformers keeps gpt-oss's experts as ``x @ W`` stacks, ``gate_up_proj`` (experts, hidden, 2 ff) with gate and up
interleaved column by column and ``down_proj`` (experts, ff, hidden), their biases beside; llama.cpp wants the
``W @ x`` stacks apart (gate, up, down) with their biases, and each head's attention sink as ``attn_sinks``. That is
what llama.cpp's converter writes for unquantised experts (facts read off it; released MXFP4 checkpoints are merged
in full precision by rocktune first, so their experts arrive here dequantised).
"""

from __future__ import annotations

import numpy as np

from rocktune.errors import UserError

SWIGLU_LIMIT = 7.0  # llama.cpp's gpt-oss graph clamps the expert SwiGLU at this fixed value


def to_llama_cpp(key: str, data: np.ndarray, cfg) -> list[tuple[str, np.ndarray]]:
    """One HF tensor of gpt-oss -> (name the GGUF table knows, data) pairs."""
    base = key.rsplit(".", 1)[0]
    if key.endswith("mlp.experts.gate_up_proj"):
        w = np.swapaxes(data, -1, -2)  # (experts, 2 ff, hidden), gate and up rows interleaved
        return [(f"{base}.gate_proj.weight", w[:, ::2]), (f"{base}.up_proj.weight", w[:, 1::2])]
    if key.endswith("mlp.experts.gate_up_proj_bias"):
        return [(f"{base}.gate_proj.bias", data[..., ::2]), (f"{base}.up_proj.bias", data[..., 1::2])]
    if key.endswith("mlp.experts.down_proj"):
        return [(f"{key}.weight", np.swapaxes(data, -1, -2))]
    if key.endswith("mlp.experts.down_proj_bias"):
        return [(f"{base}.down_proj.bias", data)]
    if key.endswith("self_attn.sinks"):
        return [(f"{key}.weight", data)]
    return [(key, data)]


def check(cfg) -> None:
    """Refuses what llama.cpp's gpt-oss graph computes otherwise: sliding and full layers alternate there (sliding
    first), and the expert SwiGLU is clamped at 7."""
    types = list(getattr(cfg, "layer_types", None) or [])
    want = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_hidden_layers)]
    if types and types != want:
        raise UserError(f"GGUF export does not support this gpt_oss model: its layer_types {types} do not alternate "
                        "sliding and full attention starting with sliding, as llama.cpp's gpt-oss graph does; use "
                        "--to merged.")
    limit = float(getattr(cfg, "swiglu_limit", SWIGLU_LIMIT))
    if limit != SWIGLU_LIMIT:
        raise UserError(f"GGUF export does not support this gpt_oss model: swiglu_limit is {limit}, llama.cpp's "
                        f"gpt-oss graph clamps at {SWIGLU_LIMIT}; use --to merged.")


def add_hparams(writer, cfg) -> None:
    writer.add_expert_count(int(cfg.num_local_experts))
    writer.add_expert_used_count(int(cfg.num_experts_per_tok))
    writer.add_sliding_window(int(cfg.sliding_window))
    writer.add_expert_feed_forward_length(int(cfg.intermediate_size))
