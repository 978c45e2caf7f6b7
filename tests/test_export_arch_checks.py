"""The 2025-26 families' configurations that llama.cpp's graphs compute otherwise are refused before any weight is
loaded (export/arch.py, gpt_oss.py, llama4.py), with what differs; the supported ones pass the same checks."""

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


@pytest.mark.parametrize("config_class", ["GraniteMoeHybridConfig", "Gemma4TextConfig"])
def test_families_not_exported_yet_are_refused_by_name(config_class):
    """Granite 4 and Gemma 4 (their CLI cells, exit 2 and no file: tests/test_families.py::test_gguf)."""
    cfg = getattr(transformers, config_class)()
    with pytest.raises(UserError, match=f"does not support the {cfg.model_type} architecture"):
        arch_for(cfg)
