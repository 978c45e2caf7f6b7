"""The planner knows mixture-of-experts models: every family's parameters counted exactly from config.json (against
the real transformers model, built on the meta device), experts at their storage precision, the routed
activations, and `plan`/`train --auto` on Qwen3-30B-A3B's shape for a 24 and a 32 GiB card."""

from __future__ import annotations

import json

import pytest
import torch

from rocktune.planner.estimate import GIB, RunSpec, estimate, lora_param_count, quantised_bytes
from rocktune.planner.fit import fit
from rocktune.planner.moe import moe_shape, stack_values
from rocktune.planner.shapes import load_shape, shape_from_config

SMALL = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 300, "head_dim": 16}
# each family's own field names, as its transformers 5 config class takes them
FAMILIES = {
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 96,
                  "mlp_only_layers": [1], "decoder_sparse_step": 1},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48,
                "layer_types": ["sliding_attention", "full_attention"] * 2},
    "glm4_moe": {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "intermediate_size": 96, "n_shared_experts": 1, "first_k_dense_replace": 1, "use_qk_norm": True,
                 "n_group": 1, "topk_group": 1},
    "llama4_text": {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size": 32,
                    "intermediate_size_mlp": 96, "interleave_moe_layer_step": 2, "moe_layers": None},
}


def _config(kind: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(kind, **SMALL, **FAMILIES[kind])


def _meta_model(cfg):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_parameters_exact(kind):
    """Total, expert and active parameters of the planner's shape equal the real model's, for the config as
    transformers 5 saves it."""
    cfg = _config(kind)
    model = _meta_model(cfg)
    shape = shape_from_config(cfg.to_dict(), kind)
    params = dict(model.named_parameters())
    assert shape.n_params == sum(p.numel() for p in params.values())
    stacks = sum(p.numel() for n, p in params.items() if ".experts." in n and not n.endswith("_bias"))
    assert stacks == shape.moe_layers * stack_values(shape)
    idle = (shape.experts - shape.experts_per_token) / shape.experts
    expert_all = sum(p.numel() for n, p in params.items() if ".experts." in n)
    assert shape.active_params == shape.n_params - round(expert_all * idle)


def test_dense_layers_and_shared_experts_counted():
    assert [load(k) for k in ("qwen3_moe", "glm4_moe", "llama4_text", "mixtral")] == [
        (1, 0), (1, 32), (2, 32), (0, 0)]  # (dense layers, shared expert width)


def load(kind: str) -> tuple[int, int]:
    shape = shape_from_config(_config(kind).to_dict(), kind)
    return shape.dense_layers, shape.shared_intermediate


def test_qwen3_5_moe_experts_counted():
    """Qwen3.5-MoE (linear attention in 3 of 4 layers, planned by planner/recurrent.py): its experts,
    shared expert and gate as the real model has them."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("qwen3_5_moe_text", **SMALL, num_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=32, shared_expert_intermediate_size=48,
                               layer_types=["linear_attention", "linear_attention", "linear_attention",
                                            "full_attention"])
    mo = moe_shape(cfg.to_dict(), "qwen3_5_moe")
    params = dict(_meta_model(cfg).named_parameters())
    assert (mo.experts, mo.per_token, mo.width, mo.shared, mo.shared_gate, mo.dense_layers) == (8, 2, 32, 48, True, 0)
    stacks = sum(p.numel() for n, p in params.items() if ".experts." in n)
    assert stacks == 4 * 8 * 3 * 64 * 32
    shared = sum(p.numel() for n, p in params.items() if ".shared_expert." in n or "shared_expert_gate" in n)
    assert shared == 4 * (3 * 64 * 48 + 64)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "gpt_oss", "glm4_moe"])
def test_lora_count_is_what_peft_trains(kind):
    """all-linear on an MoE model: attention, the shared expert and dense layers' MLPs, and every expert stack,
    as rocktune's apply_lora builds it (the routers and 1-wide gates frozen)."""
    from transformers import AutoModelForCausalLM

    from rocktune.models.load import apply_lora

    cfg = _config(kind)
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_config(cfg), 4, 8.0, 0.0, "all-linear", False)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_param_count(shape_from_config(cfg.to_dict(), kind), RunSpec(lora_r=4)) == trained


