"""Gemma 4 (transformers' ``gemma4_text``, and the language model of ``gemma4``'s Gemma4ForConditionalGeneration) in
llama.cpp's layout (its gemma4 graph).

What llama.cpp's loader and converter expect (facts read off them, not their code): two head widths (the sliding
layers' ``key_length_swa``, the full layers' ``key_length``), rotated in full on the sliding layers and by the
"proportional" rope on the full ones, which llama.cpp computes as a full-width rotation whose unrotated pairs get a
frequency divisor of 1e30 (the ``rope_freqs`` tensor); the per-layer embeddings (``per_layer_token_embd``, one row
of layers x width per token, and their projections); the KV-sharing tail (``shared_kv_layers``); norms stored as
they are (Gemma 4's RMSNorm scales by w, not 1 + w); ``layer_scalar`` as ``layer_output_scale.weight``. llama.cpp
fixes the attention scale at 1 and multiplies ``per_layer_model_proj`` without a LoRA; what it computes otherwise
(the MoE block, bidirectional attention, other activations or rope) is refused.
"""

from __future__ import annotations

import copy

import numpy as np

from rocktune.errors import UserError

# the multimodal checkpoint's language model and the parts a text GGUF leaves out (the vision and audio towers and
# their projectors: llama.cpp's mmproj, which a text task does not write)
LANGUAGE_MODEL = "model.language_model."
OTHER_TOWERS = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
UNROTATED = 1e30  # llama.cpp divides these pairs' frequency by this: no rotation, as proportional rope leaves them


def language_config(cfg):
    """The language model's config (Gemma4ForConditionalGeneration's text_config, with the whole model's head
    tying, which a merge that untied the head changed), or ``cfg`` itself."""
    if cfg.model_type != "gemma4":
        return cfg
    text = copy.copy(cfg.get_text_config())
    text.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", text.tie_word_embeddings))
    return text


def language_state(state: dict) -> dict:
    """The language model's tensors of a Gemma4ForConditionalGeneration state dict under the text model's names."""
    out = {}
    for key, value in state.items():
        if key.startswith(OTHER_TOWERS):
            continue
        out["model." + key.removeprefix(LANGUAGE_MODEL) if key.startswith(LANGUAGE_MODEL) else key] = value
    return out


def _refuse(what: str) -> None:
    raise UserError(f"GGUF export does not support this Gemma 4 model: {what}, which llama.cpp's gemma4 graph does "
                    "not compute the same way; use --to merged.")


def _rope(cfg, kind: str) -> dict:
    return dict((cfg.rope_parameters or {}).get(kind) or {})


def _swa(cfg) -> list[bool]:
    return [t == "sliding_attention" for t in cfg.layer_types]


def _full_layer(cfg) -> int:
    return next(i for i, swa in enumerate(_swa(cfg)) if not swa)


def check(cfg) -> None:
    cfg = language_config(cfg)
    if getattr(cfg, "enable_moe_block", False):
        _refuse("it has the MoE block (enable_moe_block), which rocktune does not write yet")
    if getattr(cfg, "use_bidirectional_attention", None) == "all":
        _refuse("its attention is bidirectional (use_bidirectional_attention: all)")
    if cfg.hidden_activation != "gelu_pytorch_tanh":
        _refuse(f"hidden_activation is {cfg.hidden_activation}, not gelu_pytorch_tanh")
    full, local = _rope(cfg, "full_attention"), _rope(cfg, "sliding_attention")
    if full.get("rope_type") != "proportional" or float(full.get("factor", 1.0)) != 1.0:
        _refuse(f"its full layers' rope is {full.get('rope_type')} (factor {full.get('factor', 1.0)}), not "
                "unscaled proportional")
    if local.get("rope_type", "default") != "default" or float(local.get("partial_rotary_factor", 1.0)) != 1.0:
        _refuse(f"its sliding layers' rope is {local.get('rope_type')} over {local.get('partial_rotary_factor')} of "
                "each head, not the default over the whole head")
    if cfg.hidden_size_per_layer_input and cfg.vocab_size_per_layer_input != cfg.vocab_size:
        _refuse(f"its per-layer embedding has {cfg.vocab_size_per_layer_input} rows for {cfg.vocab_size} tokens")


def common(cfg) -> dict:
    """The common keys whose values differ here: the full layers' head width and rope, per-layer KV heads and MLP
    widths where they differ from layer to layer."""
    full = cfg.per_layer_config[_full_layer(cfg)]
    out = {"key_length": int(full.head_dim), "value_length": int(full.head_dim),
           "rope_dimension_count": int(full.head_dim),  # proportional: the whole head, unrotated pairs by rope_freqs
           "rope_freq_base": float(_rope(cfg, "full_attention")["rope_theta"])}
    kv = [int(cfg.per_layer_config[i].num_key_value_heads) for i in range(cfg.num_hidden_layers)]
    if len(set(kv)) > 1:
        out["head_count_kv"] = kv
    if getattr(cfg, "use_double_wide_mlp", False):  # the KV-sharing layers' MLPs are twice as wide
        first_shared = cfg.num_hidden_layers - int(cfg.num_kv_shared_layers)
        out["feed_forward_length"] = [cfg.intermediate_size * (1 if i < first_shared else 2)
                                      for i in range(cfg.num_hidden_layers)]
    return out


def add_hparams(writer, cfg) -> None:
    # the global head width is the sliding layers' (read from the saved fields: transformers refuses the attribute
    # where widths vary by layer)
    width = int(cfg.to_dict()["head_dim"])
    writer.add_key_length_swa(width)
    writer.add_value_length_swa(width)
    writer.add_rope_dimension_count_swa(width)
    writer.add_rope_freq_base_swa(float(_rope(cfg, "sliding_attention").get("rope_theta", 10000.0)))
    writer.add_sliding_window(int(cfg.sliding_window))
    writer.add_sliding_window_pattern(_swa(cfg))
    writer.add_shared_kv_layers(int(cfg.num_kv_shared_layers))
    writer.add_embedding_length_per_layer_input(int(cfg.hidden_size_per_layer_input or 0))
    if getattr(cfg, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(float(cfg.final_logit_softcapping))


def rope_freqs(cfg) -> dict[str, np.ndarray]:
    """The full layers' proportional rope as llama.cpp computes it: divisor 1 on the rotated pairs, 1e30 on the
    rest."""
    width = int(cfg.per_layer_config[_full_layer(cfg)].head_dim)
    rotated = int(width * float(_rope(cfg, "full_attention").get("partial_rotary_factor", 1.0)) / 2)
    return {"rope_freqs.weight": np.array([1.0] * rotated + [UNROTATED] * (width // 2 - rotated), dtype=np.float32)}


def to_llama_cpp(key: str, data: np.ndarray, cfg) -> list[tuple[str, np.ndarray]]:
    if key.endswith(".layer_scalar"):  # a buffer; llama.cpp's table names it without the .weight it stores
        return [(key + ".weight", data)]
    return [(key, data)]
