"""The 2025-26 presets (issue 53): `rocktune plan <preset>` counts each model at its released size.

A released name's figure is its count rounded (or truncated) to the figure's last digit, so the planner's count must
lie within one unit of that digit: Qwen3.5-397B-A17B's language model is 396.3B (the name also counts the vision
encoder), Qwen3-Next-80B-A3B activates 3.9B a token with its embedding tables. Where a vendor counts otherwise, the
row says how. The counts are pinned exactly as well; tests/test_planner.py checks every preset against the real
transformers model built on the meta device.
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
    # the name gives the active size and the experts; the 109B total counts the vision encoder too
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
