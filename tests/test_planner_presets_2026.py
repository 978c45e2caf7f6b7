"""The 2025-26 presets (issue 53): `rocktune plan <preset>` counts each model at its released size.

A released name's figure is its count rounded (or truncated) to the figure's last digit, so the planner's count must
lie within one unit of that digit: Qwen3.5-397B-A17B's language model is 396.3B (the name is the whole checkpoint's,
vision encoder included), Qwen3-Next-80B-A3B activates 3.9B a token with its embedding tables. Where a vendor counts
otherwise, the row says how. The counts are pinned exactly as well; tests/test_planner.py checks every preset against
the real transformers model built on the meta device. Last, the two recurrent-layer rules the released widths brought
out (benchmarks/planner_validation.py --widths), checked on one small layer each.
"""

from __future__ import annotations

import json

import pytest

from rocktune.cli import main
from rocktune.planner.shapes import load_shape, presets, shape_from_config

B = 10**9


def _embeddings(shape) -> int:
    return shape.vocab * shape.hidden * (1 if shape.tie_embeddings else 2)


def _ple_table(shape) -> int:
    g = shape.gemma4
    return g.per_layer_vocab * shape.layers * g.per_layer


def _mtp_layer(name: str) -> int:
    """One more MoE decoder layer: the multi-token-prediction layer a GLM checkpoint ships and transformers drops."""
    config = dict(presets()[name])
    bigger = shape_from_config({**config, "num_hidden_layers": config["num_hidden_layers"] + 1})
    return bigger.n_params - shape_from_config(config).n_params


# preset: (n_params, active_params, [(what is counted, the count, released figure in billions, unit of its last digit)])
RELEASED = {
    "Qwen3.5-0.8B": (752_393_024, None, [("total", lambda s: s.n_params, 0.8, 0.1)]),
    "Qwen3.5-2B": (1_881_825_088, None, [("total", lambda s: s.n_params, 2, 1)]),
    "Qwen3.5-4B": (4_205_751_296, None, [("total", lambda s: s.n_params, 4, 1)]),
    "Qwen3.5-9B": (8_953_803_264, None, [("total", lambda s: s.n_params, 9, 1)]),
    "Qwen3.5-27B": (26_895_998_464, None, [("total", lambda s: s.n_params, 27, 1)]),
    "Qwen3.5-35B-A3B": (34_660_610_688, 3_454_988_928, [("total", lambda s: s.n_params, 35, 1),
                                                        ("active", lambda s: s.active_params, 3, 1)]),
    "Qwen3.5-122B-A10B": (122_111_526_912, 9_771_288_576, [("total", lambda s: s.n_params, 122, 1),
                                                           ("active", lambda s: s.active_params, 10, 1)]),
    "Qwen3.5-397B-A17B": (396_346_350_336, 17_349_040_896, [("total", lambda s: s.n_params, 397, 1),
                                                            ("active", lambda s: s.active_params, 17, 1)]),
    "Qwen3-Next-80B-A3B": (79_674_391_296, 3_874_929_408, [("total", lambda s: s.n_params, 80, 1),
                                                           ("active", lambda s: s.active_params, 3, 1)]),
    # "120b" has two significant digits; the model card's figures (116.8B, 5.1B active) leave out the input
    # embedding from the active count (the output head is computed by every token)
    "gpt-oss-120b": (116_829_156_672, 5_711_982_912, [
        ("total", lambda s: s.n_params, 120, 10), ("total, card", lambda s: s.n_params, 116.8, 0.1),
        ("active less the input embedding, card", lambda s: s.active_params - s.vocab * s.hidden, 5.1, 0.1)]),
    # E2B/E4B count "effective" parameters: without the per-layer embedding table, a lookup
    "gemma-4-E2B": (4_628_569_344, None, [("effective", lambda s: s.n_params - _ple_table(s), 2, 1)]),
    "gemma-4-E4B": (7_463_013_376, None, [("effective", lambda s: s.n_params - _ple_table(s), 4, 1)]),
    "gemma-4-31B": (30_697_345_280, None, [("total", lambda s: s.n_params, 31, 1)]),
    # the name gives the active size and the experts; the card's 109B total is the whole checkpoint's
    "Llama-4-Scout-17B-16E": (107_769_861_120, 17_172_894_720, [("active", lambda s: s.active_params, 17, 1),
                                                                ("experts", lambda s: s.experts * B, 16, 1)]),
    # the name carries no size; Z.ai's 355B-A32B counts no embedding or output table, and its total counts the
    # multi-token-prediction layer the checkpoint ships (transformers drops it, so the plan has no such layer)
    "GLM-4.5": (352_797_814_784, 33_632_251_904, [
        ("total without embeddings, with the MTP layer",
         lambda s: s.n_params - _embeddings(s) + _mtp_layer("GLM-4.5"), 355, 1),
        ("active without embeddings", lambda s: s.active_params - _embeddings(s), 32, 1)]),
    "Olmo-3-7B": (7_298_011_136, None, [("total", lambda s: s.n_params, 7, 1)]),
    "Olmo-3-32B": (32_233_522_176, None, [("total", lambda s: s.n_params, 32, 1)]),
    # the name carries no size; IBM's card: 7B total, 1B active
    "granite-4.0-h-tiny": (6_939_037_248, 1_465_470_528, [("total", lambda s: s.n_params, 7, 1),
                                                          ("active", lambda s: s.active_params, 1, 1)]),
}


