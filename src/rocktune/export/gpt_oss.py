"""gpt-oss in llama.cpp's layout (its gpt-oss graph), for a merged (bf16 / fp32) model.

transformers keeps gpt-oss's experts as ``x @ W`` stacks, ``gate_up_proj`` (experts, hidden, 2 ff) with gate and up
interleaved column by column and ``down_proj`` (experts, ff, hidden), their biases beside; llama.cpp wants the
``W @ x`` stacks apart (gate, up, down) with their biases, and each head's attention sink as ``attn_sinks``. That is
what llama.cpp's converter writes for unquantised experts (facts read off it).

A base whose experts ship as MXFP4 (the released gpt-oss) arrives here dequantised, merged in fp32. A stack that
still holds exactly its checkpoint's values (the adapter did not change it) is written from the checkpoint's own
MXFP4 blocks, as the converter writes that checkpoint; a stack the merged expert LoRA changed is written as the
converter writes unquantised experts, in the file's type: requantising it to MXFP4 would round most of the change
away (export/mxfp4.py, docs/moe.md).
"""

from __future__ import annotations

import numpy as np

from rocktune.errors import UserError
from rocktune.export import mxfp4

STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
SWIGLU_LIMIT = 7.0  # llama.cpp's gpt-oss graph clamps the expert SwiGLU at this fixed value


def to_llama_cpp(key: str, data: np.ndarray, cfg) -> list[tuple[str, np.ndarray]]:
    """One HF tensor of gpt-oss -> (name the GGUF table knows, data) pairs."""
    base = key.rsplit(".", 1)[0]
    kept = _base_blocks(key, data, cfg) if key.endswith(STACKS) else None
    if kept is not None and key.endswith("gate_up_proj"):  # gate and up rows interleaved, as below
        blocks, scales = kept
        return [(f"{base}.gate_proj.weight", mxfp4.packed(blocks[:, ::2], scales[:, ::2])),
                (f"{base}.up_proj.weight", mxfp4.packed(blocks[:, 1::2], scales[:, 1::2]))]
    if kept is not None:
        return [(f"{key}.weight", mxfp4.packed(*kept))]
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


def _base_blocks(key: str, data: np.ndarray, cfg) -> tuple[np.ndarray, np.ndarray] | None:
    """The base checkpoint's MXFP4 (blocks, scales) of this expert stack when ``data`` still equals them."""
    found = mxfp4.base_stack(getattr(cfg, "_name_or_path", None) or "", key)
    return found if found is not None and mxfp4.unchanged(data, *found) else None


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
