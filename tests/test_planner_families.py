"""The planner knows the 2025-26 architectures (issue 53): parameters equal the real transformers model (built on the
meta device), the LoRA count equals what rocktune's all-linear trains, and the bytes a training step saves are within
the planner's CPU tolerance (5%, docs/planner.md) of a measured step (benchmarks/planner_validation.py --families)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from rocktune.planner.estimate import RunSpec, estimate, lora_param_count
from rocktune.planner.shapes import shape_from_config

_spec = importlib.util.spec_from_file_location(
    "planner_validation", Path(__file__).parents[1] / "benchmarks" / "planner_validation.py")
pv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pv)

# the validation's own shapes, one per family the planner learnt here
FAMILIES = {"olmo3": "tiny-olmo3", "qwen3_5_text": "tiny-qwen3.5", "qwen3_5_moe_text": "tiny-qwen3.5-moe",
            "qwen3_next": "tiny-qwen3-next", "gemma4_text": "tiny-gemma4", "granitemoehybrid": "tiny-granite4"}


def _config(kind: str):
    from transformers import AutoConfig

    config = dict(pv.MODELS[FAMILIES[kind]])
    return AutoConfig.for_model(config.pop("model_type"), **config)


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_parameters_exact(kind):
    from transformers import AutoModelForCausalLM

    cfg = _config(kind)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shape = shape_from_config(cfg.to_dict(), kind)
    assert shape.n_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_lora_count_is_what_peft_trains(kind):
    from transformers import AutoModelForCausalLM

    from rocktune.models.load import apply_lora

    cfg = _config(kind)
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_config(cfg), 4, 8.0, 0.0, "all-linear", False)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_param_count(shape_from_config(cfg.to_dict(), kind), RunSpec(lora_r=4)) == trained


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_released_sizes_exact(kind):
    """transformers' default config of each family (its released size: OLMo 3 7B, Qwen3.5 9B, Qwen3.5-35B-A3B,
    Qwen3-Next-80B-A3B, Gemma 4), built on the meta device: total and active parameters as the planner reads them
    (Qwen3.5-MoE's config sizes only its experts: no intermediate_size)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(kind)
    with torch.device("meta"):
        params = dict(AutoModelForCausalLM.from_config(cfg).named_parameters())
    shape = shape_from_config(cfg.to_dict(), kind)
    total = sum(p.numel() for p in params.values())
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    assert shape.n_params == total
    assert shape.active_params == total - experts + (experts * shape.experts_per_token // shape.experts
                                                     if shape.experts else 0)


def test_olmo3_sliding_layers_read():
    """OLMo 3's layer kinds: 3 sliding layers of 4 with a window of 32, two rotary tables kept in fp32; its config
    class's default pattern (every fourth layer full) where layer_types is left out."""
    shape = shape_from_config(pv.OLMO3)
    assert (shape.sliding_layers, shape.sliding_window, shape.rope_tables, shape.rope_fp32) == (3, 32, 2, True)
    bare = {k: v for k, v in pv.OLMO3.items() if k != "layer_types"} | {"num_hidden_layers": 8}
    assert shape_from_config(bare).sliding_layers == 6


def test_olmo3_window_mask_only_past_the_window():
    """A window at least as long as the sequence builds no mask: OLMo 3 then saves what OLMo 2 saves, plus its second
    rotary table; past the window every sliding layer saves a float mask and K/V repeated for SDPA."""
    def saved(config, s):
        return estimate(shape_from_config(config), RunSpec(seq_len=s, device="cpu")).saved_bytes

    olmo2 = {k: v for k, v in pv.OLMO3.items() if k not in ("sliding_window", "layer_types")} | {"model_type": "olmo2"}
    rope = 2 * 32 * 32 * 4  # cos and sin of 32 positions, head_dim 32, fp32
    assert saved(pv.OLMO3, 32) == saved(olmo2, 32) + rope
    mask, kv = 64 * 64 * 4, 2 * 64 * (128 - 64) * 4  # per sliding layer: the float mask, k and v at the query width
    assert saved(pv.OLMO3, 64) == saved(olmo2, 64) + 2 * 64 * 32 * 4 + 3 * (mask + kv)


def test_qwen3_5_layers_read():
    """Qwen3.5: three Gated DeltaNet layers of four (the first among them), the full layer's q_proj twice as wide
    (its output gate); the linear layers' projections and out_proj are adapted, their conv is no Linear."""
    shape = shape_from_config(pv.QWEN35)
    la = shape.linear_attn
    assert (la.layers, la.first, la.conv_width, la.value_width, shape.gated_attn) == (3, True, 256, 128, True)
    kinds = {n: [name for name, *_ in lin] for n, lin in shape.layer_linears()}
    assert kinds[3][:5] == ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
    assert dict((name, o) for name, _, o, _ in shape.linears())["q_proj"] == 2 * 128


def test_qwen3_next_projections_fused():
    """Qwen3-Next: q/k/v/z in one in_proj_qkvz, beta's and the decay's inputs in one in_proj_ba, both adapted."""
    shape = shape_from_config(pv.QWEN3_NEXT)
    lin = dict((name, (i, o)) for name, i, o, _ in shape.layer_linears()[1][1])
    assert (lin["in_proj_qkvz"], lin["in_proj_ba"], lin["out_proj"]) == ((128, 384), (128, 8), (128, 128))


def test_rollout_caches_of_a_hybrid():
    """GRPO's sampling on Qwen3.5: K/V only for its full-attention layer; each linear-attention layer keeps its conv
    cache (the last 4 inputs of 256 channels) and its fp32 state (4 heads x 32 x 32) per row, whatever the length."""
    spec = RunSpec(rollout_rows=8, rollout_prompt=100, rollout_new=28, precision="bf16")
    terms = estimate(shape_from_config(pv.QWEN35), spec).by_name()
    assert terms["rollout_kv_cache"] == 2 * 1 * (2 * 32) * 2 * 8 * 128
    assert terms["rollout_recurrent_state"] == 3 * 8 * (256 * 4 * 2 + 4 * 32 * 32 * 4)


def test_qwen3_5_recurrence_scales_with_chunks():
    """The delta rule's saved bytes follow the padded length (chunks of 64): 65 tokens save as much kernel state
    as 128, beyond what grows per token."""
    from rocktune.planner import recurrent
    from rocktune.planner.activations import Tokens

    la = shape_from_config(pv.QWEN35).linear_attn
    def kernel(s):
        return recurrent.saved(la, Tokens(batch=1, seq=s, dt=4, amp=False, attn="sdpa", padded=False, rank=8,
                                          dropout=0.0, mask_bytes=4))
    per_token = kernel(127) - kernel(126)  # within one padded length: only the per-token tensors grow
    assert kernel(128) - kernel(127) != per_token  # 128 is a whole number of chunks: the copies are kept
    assert kernel(65) - kernel(64) > 10 * per_token  # a second chunk starts


@pytest.mark.parametrize("extra", [{"num_kv_shared_layers": 2, "use_double_wide_mlp": True, "layer_types": [
    "sliding_attention", "full_attention", "sliding_attention", "full_attention"]},
                                   {"attention_k_eq_v": True, "num_global_key_value_heads": 1},
                                   {"hidden_size_per_layer_input": 0, "layer_types": None}])
def test_gemma4_variants_parameters_exact(extra):
    """Gemma 4's other layouts: KV-shared last layers (no k/v projections, double-wide MLPs), full layers whose values
    are their keys, no per-layer inputs with the default layer pattern (every sixth layer full)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {**{k: v for k, v in pv.GEMMA4.items() if k != "model_type"}, **extra}
    config = {k: v for k, v in config.items() if v is not None}
    cfg = AutoConfig.for_model("gemma4_text", **config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shape = shape_from_config(cfg.to_dict(), "gemma4_text")
    assert shape.n_params == sum(p.numel() for p in model.parameters())


def test_gemma4_moe_block_refused():
    from rocktune.errors import UserError

    with pytest.raises(UserError, match="enable_moe_block"):
        shape_from_config({**pv.GEMMA4, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                           "moe_intermediate_size": 64})


def test_granite4_layers_read():
    """Granite 4: three Mamba2 layers of four (in_proj makes the gate, x/B/C and dt: 128 + 160 + 4), the shared MLP's
    fused input_linear, and its logits scale: the full-logits loss, as rocktune's loss takes it."""
    shape = shape_from_config(pv.GRANITE4)
    m = shape.linear_attn.mamba
    assert (shape.linear_attn.layers, m.inner, m.conv_width) == (3, 128, 160)
    lin = dict((name, (i, o)) for name, i, o, _ in shape.layer_linears()[1][1])
    assert (lin["in_proj"], lin["out_proj"], lin["input_linear"]) == ((64, 292), (128, 64), (64, 128))
    terms = estimate(shape, RunSpec(seq_len=128, device="cpu")).by_name()
    assert terms["loss_saved"] == 127 * 1024 * 4 + 127 * 8


POINTS = [("tiny-olmo3", 1, 128, 8, "bf16", "sdpa", False, 0.0), ("tiny-olmo3", 4, 64, 4, "fp32", "eager", True, 0.0),
          ("tiny-qwen3.5", 1, 128, 8, "bf16", "sdpa", False, 0.0),
          ("tiny-qwen3.5", 2, 96, 8, "fp32", "sdpa", False, 0.0),
          ("tiny-qwen3.5", 4, 64, 4, "fp32", "sdpa", True, 0.0),
          ("tiny-qwen3.5-moe", 1, 128, 8, "fp32", "sdpa", False, 0.0),
          ("tiny-qwen3.5-moe", 4, 64, 8, "bf16", "sdpa-grouped", False, 0.0),
          ("tiny-qwen3-next", 1, 128, 8, "bf16", "sdpa", False, 0.0),
          ("tiny-gemma4", 1, 128, 8, "bf16", "sdpa", False, 0.0), ("tiny-gemma4", 4, 64, 4, "fp32", "sdpa", True, 0.0),
          ("tiny-granite4", 1, 128, 8, "bf16", "sdpa", False, 0.0),
          ("tiny-granite4", 4, 64, 4, "fp32", "eager", True, 0.0)]


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS, ids=lambda p: "-".join(map(str, p)))
def test_saved_activations_within_5_percent(point):
    row = pv.run_point(*point)
    assert abs(row["saved_error"]) < 0.05, row
    assert row["state_exact"], row
