"""Which transformers architectures map onto which llama.cpp architecture, and how their hyper-parameters and
tensors are laid out in GGUF (names from gguf-py's tables; nothing here is copied from a converter).

Checked before any weight is loaded, so an unsupported model fails in a second, naming itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rocktune.errors import UserError
from rocktune.export import gemma4, gpt_oss, granite_hybrid, linear_attn, llama4


@dataclass(frozen=True)
class Arch:
    gguf_name: str        # llama.cpp's architecture name
    interleaved_rope: bool  # llama.cpp rotates adjacent pairs here, HF rotates halves: q/k rows are reordered
    norm_shift: float = 0.0  # Gemma's RMSNorm scales by (1 + w); llama.cpp's by the stored weight, so w + 1 is stored
    output_required: bool = False  # the loader has no tied head (OLMo 2): output.weight is written even when tied
    check: Callable | None = None  # refuses configurations llama.cpp's graph for this arch would compute otherwise
    hparams: Callable | None = None  # the family's own metadata keys, on top of the common ones
    transform: Callable | None = None  # (HF name, data, cfg) -> [(name the GGUF table knows, data)]: the layout
    lora_order: Callable | None = None  # (module, A, B, cfg) -> (A, B) in that layout
    common: Callable | None = None  # cfg -> {common key: value} where the family's differs (per-layer arrays)
    extra: Callable | None = None  # cfg -> {GGUF name: array}: tensors llama.cpp needs beyond the checkpoint's
    rope_kinds: tuple[str, ...] = ()  # rope types the family's own check and keys handle, beyond the common ones
    no_lora: tuple[str, ...] = ()  # modules llama.cpp's graph multiplies without their LoRA: a GGUF LoRA refuses them
    name_for: Callable | None = None  # cfg -> llama.cpp's architecture, where the configuration decides it


def _refuse_if(condition: bool, cfg, what: str) -> None:
    if condition:
        raise UserError(f"GGUF export does not support this {cfg.model_type} model: {what}, which llama.cpp's "
                        f"{cfg.model_type} graph does not compute the same way; use --to merged.")


def _phi3_hparams(writer, cfg) -> None:
    # llama.cpp reads a Phi-3 sliding window only to warn and switch it off; 0 marks "none" (Phi-4)
    writer.add_sliding_window(getattr(cfg, "sliding_window", None) or 0)
    orig = getattr(cfg, "original_max_position_embeddings", None) or rope_params(cfg).get(
        "original_max_position_embeddings")
    if orig:
        writer.add_rope_scaling_orig_ctx_len(int(orig))


def _granite_hparams(writer, cfg) -> None:
    writer.add_attention_scale(float(cfg.attention_multiplier))
    writer.add_embedding_scale(float(cfg.embedding_multiplier))
    writer.add_residual_scale(float(cfg.residual_multiplier))
    writer.add_logit_scale(float(cfg.logits_scaling))  # the loader requires this key


def _check_smollm3(cfg) -> None:
    # llama.cpp leaves rope out of every 4th layer (a fixed rule); transformers reads it per layer from the config
    want = [int((i + 1) % 4 != 0) for i in range(cfg.num_hidden_layers)]
    have = list(getattr(cfg, "no_rope_layers", None) or want)
    _refuse_if(have != want, cfg, f"rope is skipped in layers {[i for i, r in enumerate(have) if not r]}, "
               "not in every 4th layer")
    _refuse_if(any(t != "full_attention" for t in _layer_types(cfg)), cfg, "it uses sliding-window attention")


def _layer_types(cfg) -> list[str]:
    return list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)


def _check_gemma(cfg) -> None:
    # llama.cpp scales queries by 1/sqrt(head_dim), by 1/sqrt(hidden/heads) for the 27B shapes only
    big = cfg.num_hidden_layers == (46 if cfg.model_type == "gemma2" else 62)
    expected = cfg.hidden_size // cfg.num_attention_heads if big else head_dim(cfg)
    scalar = getattr(cfg, "query_pre_attn_scalar", None)
    _refuse_if(scalar != expected, cfg, f"query_pre_attn_scalar is {scalar}, not {expected}")
    sliding = "sliding_attention" in _layer_types(cfg)
    _refuse_if(sliding and not getattr(cfg, "sliding_window", None), cfg, "it has sliding layers but no window size")
    if cfg.model_type == "gemma2":  # llama.cpp's gemma2 graph always soft-caps both (50 and 30 unless told)
        _refuse_if(getattr(cfg, "attn_logit_softcapping", None) is None, cfg, "it has no attention soft-capping")
        _refuse_if(getattr(cfg, "final_logit_softcapping", None) is None, cfg, "it has no final soft-capping")
    else:
        _refuse_if(getattr(cfg, "attn_logit_softcapping", None) is not None, cfg, "it soft-caps attention logits")
        local = rope_params(cfg, "sliding_attention")
        _refuse_if(local["rope_type"] != "default", cfg, f"its sliding layers scale rope ({local['rope_type']})")


def _gemma_hparams(writer, cfg) -> None:
    if cfg.model_type == "gemma2":
        writer.add_attn_logit_softcapping(float(cfg.attn_logit_softcapping))
    if getattr(cfg, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(float(cfg.final_logit_softcapping))
    sliding = [t == "sliding_attention" for t in _layer_types(cfg)]
    if any(sliding) or cfg.model_type == "gemma2":  # gemma2's loader assumes a 4096 window on every other layer
        writer.add_sliding_window(int(cfg.sliding_window or 0))
        writer.add_sliding_window_pattern(sliding)  # per layer, as the config says, not the loader's default
    if cfg.model_type == "gemma3_text":
        writer.add_rope_freq_base_swa(float(rope_params(cfg, "sliding_attention")["rope_theta"]))


def _check_olmo3(cfg) -> None:
    # llama.cpp gives sliding layers their own rope base but the full layers' scaling
    full, local = rope_params(cfg), rope_params(cfg, "sliding_attention")
    _refuse_if({**local, "rope_theta": 0} != {**full, "rope_theta": 0}, cfg,
               f"its sliding layers scale rope otherwise ({local['rope_type']}) than its full ones")


def _olmo3_hparams(writer, cfg) -> None:
    writer.add_sliding_window(int(cfg.sliding_window))
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in _layer_types(cfg)])
    writer.add_rope_freq_base_swa(float(rope_params(cfg, "sliding_attention")["rope_theta"]))


def _mrope_hparams(writer, cfg) -> None:
    # Qwen2-VL's 3-D rotary positions: how many of each head's rotary pairs follow time, height and width (llama.cpp
    # reads four sections, the fourth unused by this family)
    sections = [int(s) for s in rope_params(cfg).get("mrope_section") or []]
    if len(sections) not in (3, 4):
        raise UserError(f"GGUF export: this {cfg.model_type} model's rope has no mrope_section of 3 numbers "
                        f"({sections}); use --to merged.")
    writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))


def _check_interleaved_mrope(cfg) -> None:
    """Qwen3-VL interleaves its rotary sections (pair i follows height when i % 3 == 1, width when i % 3 == 2, within
    3 x the section); transformers gives every other pair to time, llama.cpp only those within 3 x the time section
    and the rest to a fourth position, which is 0 for text. The two agree only when no pair falls outside."""
    sections = [int(x) for x in rope_params(cfg).get("mrope_section") or []] + [0, 0, 0]
    pairs = head_dim(cfg) // 2
    outside = [i for i in range(pairs) if not (i < 3 * sections[i % 3])]
    _refuse_if(bool(outside), cfg, f"its interleaved rotary sections {sections[:3]} leave pairs {outside} to a "
               "position llama.cpp does not rotate by")


def _qwen3vl_hparams(writer, cfg) -> None:
    _mrope_hparams(writer, cfg)
    # set by tasks/vlm/export/gguf_vision.py
    writer.add_num_deepstack_layers(int(getattr(cfg, "num_deepstack_layers", 0)))


def _check_qwen3_moe(cfg) -> None:
    # llama.cpp's qwen3moe graph renormalises the chosen experts' weights and has an MoE block in every layer
    _refuse_if(not getattr(cfg, "norm_topk_prob", False), cfg, "norm_topk_prob is off (the chosen experts' "
               "weights are not renormalised)")
    _refuse_if(getattr(cfg, "decoder_sparse_step", 1) != 1 or bool(getattr(cfg, "mlp_only_layers", None)), cfg,
               "some layers have a dense MLP instead of experts")


def _moe_hparams(writer, cfg) -> None:
    writer.add_expert_count(n_experts(cfg))
    writer.add_expert_used_count(int(cfg.num_experts_per_tok))
    if getattr(cfg, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(int(cfg.moe_intermediate_size))


def _glm4_moe_hparams(writer, cfg) -> None:
    import gguf

    _moe_hparams(writer, cfg)
    writer.add_expert_group_count(int(cfg.n_group))
    writer.add_expert_group_used_count(int(cfg.topk_group))
    writer.add_expert_shared_count(int(cfg.n_shared_experts))
    writer.add_leading_dense_block_count(int(cfg.first_k_dense_replace))
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)  # GLM's router scores by sigmoid
    writer.add_expert_weights_scale(float(cfg.routed_scaling_factor))
    writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    # no nextn_predict_layers: the MTP layers are not part of transformers' model, so the merge has none (what the
    # converter writes with --no-mtp)


def _qwen35_hparams(writer, cfg) -> None:
    linear_attn.add_hparams(writer, cfg)
    if n_experts(cfg):
        _moe_hparams(writer, cfg)
        writer.add_expert_shared_feed_forward_length(int(cfg.shared_expert_intermediate_size))


def n_experts(cfg) -> int:
    return int(getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
               or getattr(cfg, "n_routed_experts", None) or 0)


def expert_ff(cfg) -> int:
    return int(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)


def hf_parts(key: str, data: np.ndarray, cfg, arch: Arch) -> list[tuple[str, np.ndarray]]:
    """One HF tensor as the tensors GGUF keeps (still HF-named): experts apart, the family's own layout."""
    parts = [(key, data)] if arch.transform is None else arch.transform(key, data, cfg)
    return [out for part, d in parts for out in split_experts(part, d)]


