"""Granite 4 (transformers' ``granitemoehybrid``: Mamba2 + attention layers, MoE with a shared MLP) in llama.cpp's
layout (its granitehybrid graph).

What llama.cpp's loader and its converter expect (facts read off them, not their code): a layer is recurrent where
its KV head count is 0, so ``head_count_kv`` is a per-layer array; rope is switched on by ``rope.scaling.finetuned``
(the released hybrids have none: their context is written as 2^20, unbounded); Mamba2's A is stored as -exp(A_log)
and, like D, as a column (heads x 1); dt_bias is the bias of a dt projection; the conv kernel drops its unit axis;
the gated norm is one row per group. The experts become ffn_{gate,up,down}_exps (gate then up in the fused rows),
the shared MLP ffn_{gate,up,down}_shexp (plain ffn_{gate,up,down} without experts); q/k rows are interleaved for
llama.cpp's pairwise rotation, whether or not rope runs, as the converter writes them.

transformers 5 saves the layer kinds as ``linear_attention`` / ``full_attention``; the released checkpoints (and
llama.cpp's converter, which reads only these) say ``mamba`` / ``attention``. Both are read here. A Granite 4 without
Mamba layers (granite-4.0-micro) goes to llama.cpp's granite (dense) or granitemoe graph with the same tensors and
keys (the Mamba sizes included, as the converter writes them), rope on.
"""

from __future__ import annotations

import math

import numpy as np

from rocktune.errors import UserError

RECURRENT = ("mamba", "linear_attention")
ATTENTION = ("attention", "full_attention")
UNBOUNDED_CONTEXT = 2 ** 20  # what the converter writes for a model without positions


def recurrent_layers(cfg) -> list[bool]:
    return [t in RECURRENT for t in cfg.layer_types]


def _uses_rope(cfg) -> bool:
    return getattr(cfg, "position_embedding_type", None) == "rope"


def _experts(cfg) -> int:
    return int(getattr(cfg, "num_local_experts", 0) or 0)


def _refuse(what: str) -> None:
    raise UserError(f"GGUF export does not support this granitemoehybrid model: {what}, which llama.cpp's "
                    "granitehybrid graph does not compute the same way; use --to merged.")


def check(cfg) -> None:
    unknown = sorted({t for t in cfg.layer_types if t not in RECURRENT + ATTENTION})
    if unknown:
        _refuse(f"its layer_types hold {unknown} (known: {list(RECURRENT + ATTENTION)})")
    if int(cfg.mamba_expand) != 2:
        _refuse(f"mamba_expand is {cfg.mamba_expand} (llama.cpp's loader asserts an inner width of twice the "
                "hidden size)")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        _refuse(f"hidden_act is {cfg.hidden_act}, not silu")
    if getattr(cfg, "mamba_proj_bias", False):
        _refuse("its Mamba projections have biases (mamba_proj_bias)")
    low, high = tuple(getattr(cfg, "time_step_limit", None) or (0.0, math.inf))
    if (float(low), float(high)) != (0.0, math.inf):
        _refuse(f"it clamps the Mamba time step to {[low, high]} (llama.cpp does not clamp)")


def gguf_name(cfg) -> str:
    """llama.cpp's architecture: granitehybrid, or for a Granite 4 without Mamba layers (granite-4.0-micro) the
    plain Granite graphs, as llama.cpp's converter writes them."""
    if any(recurrent_layers(cfg)):
        return "granitehybrid"
    return "granitemoe" if _experts(cfg) else "granite"


def common(cfg) -> dict:
    """The common keys whose values differ here: the per-layer KV heads (0 = recurrent), the unbounded context and,
    without experts, the MLP's width: the shared MLP's, which is then the only one."""
    kv = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    out = {"head_count_kv": [0 if r else kv for r in recurrent_layers(cfg)]}
    if not _experts(cfg):
        out["feed_forward_length"] = int(cfg.shared_intermediate_size)
    if not _uses_rope(cfg):
        out["context_length"] = UNBOUNDED_CONTEXT
    return out


