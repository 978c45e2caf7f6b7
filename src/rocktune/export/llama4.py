"""Llama 4's language model in llama.cpp's layout (its llama4 graph).

transformers keeps the routed experts as ``x @ W`` stacks (``gate_up_proj`` (experts, hidden, 2 ff), gate then up;
``down_proj`` (experts, ff, hidden)); llama.cpp wants the transposed ``W @ x`` stacks apart, as its converter writes
them. Its graph fixes what transformers reads from the config: attention in chunks of 8192 tokens, rope left out of
every 4th layer (those attend in full and scale queries by the temperature tuning of floor 8192 and scale 0.1), and
q/k L2-normalised except in the 128-expert model; a configuration that differs is refused.
"""

from __future__ import annotations

import numpy as np

from rocktune.errors import UserError

FIXED = {"attention_chunk_size": 8192, "no_rope_layer_interval": 4, "floor_scale": 8192, "attn_scale": 0.1,
         "attn_temperature_tuning": True}


def to_llama_cpp(key: str, data: np.ndarray, cfg) -> list[tuple[str, np.ndarray]]:
    base = key.rsplit(".", 1)[0]
    if key.endswith("feed_forward.experts.gate_up_proj"):
        w = np.swapaxes(data, -1, -2)  # (experts, 2 ff, hidden)
        half = w.shape[1] // 2
        return [(f"{base}.gate_proj.weight", w[:, :half]), (f"{base}.up_proj.weight", w[:, half:])]
    if key.endswith("feed_forward.experts.down_proj"):
        return [(f"{key}.weight", np.swapaxes(data, -1, -2))]
    return [(key, data)]


def check(cfg) -> None:
    for name, value in FIXED.items():
        have = getattr(cfg, name, value)
        if have != value:
            raise UserError(f"GGUF export does not support this llama4_text model: {name} is {have}, llama.cpp's "
                            f"llama4 graph fixes it at {value}; use --to merged.")
    want_norm = n_experts(cfg) != 128
    if bool(getattr(cfg, "use_qk_norm", True)) != want_norm:
        raise UserError(f"GGUF export does not support this llama4_text model: use_qk_norm is {cfg.use_qk_norm}, "
                        f"llama.cpp's llama4 graph uses {want_norm} for {n_experts(cfg)} experts; use --to merged.")


def n_experts(cfg) -> int:
    return int(getattr(cfg, "num_local_experts", 0) or 0)


def add_hparams(writer, cfg) -> None:
    writer.add_expert_count(n_experts(cfg))
    writer.add_expert_used_count(int(cfg.num_experts_per_tok))
    writer.add_interleave_moe_layer_step(int(cfg.interleave_moe_layer_step))
    writer.add_expert_feed_forward_length(int(cfg.intermediate_size))
