"""The 2025-26 families' configurations that llama.cpp's graphs compute otherwise are refused before any weight is
loaded (export/arch.py, gpt_oss.py, llama4.py, granite_hybrid.py, gemma4.py), with what differs; the supported ones
pass the same checks."""

from __future__ import annotations

import pytest
import transformers

from rocktune.errors import UserError
from rocktune.export.arch import arch_for

SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "head_dim": 16, "vocab_size": 300}


@pytest.mark.parametrize("config_class,extra,gguf_name", [
    ("Olmo3Config", {"layer_types": ["sliding_attention", "full_attention"]}, "olmo2"),
    ("Glm4MoeConfig", {}, "glm4moe"),
    ("Qwen3_5TextConfig", {"layer_types": ["linear_attention", "full_attention"], "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]}},
     "qwen35"),
    ("Qwen3NextConfig", {"layer_types": ["linear_attention", "full_attention"]}, "qwen3next"),
    ("GptOssConfig", {"layer_types": ["sliding_attention", "full_attention"]}, "gpt-oss"),
    ("Llama4TextConfig", {}, "llama4"),
])
def test_supported_configs_pass(config_class, extra, gguf_name):
    assert arch_for(getattr(transformers, config_class)(**SMALL, **extra)).gguf_name == gguf_name


@pytest.mark.parametrize("config_class,extra,words", [
    ("GptOssConfig", {"layer_types": ["full_attention", "sliding_attention"]}, "do not alternate sliding and full"),
    ("GptOssConfig", {"swiglu_limit": 5.0}, "swiglu_limit is 5.0"),
    ("Qwen3_5TextConfig", {"layer_types": ["linear_attention", "full_attention"]}, "add up to more than its head"),
    ("Llama4TextConfig", {"attention_chunk_size": 64}, "attention_chunk_size is 64"),
    ("Llama4TextConfig", {"no_rope_layer_interval": 2}, "no_rope_layer_interval is 2"),
    ("Llama4TextConfig", {"use_qk_norm": False}, "use_qk_norm is False"),
    ("Olmo3Config", {"rope_parameters": {
        "full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                           "original_max_position_embeddings": 256},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "scale rope otherwise"),
])
def test_configs_llama_cpp_computes_otherwise_are_refused(config_class, extra, words):
    with pytest.raises(UserError, match=words):
        arch_for(getattr(transformers, config_class)(**SMALL, **extra))


GRANITE4 = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
            "vocab_size": 304, "mamba_n_heads": 4, "layer_types": ["mamba", "attention"]}


GEMMA4 = {**SMALL, "global_head_dim": 32, "vocab_size_per_layer_input": 300}


@pytest.mark.parametrize("config_class,extra,gguf_name", [
    ("GraniteMoeHybridConfig", {}, "granitehybrid"),  # the released config.json's layer kinds
    ("GraniteMoeHybridConfig", {"layer_types": ["linear_attention", "full_attention"]}, "granitehybrid"),
    ("GraniteMoeHybridConfig", {"layer_types": ["attention"] * 2, "num_local_experts": 0}, "granite"),
    ("GraniteMoeHybridConfig", {"layer_types": ["attention"] * 2}, "granitemoe"),
])
def test_granite4_s_graph_follows_its_layers(config_class, extra, gguf_name):
    """Granite 4 with Mamba layers runs on llama.cpp's granitehybrid graph; without, on granite / granitemoe."""
    assert arch_for(getattr(transformers, config_class)(**{**GRANITE4, **extra})).gguf_name == gguf_name


def test_gemma4_and_its_multimodal_checkpoint_pass():
    text = transformers.Gemma4TextConfig(**GEMMA4)
    assert arch_for(text).gguf_name == "gemma4"
    assert arch_for(transformers.Gemma4Config(text_config=text.to_dict())).gguf_name == "gemma4"


@pytest.mark.parametrize("config_class,extra,words", [
    ("GraniteMoeHybridConfig", {"time_step_limit": (0.0, 10.0)}, "clamps the Mamba time step"),
    ("GraniteMoeHybridConfig", {"mamba_proj_bias": True}, "Mamba projections have biases"),
    ("GraniteMoeHybridConfig", {"mamba_expand": 4}, "mamba_expand is 4"),
    ("GraniteMoeHybridConfig", {"layer_types": ["mamba", "sliding_attention"]}, "layer_types hold"),
    ("Gemma4TextConfig", {"use_bidirectional_attention": "all"}, "bidirectional"),
    ("Gemma4TextConfig", {"hidden_activation": "gelu"}, "hidden_activation is gelu"),
    ("Gemma4TextConfig", {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                          "moe_intermediate_size": 32}, "MoE block"),
    ("Gemma4TextConfig", {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "not unscaled proportional"),
    ("Gemma4TextConfig", {"vocab_size_per_layer_input": 200}, "per-layer embedding has 200 rows"),
])
def test_granite4_and_gemma4_configs_llama_cpp_computes_otherwise_are_refused(config_class, extra, words):
    base = GRANITE4 if config_class.startswith("Granite") else GEMMA4
    with pytest.raises(UserError, match=words):
        arch_for(getattr(transformers, config_class)(**{**base, **extra}))