def _plan(name: str, capsys) -> dict:
    assert main(["plan", name, "--vram", "80GiB", "--max-length", "512", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_plan_counts_the_released_size(name, capsys):
    doc = _plan(name, capsys)
    n_params, active, checks = RELEASED[name]
    assert doc["n_params"] == n_params
    assert doc["active_params"] == (active or n_params)
    shape = load_shape(name)
    assert (shape.n_params, shape.active_params) == (doc["n_params"], doc["active_params"])
    for what, count, figure, unit in checks:
        assert abs(count(shape) / B - figure) < unit, f"{name}: {what} {count(shape) / B:.3f}B vs {figure}B"


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_a_preset_plans_as_its_config_json(name, tmp_path, capsys):
    """A preset is a config.json: the same file (nested as a vision-language release nests it) plans the same."""
    config = {k: v for k, v in presets()[name].items() if k != "source"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "wrapper", "text_config": config}))
    from_file = json.dumps(_plan(str(tmp_path), capsys)).replace(str(tmp_path / "config.json"), name)
    assert from_file == json.dumps(_plan(name, capsys))


@pytest.mark.parametrize("hub_id, name", [
    ("Qwen/Qwen3.5-9B", "Qwen3.5-9B"), ("Qwen/Qwen3.5-35B-A3B", "Qwen3.5-35B-A3B"),
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", "Qwen3-Next-80B-A3B"), ("openai/gpt-oss-120b", "gpt-oss-120b"),
    ("google/gemma-4-E2B-it", "gemma-4-E2B"), ("google/gemma-4-31B-it", "gemma-4-31B"),
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "Llama-4-Scout-17B-16E"), ("zai-org/GLM-4.5", "GLM-4.5"),
    ("allenai/Olmo-3-7B-Instruct", "Olmo-3-7B"), ("ibm-granite/granite-4.0-h-tiny", "granite-4.0-h-tiny"),
])
def test_hub_ids_map_to_the_presets(hub_id, name):
    assert load_shape(hub_id).name == name


def test_gpt_oss_120b_experts_are_mxfp4_as_shipped():
    """Like gpt-oss-20b's, the preset carries the release's MXFP4 quantization_config: the experts train
    dequantised, and the plan says what they are packed."""
    shape = load_shape("gpt-oss-120b")
    assert shape.mxfp4_experts and (shape.experts, shape.experts_per_token, shape.layers) == (128, 4, 36)


def test_every_preset_names_its_source():
    assert all(entry.get("source") for entry in presets().values())


# What the released widths taught the recurrent layers' model (benchmarks/planner_validation.py --widths): a Mamba2
# mixer whose sequence fits one chunk (Granite 4's chunk of 256) and a Gated DeltaNet with as many key as value heads
# (Qwen3.5-0.8B, 2B) save less than the general rule says; one fp32 layer alone, its saved bytes against the planner's.

def _saved_by(layer, x) -> int:
    import torch

    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes():
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(saved.values())


def _fp32_tokens(b: int, s: int):
    from rocktune.planner.activations import Tokens

    return Tokens(batch=b, seq=s, dt=4, amp=False, attn="sdpa", stream=0, padded=False, rank=8, dropout=0.0,
                  mask_bytes=4, compiled=False, kv_copies=False, expert_pad=0.0)


@pytest.mark.parametrize("chunk, b", [(256, 1), (256, 2), (128, 1), (128, 2)])
def test_mamba2_mixer_within_one_chunk(chunk, b):
    """Within one chunk the scan's einsums take the chunk states (and in fp32 an x copy, with one row two C/B copies
    too) as views; two chunks or more copy them."""
    import torch
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

    from rocktune.planner import recurrent

    fields = dict(model_type="granitemoehybrid", hidden_size=64, num_hidden_layers=1, layer_types=["mamba"],
                  mamba_n_heads=8, mamba_d_head=16, mamba_d_state=32, mamba_chunk_size=chunk)
    torch.manual_seed(0)
    layer = GraniteMoeHybridMambaLayer(GraniteMoeHybridConfig(**fields), 0).train().requires_grad_(False)
    measured = _saved_by(layer, torch.randn(b, 256, 64, requires_grad=True))
    assert recurrent.mamba_saved(recurrent.linear_attn(fields, "mamba"), _fp32_tokens(b, 256)) == measured


@pytest.mark.parametrize("k_heads, v_heads, b", [(2, 2, 1), (2, 2, 2), (2, 4, 1)])
def test_gated_deltanet_with_as_many_key_as_value_heads(k_heads, v_heads, b):
    """Unrepeated fp32 q and k reach the L2 norm as views of the conv's output (q, k and v in one storage)."""
    import torch
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from rocktune.planner import recurrent

    fields = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=32,
                  linear_value_head_dim=32, linear_conv_kernel_dim=4, layer_types=["linear_attention"],
                  intermediate_size=64, vocab_size=64)
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(AutoConfig.for_model("qwen3_5_text", **fields), 0).train().requires_grad_(False)
    measured = _saved_by(layer, torch.randn(b, 128, 64, requires_grad=True))
    la = recurrent.linear_attn({"model_type": "qwen3_5_text", **fields}, "gdn")
    assert recurrent.saved(la, _fp32_tokens(b, 128)) == measured