def add_hparams(writer, cfg) -> None:
    writer.add_attention_scale(float(cfg.attention_multiplier))
    writer.add_embedding_scale(float(cfg.embedding_multiplier))
    writer.add_residual_scale(float(cfg.residual_multiplier))
    writer.add_logit_scale(float(cfg.logits_scaling))
    writer.add_expert_count(_experts(cfg))
    # a dense Granite 4 routes to none (llama.cpp's loader aborts on a top-k without experts)
    writer.add_expert_used_count(int(getattr(cfg, "num_experts_per_tok", 0) or 0) if _experts(cfg) else 0)
    if getattr(cfg, "shared_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(int(cfg.shared_intermediate_size))
    writer.add_ssm_conv_kernel(int(cfg.mamba_d_conv))
    writer.add_ssm_state_size(int(cfg.mamba_d_state))
    writer.add_ssm_group_count(int(cfg.mamba_n_groups))
    writer.add_ssm_inner_size(int(cfg.mamba_expand) * cfg.hidden_size)
    writer.add_ssm_time_step_rank(int(cfg.mamba_n_heads))  # llama.cpp reads the head count from this key
    writer.add_rope_scaling_finetuned(_uses_rope(cfg))  # the graph's switch for rope


def _shared_names(layer: str, cfg) -> tuple[str, str, str]:
    """Where the shared MLP's gate, up and down go: the shared-expert tensors beside experts, the plain MLP's
    without (the names gguf-py's table knows for them)."""
    if _experts(cfg):
        return (f"{layer}.mlp.shared_expert.gate_proj", f"{layer}.mlp.shared_expert.up_proj",
                f"{layer}.shared_mlp.output_linear")
    return f"{layer}.mlp.gate_proj", f"{layer}.mlp.up_proj", f"{layer}.mlp.down_proj"


def to_llama_cpp(key: str, data: np.ndarray, cfg) -> list[tuple[str, np.ndarray]]:
    """One HF tensor (transformers 5's names) -> (name gguf-py's table knows, data) pairs in llama.cpp's layout."""
    module, leaf = key.rsplit(".", 1)
    layer = module.split(".shared_mlp")[0].split(".block_sparse_moe")[0].split(".mamba")[0]
    if module.endswith("block_sparse_moe.router"):
        return [(f"{module}.layer.{leaf}", data)]
    if module.endswith("block_sparse_moe.experts"):  # (experts, out, in) stacks, gate then up in gate_up_proj
        if leaf == "gate_up_proj":
            gate, up = np.split(data, 2, axis=1)
            return [(f"{module}.gate_proj.weight", gate), (f"{module}.up_proj.weight", up)]
        return [(f"{module}.down_proj.weight", data)]
    if module.endswith("shared_mlp.input_linear"):
        gate, up = np.split(data, 2, axis=0)
        names = _shared_names(layer, cfg)
        return [(f"{names[0]}.weight", gate), (f"{names[1]}.weight", up)]
    if module.endswith("shared_mlp.output_linear"):
        return [(f"{_shared_names(layer, cfg)[2]}.weight", data)]
    if ".mamba" in module:
        return [_mamba(module, leaf, data, cfg)]
    return [(key, data)]


def _mamba(module: str, leaf: str, data: np.ndarray, cfg) -> tuple[str, np.ndarray]:
    if leaf == "A_log":
        import torch  # torch's exp, as the converter computes it: numpy's differs in the last bit

        return f"{module}.A_log", -torch.exp(torch.from_numpy(data)).numpy().reshape(-1, 1)
    if leaf == "D":
        return f"{module}.D", data.reshape(-1, 1)
    if leaf == "dt_bias":
        return f"{module}.dt_proj.bias", data
    if module.endswith("conv1d") and leaf == "weight":
        return f"{module}.weight", data.reshape(data.shape[0], -1)
    if module.endswith(".norm"):  # the gated norm, one row per group
        return f"{module}.weight", data.reshape(int(cfg.mamba_n_groups), -1)
    return f"{module}.{leaf}", data


def lora_order(module: str, a: np.ndarray, b: np.ndarray, cfg) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """A LoRA pair in the base tensors' layout: the shared MLP's fused input as two pairs sharing A (B's rows split
    between gate and up), its output under the tensor name it takes here."""
    layer = module.split(".shared_mlp")[0]
    if module.endswith("shared_mlp.input_linear"):
        gate, up = np.split(b, 2, axis=0)
        names = _shared_names(layer, cfg)
        return [(names[0], a, gate), (names[1], a, up)]
    if module.endswith("shared_mlp.output_linear"):
        return [(_shared_names(layer, cfg)[2], a, b)]
    return [(module, a, b)]