def _stored(kind_dir, tmp_path):
    """A tiny family loaded in nf4 with rocktune's LoRA (all-linear): its expert stacks as stored."""
    from rocktune.models.load import apply_lora, load_model
    from tests.family_fixtures import BY_NAME, build_family

    path = build_family(BY_NAME[kind_dir], tmp_path / kind_dir)
    model = apply_lora(load_model(str(path), "bf16", "sdpa", False, "cpu", "nf4"), 4, 8.0, 0.0, "all-linear", False)
    four_bit = [s for m in model.modules() for s in getattr(m, "_rt_nf4", {}).values()]
    full = [p for n, p in model.named_parameters() if ".experts." in n and "lora_" not in n and p.numel()]
    return four_bit, full, load_shape(str(path))


def test_nf4_expert_stacks_counted_as_stored(tmp_path):
    """model.quantization nf4 on the grouped expert path: lora/moe_nf4.py stores each expert's stacks in 4 bit; the
    planner's bytes for them equal the stored bytes (packed values and absmax) of a real load."""
    from rocktune.planner import moe

    four_bit, full, shape = _stored("qwen3-moe", tmp_path)
    assert four_bit and not full
    assert moe.stacks_4bit(shape, "nf4", True)
    assert sum(s.nbytes() for s in four_bit) == moe.stack_bytes_4bit(shape, quantised_bytes)


def test_nf4_llama4_expert_stacks_counted_as_stored(tmp_path):
    """Llama 4's experts take the grouped path too (lora/moe.py: the router score scales each routed token's input):
    nf4 stores its stacks in 4 bit, and the planner's bytes for them equal the stored bytes of a real load."""
    from rocktune.planner import moe

    four_bit, full, shape = _stored("llama4", tmp_path)
    assert four_bit and not full
    assert moe.stacks_4bit(shape, "nf4", True)
    assert sum(s.nbytes() for s in four_bit) == moe.stack_bytes_4bit(shape, quantised_bytes)


def test_nf4_shrinks_qwen3_30b_a3b():
    shape = load_shape("Qwen/Qwen3-30B-A3B")
    bf16 = estimate(shape, RunSpec(precision="bf16")).by_name()["base_weights"]
    nf4 = estimate(shape, RunSpec(precision="bf16", quant="nf4")).by_name()["base_weights"]
    assert bf16 == shape.n_params * 2
    stacks = shape.moe_layers * stack_values(shape)
    assert stacks / shape.n_params > 0.9
    assert nf4 < bf16 / 3  # the stacks at 0.5625 B a value, the rest of the linears 0.516, the others fp32


def test_routed_activations_scale_with_top_k():
    """The MoE block's saved bytes grow with experts per token (the routed rows), not with the experts."""
    base = json.loads(json.dumps(_config("qwen3_moe").to_dict()))
    saved = {}
    for k, e in ((2, 8), (4, 8), (2, 64)):
        shape = shape_from_config({**base, "num_local_experts": e, "num_experts_per_tok": k}, "q")
        saved[(k, e)] = estimate(shape, RunSpec(micro_batch=4, seq_len=512)).by_name()["activations"]
    assert saved[(4, 8)] > 1.3 * saved[(2, 8)]
    assert saved[(2, 64)] < 1.1 * saved[(2, 8)]


@pytest.mark.parametrize("vram", [24, 32])
def test_qwen3_30b_a3b_fits_a_card(vram):
    """`plan Qwen/Qwen3-30B-A3B --vram 24GiB / 32GiB`: bf16 weights alone are 57 GiB, so the planner proposes the nf4
    base (4-bit expert stacks) and at 24 GiB a lower rank, with settings that fit the card with its margin."""
    shape = load_shape("Qwen/Qwen3-30B-A3B")
    assert (shape.experts, shape.experts_per_token, shape.layers) == (128, 8, 48)
    sug = fit(shape, RunSpec(seq_len=2048, lora_r=16, device="gpu"), vram * GIB, "auto", 8)
    assert sug.quant == "nf4" and sug.total_bytes <= 0.95 * vram * GIB
    assert (sug.lora_r, sug.max_length) == ((4, 2048) if vram == 24 else (16, 2048))