def split_experts(key: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """transformers 5 keeps a layer's experts as 3-D parameters, gate and up fused (experts, 2 * ff, hidden);
    llama.cpp wants ffn_gate_exps and ffn_up_exps apart. Other tensors pass through."""
    if key.endswith("mlp.experts.gate_up_proj"):
        half = data.shape[1] // 2
        base = key.removesuffix(".gate_up_proj")
        return [(f"{base}.gate_proj.weight", data[:, :half]), (f"{base}.up_proj.weight", data[:, half:])]
    if key.endswith("mlp.experts.down_proj"):
        return [(key + ".weight", data)]
    return [(key, data)]


# Gated DeltaNet families: their hyper-parameters, checks and tensor layout (export/linear_attn.py)
LINEAR_ATTN = {"check": linear_attn.check, "hparams": _qwen35_hparams, "transform": linear_attn.to_llama_cpp,
               "lora_order": linear_attn.lora_order}

GEMMA4 = {"check": gemma4.check, "hparams": gemma4.add_hparams, "transform": gemma4.to_llama_cpp,
          "common": gemma4.common, "extra": gemma4.rope_freqs, "rope_kinds": ("proportional",),
          "no_lora": ("per_layer_model_projection",)}

# HF model_type -> llama.cpp arch. Mistral's dense models run on llama.cpp's llama graph.
ARCHS = {
    "qwen2": Arch("qwen2", False),
    "qwen3": Arch("qwen3", False),
    "llama": Arch("llama", True),
    "mistral": Arch("llama", True),
    "phi3": Arch("phi3", False, hparams=_phi3_hparams),
    "olmo2": Arch("olmo2", False, output_required=True),
    "olmo3": Arch("olmo2", False, output_required=True, check=_check_olmo3, hparams=_olmo3_hparams),
    "granite": Arch("granite", True, hparams=_granite_hparams),
    "smollm3": Arch("smollm3", True, check=_check_smollm3),
    "gemma2": Arch("gemma2", False, 1.0, check=_check_gemma, hparams=_gemma_hparams),
    "gemma3_text": Arch("gemma3", False, 1.0, check=_check_gemma, hparams=_gemma_hparams),
    "qwen3_moe": Arch("qwen3moe", False, check=_check_qwen3_moe, hparams=_moe_hparams),
    "mixtral": Arch("llama", True, hparams=_moe_hparams),  # llama's graph with experts (expert_count > 0)
    "glm4_moe": Arch("glm4moe", False, hparams=_glm4_moe_hparams),
    # Llama 4's language model: its dense MLPs are intermediate_size_mlp wide, its experts intermediate_size
    "llama4_text": Arch("llama4", False, check=llama4.check, hparams=llama4.add_hparams, transform=llama4.to_llama_cpp),
    "gpt_oss": Arch("gpt-oss", False, check=gpt_oss.check, hparams=gpt_oss.add_hparams, transform=gpt_oss.to_llama_cpp),
    # the language models of task=vlm's Qwen2-VL and Qwen2.5-VL (tasks/vlm/export/gguf_vision.py writes their eyes
    # beside)
    "qwen2_vl_text": Arch("qwen2vl", False, hparams=_mrope_hparams),
    "qwen2_5_vl_text": Arch("qwen2vl", False, hparams=_mrope_hparams),
    # Gated DeltaNet + gated full attention (export/linear_attn.py)
    "qwen3_5_text": Arch("qwen35", False, **LINEAR_ATTN),
    "qwen3_5_moe_text": Arch("qwen35moe", False, **LINEAR_ATTN),
    "qwen3_next": Arch("qwen3next", False, **LINEAR_ATTN),
    "qwen3_vl_text": Arch("qwen3vl", False, check=_check_interleaved_mrope, hparams=_qwen3vl_hparams),
    # Granite 4: Mamba2 + attention, experts with a shared MLP (export/granite_hybrid.py)
    "granitemoehybrid": Arch("granitehybrid", True, check=granite_hybrid.check, hparams=granite_hybrid.add_hparams,
                             transform=granite_hybrid.to_llama_cpp, lora_order=granite_hybrid.lora_order,
                             common=granite_hybrid.common, name_for=granite_hybrid.gguf_name),
    # Gemma 4: two head widths, proportional rope on the full layers, per-layer embeddings (export/gemma4.py); the
    # multimodal checkpoint's language model the same way
    "gemma4_text": Arch("gemma4", False, **GEMMA4),
    "gemma4": Arch("gemma4", False, **GEMMA4),
}


def language_config(cfg):
    """The config of the model the GGUF holds: a multimodal checkpoint's language model (Gemma 4's), else ``cfg``."""
    return gemma4.language_config(cfg)


def language_state(state: dict, cfg) -> dict:
    """The state dict of the model the GGUF holds (a multimodal checkpoint's language model under the text model's
    names)."""
    return gemma4.language_state(state) if cfg.model_type == "gemma4" else state


def arch_for(cfg) -> Arch:
    cfg = language_config(cfg)
    model_type = getattr(cfg, "model_type", "?")
    if model_type not in ARCHS:
        raise UserError(f"GGUF export does not support the {model_type} architecture yet (supported: "
                        f"{', '.join(sorted(ARCHS))}); use --to merged for a transformers model directory.")
    arch = ARCHS[model_type]
    if arch.name_for is not None:
        arch = dataclasses.replace(arch, gguf_name=arch.name_for(cfg))
    _check_rope(cfg, arch)
    if arch.check is not None:
        arch.check(cfg)
    return arch


def config_value(cfg, name: str, default=None):
    """A config field's value; where it varies by layer (Gemma 4's head width and KV heads, in transformers'
    per_layer_config), the global one the config was given, which reading the attribute refuses."""
    try:
        return getattr(cfg, name, default)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return cfg.to_dict().get(name, default)


def head_dim(cfg) -> int:
    return config_value(cfg, "head_dim") or cfg.hidden_size // cfg.num_attention_heads


def rope_params(cfg, layer_type: str = "full_attention") -> dict:
    """transformers 5 keeps theta and scaling in ``rope_parameters`` (per layer type where they differ, as Gemma 3's
    global and sliding layers); 4.x in ``rope_theta`` / ``rope_scaling``."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    if isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _check_rope(cfg, arch: Arch) -> None:
    kind = rope_params(cfg)["rope_type"]
    if kind == "mrope" and "mrope_section" in rope_params(cfg):
        return  # transformers 4's name for Qwen2-VL's sectioned rope (written by _mrope_hparams)
    if kind not in ("default", "linear", "llama3", "yarn", *arch.rope_kinds):
        raise UserError(f"GGUF export does not support rope scaling {kind!r} of this {cfg.model_type} model yet "
                        "(supported: none, linear, llama3, yarn); use --to merged.")


def add_hparams(writer, cfg, arch: Arch) -> None:
    import gguf

    rope = rope_params(cfg)
    # Llama 4 calls its dense MLPs' width intermediate_size_mlp (intermediate_size is its experts')
    ff = getattr(cfg, "intermediate_size_mlp", None) or cfg.intermediate_size
    partial = rope.get("partial_rotary_factor") or getattr(cfg, "partial_rotary_factor", None) or 1.0
    common = {"context_length": cfg.max_position_embeddings, "feed_forward_length": ff,
              "head_count_kv": config_value(cfg, "num_key_value_heads") or cfg.num_attention_heads,
              "key_length": head_dim(cfg), "value_length": head_dim(cfg),
              "rope_dimension_count": int(head_dim(cfg) * float(partial)),  # Phi-4-mini rotates 3/4 of each head
              "rope_freq_base": float(rope["rope_theta"])}
    common.update(arch.common(cfg) if arch.common is not None else {})
    writer.add_context_length(common["context_length"])
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(common["feed_forward_length"])
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(common["head_count_kv"])
    writer.add_key_length(common["key_length"])
    writer.add_value_length(common["value_length"])
    writer.add_rope_dimension_count(common["rope_dimension_count"])
    writer.add_rope_freq_base(common["rope_freq_base"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    if arch.hparams is not None:
        arch.hparams(writer, cfg)


def extra_tensors(cfg, arch: Arch) -> dict[str, np.ndarray]:
    """Tensors GGUF needs that the checkpoint does not hold: Llama 3.1's per-frequency rope divisors, the family's
    own."""
    if arch.extra is not None:
        return arch.extra(cfg)
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


# tensors llama.cpp keeps in f32 whatever the file type (its converter and quantiser alike): the routers, whose
# near-tied expert choices a rounding flips, and the SSM conv kernels its conv op reads as f32
F32_TENSORS = (".ffn_gate_inp.", ".ffn_gate_inp_shexp.", ".ssm_conv1d.")


def keeps_f32(gguf_name: str) -> bool:
    """Whether this tensor stays f32 in an f16 / q8_0 file: the ones above, every norm (Mamba2's grouped one is
    2-D) and every one that is not a weight matrix (biases, Gated DeltaNet's and Mamba2's A, scales)."""
    return (any(part in gguf_name for part in F32_TENSORS) or gguf_name.endswith("_norm.weight")
            or not gguf_name.endswith(".weight"))


def write_out(writer) -> None:
    """Header, metadata and tensors of a filled GGUFWriter, in that order, and the file closed whatever happens."""
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


# Granite 4's expert stacks, apart, under the names gguf-py's table knows for them
GRANITE_EXPERTS = tuple((f"block_sparse_moe.experts.{part}_proj", f"block_sparse_moe.experts.{w}")
                        for part, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")))


def tensor_namer(cfg, arch: Arch):
    """HF parameter name -> GGUF tensor name (None for what GGUF does not store)."""
    import gguf

    enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch.gguf_name)
    table = gguf.get_tensor_name_map(enum, cfg.num_hidden_layers)

    def name(hf_name: str) -> str | None:
        # a router's score-correction bias (GLM-4.5, DeepSeek-V3) is a bias of the table's e_score_correction
        hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
        hf_name = hf_name.replace("linear_attn.dt_bias", "linear_attn.dt_proj.bias")  # Gated DeltaNet's dt bias
        for hf, known in GRANITE_EXPERTS:
            hf_name = hf_name.replace(hf, known)
        return table.get_name(hf_name, try_suffixes=(".weight", ".bias"))

    return name


def to_gguf_layout(gguf_name: str, data: np.ndarray, cfg, arch: Arch) -> np.ndarray:
    """Reorder q/k output rows from HF's half-split rotary layout to llama.cpp's interleaved one (llama arch);
    shift Gemma's norm weights to what llama.cpp multiplies by."""
    if arch.norm_shift and gguf_name.endswith("norm.weight"):
        return data + np.float32(arch.norm_shift)
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
