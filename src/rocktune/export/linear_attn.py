"""Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) in llama.cpp's layout.

What llama.cpp's qwen35 / qwen35moe / qwen3next graphs expect, read off its converter (facts, not its code):
A is stored as -exp(A_log), dt_bias as the bias of a dt projection, the conv kernel without its unit axis; every
RMSNorm but the gated one inside the linear attention scales by (1 + w), so w + 1 is stored. Where there are fewer
key heads than value heads, HF groups the value heads by key head ([k0: v0 v1, k1: v0 v1]) and llama.cpp broadcasts
them tiled ([k0 v0, k1 v0, k0 v1, k1 v1]): every value-head axis (the V rows of in_proj_qkv, in_proj_z, in_proj_a/b,
A, dt, the V channels of the conv, the columns of out_proj) is reordered so. Qwen3-Next's fused in_proj_qkvz
(per key head [q k v z]) is split into the qkv and z tensors (its in_proj_ba stays one tensor).
"""

from __future__ import annotations

import numpy as np

from rocktune.errors import UserError


def _dims(cfg) -> tuple[int, int, int, int]:
    return (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim)


def v_order(cfg, head_dim: int) -> np.ndarray:
    """Index of HF's value-head rows in llama.cpp's tiled order (identity when key and value heads are as many, and
    for Qwen3-Next, whose graph repeats the key heads itself)."""
    nk, nv, _, _ = _dims(cfg)
    idx = np.arange(nv * head_dim).reshape(nk, nv // nk, head_dim)
    if cfg.model_type == "qwen3_next":
        return idx.reshape(-1)
    return idx.transpose(1, 0, 2).reshape(-1)


def _qkv_order(cfg) -> np.ndarray:
    nk, _, dk, dv = _dims(cfg)
    qk = 2 * nk * dk
    return np.concatenate([np.arange(qk), qk + v_order(cfg, dv)])


def row_order(module: str, cfg) -> np.ndarray | None:
    """The output-row permutation llama.cpp's layout applies to this linear-attention projection, or None."""
    _, _, _, dv = _dims(cfg)
    if module.endswith("in_proj_qkv"):
        return _qkv_order(cfg)
    if module.endswith("in_proj_z"):
        return v_order(cfg, dv)
    if module.endswith(("in_proj_a", "in_proj_b")):
        return v_order(cfg, 1)
    return None


def col_order(module: str, cfg) -> np.ndarray | None:
    """The input-column permutation (out_proj reads the value heads), or None."""
    return v_order(cfg, _dims(cfg)[3]) if module.endswith("linear_attn.out_proj") else None


def to_llama_cpp(key: str, data: np.ndarray, cfg) -> list[tuple[str, np.ndarray]]:
    """One HF tensor of a Gated DeltaNet model -> (HF-style name the GGUF table knows, data) pairs."""
    if ".linear_attn." not in key:
        return [(key, data + np.float32(1) if key.endswith("norm.weight") else data)]
    module = key.rsplit(".", 1)[0]
    if key.endswith("in_proj_qkvz.weight"):
        return _split_qkvz(module, data, cfg)
    if key.endswith((".A_log", ".dt_bias")):
        data = data[v_order(cfg, 1)]
        if key.endswith(".dt_bias"):
            return [(f"{module}.dt_proj.bias", data)]
        import torch  # torch's exp, as llama.cpp's converter computes it: numpy's differs in the last bit

        return [(f"{module}.A_log", -torch.exp(torch.from_numpy(data)).numpy())]
    if key.endswith("conv1d.weight"):
        return [(key, data.reshape(data.shape[0], -1)[_qkv_order(cfg)])]
    rows, cols = row_order(module, cfg), col_order(module, cfg)
    if rows is not None:
        data = data[rows]
    if cols is not None:
        data = data[:, cols]
    return [(key, data)]


def _split_qkvz(module: str, data: np.ndarray, cfg) -> list[tuple[str, np.ndarray]]:
    """Qwen3-Next: rows per key head [q k v z] -> the qkv rows (q of all heads, k, v) and the z rows apart (a LoRA
    B the same way: its rows are the projection's)."""
    nk, nv, dk, dv = _dims(cfg)
    per = nv // nk * dv
    heads = data.reshape(nk, 2 * dk + 2 * per, -1)
    q, k, v, z = np.split(heads, [dk, 2 * dk, 2 * dk + per], axis=1)
    flat = [x.reshape(-1, data.shape[1]) for x in (q, k, v, z)]
    base = module.rsplit(".", 1)[0]
    return [(f"{base}.in_proj_qkv.weight", np.concatenate(flat[:3])), (f"{base}.in_proj_z.weight", flat[3])]


def lora_order(module: str, a: np.ndarray, b: np.ndarray, cfg) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """A LoRA pair on a linear-attention projection in the base tensors' layout: B's rows, A's columns reordered;
    Qwen3-Next's fused qkvz as two pairs sharing A."""
    if module.endswith("in_proj_qkvz"):
        return [(name.removesuffix(".weight"), a, part) for name, part in _split_qkvz(module, b, cfg)]
    rows, cols = row_order(module, cfg), col_order(module, cfg)
    return [(module, a if cols is None else a[:, cols], b if rows is None else b[rows])]


def check(cfg) -> None:
    """llama.cpp's Qwen3.5 graph rotates by the rope sections and asserts that they fit in a head."""
    sections, width = _sections(cfg), cfg.head_dim
    if cfg.model_type != "qwen3_next" and sum(sections) > width:
        raise UserError(f"GGUF export does not support this {cfg.model_type} model: its rope sections {sections} "
                        f"add up to more than its head width {width}, which llama.cpp's graph refuses; use "
                        "--to merged.")


def _sections(cfg) -> list[int]:
    """Qwen3.5's rope sections (transformers 5 keeps them in rope_parameters; the released default otherwise)."""
    return [int(s) for s in (getattr(cfg, "rope_parameters", None) or {}).get("mrope_section") or [11, 11, 10]]


def add_hparams(writer, cfg) -> None:
    """The recurrent layers' shapes, which layers are recurrent, and the rotary sections llama.cpp requires."""
    nk, nv, dk, dv = _dims(cfg)
    writer.add_ssm_conv_kernel(int(cfg.linear_conv_kernel_dim))
    writer.add_ssm_state_size(int(dk))
    writer.add_ssm_group_count(int(nk))
    writer.add_ssm_time_step_rank(int(nv))
    writer.add_ssm_inner_size(int(dv * nv))
    # which layers are recurrent (a key the installed gguf-py has no helper for yet)
    writer.add_array(f"{writer.arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg.layer_types])
    writer.add_full_attention_interval(int(getattr(cfg, "full_attention_interval", None) or 4))
    if cfg.model_type != "qwen3_next":  # Qwen3.5's rope is the interleaved multimodal one, sections [11, 11, 10]
        sections = _sections(cfg)
        writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