def test_train_auto_applies_the_moe_fit(tmp_path):
    """`train --auto --vram 32GiB` on Qwen3-30B-A3B's config.json (a local directory: no hub here; this machine has no
    GPU, so the CPU's overheads: its 1 GiB resident set, foreach AdamW's temporaries) takes the planner's nf4
    experts, rank and batch settings into the run's config, alpha scaled with the rank."""
    from rocktune.config import config_from_dict
    from rocktune.planner.shapes import presets
    from rocktune.tasks.causal.autofit import apply_fit
    from tests.conftest import tiny_run_config, write_jsonl

    model = tmp_path / "qwen3-30b-a3b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({k: v for k, v in presets()["Qwen3-30B-A3B"].items()
                                                   if k != "source"}))
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": "a b c"}] * 4)
    cfg = tiny_run_config(model, data, None, tmp_path / "out", micro_batch_size=8, grad_accum=1)
    cfg["data"]["max_length"] = 1024
    cfg["lora"].update(r=16, alpha=32.0)
    fitted, notes, peak = apply_fit(config_from_dict(cfg), "bf16", "sdpa", 32 * GIB)
    assert fitted.model.quantization == "nf4" and fitted.lora.r < 16
    assert fitted.lora.alpha / fitted.lora.r == 2.0
    assert fitted.training.micro_batch_size * fitted.training.grad_accum == 8
    assert notes[0].startswith("--auto: model.quantization=nf4 lora.r=")
    assert any("proposing lora.r=" in n for n in notes)
    spec = RunSpec(micro_batch=fitted.training.micro_batch_size, seq_len=fitted.data.max_length,
                   lora_r=fitted.lora.r, precision="bf16", quant="nf4", device="cpu",
                   checkpointing=fitted.model.gradient_checkpointing)
    assert estimate(load_shape(str(model)), spec).total_bytes <= 0.95 * 32 * GIB
    assert peak == estimate(load_shape(str(model)), spec).peak_allocated


def _validation():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "planner_validation", Path(__file__).parents[1] / "benchmarks" / "planner_validation.py")
    pv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pv)
    return pv


# every MoE family validated, both expert paths (padded: fp32 and the CPU; grouped: bf16 on a GPU, here through
# torch's CPU grouped_mm), checkpointing on and off (benchmarks/planner_validation.py --moe runs all 50 points)
VALIDATION = [("tiny-qwen3-moe", 4, 64, 8, "fp32", "sdpa", False, 0.0),
              ("tiny-qwen3-moe", 1, 128, 8, "bf16", "sdpa-grouped", False, 0.0),
              ("tiny-mixtral", 4, 64, 8, "bf16", "sdpa-grouped", False, 0.0),
              ("tiny-mixtral", 1, 128, 4, "bf16", "sdpa", True, 0.0),
              ("tiny-glm4-moe", 1, 128, 8, "fp32", "sdpa", False, 0.0),
              ("tiny-glm4-moe", 4, 64, 4, "bf16", "sdpa-grouped", True, 0.0),
              ("tiny-llama4", 1, 128, 8, "bf16", "sdpa", False, 0.0)]


@pytest.mark.parametrize("point", VALIDATION, ids=lambda p: "-".join(map(str, p)))
def test_saved_activations_of_moe_steps(point):
    """A real training step of a random-init MoE model: the bytes autograd saves within 3% of the planner's count
    (the padded path sized by the step's own routing), parameters, gradients and AdamW states exact."""
    row = _validation().run_point(*point)
    assert abs(row["saved_error"]) < 0.03, row
    assert row["state_exact"], row


def test_saved_activations_of_an_nf4_moe_step(tmp_path):
    """Qwen3-MoE loaded as a run loads it with model.quantization nf4 (4-bit linears and expert stacks, bf16
    autocast, the fp32 stream of a QLoRA base): saved bytes within 3% of the planner's."""
    row = _validation().run_nf4_point("tiny-qwen3-moe", 1, 128, 8, False, str(tmp_path / "m"))
    assert abs(row["saved_error"]) < 0.03, row
