"""A vision-language family is one entry of one table (issue 52, item 2): a test adds an entry to
``tasks/vlm/vision/table.py:FAMILIES`` for a family rocktune has never heard of (Qwen2-VL's architecture under a new
model_type, registered with transformers here as a user's own model would be), plus its tiny-model builder, and shows
that the tiny-model builder, the data encoder, the planner (``rocktune plan --task vlm``), the export's family lookup
and the adapter card pick it up, with no other file changed: the alias encodes, plans and exports as the family it
copies."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rocktune.cli import main

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")

ALIAS = "rt_plugin_vl"
BASE = "qwen2_vl"


@pytest.fixture(scope="module")
def plugged():
    """The new family: one table entry (a copy of Qwen2-VL's under the alias) and its tiny-model builder."""
    from rocktune.tasks.vlm.demo import tiny_vlm
    from rocktune.tasks.vlm.vision import table

    class PluginVLConfig(transformers.Qwen2VLConfig):
        model_type = ALIAS

    if ALIAS not in transformers.CONFIG_MAPPING:
        transformers.AutoConfig.register(ALIAS, PluginVLConfig)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(table.FAMILIES, ALIAS, replace(table.FAMILIES[BASE], model_type=ALIAS, name="Plugin-VL"))
        mp.setitem(tiny_vlm.FAMILIES, ALIAS, tiny_vlm.FAMILIES[BASE])
        yield


@pytest.fixture(scope="module")
def dirs(plugged, tmp_path_factory) -> dict[str, Path]:
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("plugin")
    return {kind: build_tiny_vlm(root / kind, seed=0, family=kind) for kind in (ALIAS, BASE)}


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> tuple[Path, Path]:
    from rocktune.tasks.vlm.demo.vision_task import write_colour_task

    return write_colour_task(tmp_path_factory.mktemp("colours"), n_train=4, n_eval=2, seed=0)


def test_the_tiny_model_builder_makes_the_new_family(dirs):
    from rocktune.tasks.vlm.planner.vlm import vlm_model_type
    from rocktune.tasks.vlm.vision.families import vision_checkpoint
    from rocktune.tasks.vlm.vision.model import model_type

    assert json.loads((dirs[ALIAS] / "config.json").read_text())["model_type"] == ALIAS
    assert model_type(str(dirs[ALIAS])) == ALIAS
    assert vlm_model_type(str(dirs[ALIAS])) == ALIAS
    kind, family = vision_checkpoint(str(dirs[ALIAS]))
    assert (kind, family.name, family.part("model.visual.merger.mlp.0")) == (ALIAS, "Plugin-VL", "projector")


def test_the_data_encoder_widens_its_images_by_the_entry_s_rule(dirs, colours):
    from transformers import AutoConfig

    from rocktune.data.records import read_records
    from rocktune.tasks.vlm.data.vision import encode
    from rocktune.models.load import load_tokenizer
    from rocktune.tasks.vlm.vision.model import vision_tokens, with_processor_template

    def encoded(model: Path):
        tok = with_processor_template(load_tokenizer(str(model), False), str(model))
        vision = vision_tokens(str(model), AutoConfig.from_pretrained(model), tok, None, None)
        return [encode(rec, colours[0].parent, tok, vision, 4096, loc) for loc, rec in read_records(colours[0])]

    plugin, base = encoded(dirs[ALIAS]), encoded(dirs[BASE])
    image = AutoConfig.from_pretrained(dirs[ALIAS]).image_token_id
    assert all(image in e.input_ids for e in plugin)
    assert [e.input_ids for e in plugin] == [e.input_ids for e in base]
    assert [e.labels for e in plugin] == [e.labels for e in base]


def test_the_planner_plans_it(dirs, capsys):
    def plan(model: Path) -> dict:
        capsys.readouterr()
        assert main(["plan", str(model), "--task", "vlm", "--image-size", "56x56", "--vram", "4GiB", "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    plugin, base = plan(dirs[ALIAS]), plan(dirs[BASE])
    assert plugin["terms"]["vision_forward"] > 0 and plugin["fits"]
    assert plugin["terms"] == base["terms"] and plugin["n_params"] == base["n_params"]
    assert plugin["fit"] == base["fit"]


def test_export_finds_its_projector(dirs):
    from transformers import AutoConfig

    from rocktune.tasks.vlm.export import gguf_vision
    from rocktune.tasks.vlm.vision import table

    cfg = AutoConfig.from_pretrained(dirs[ALIAS])
    assert gguf_vision.is_vision(cfg)
    assert gguf_vision.check(cfg) == table.FAMILIES[BASE].gguf
    state = {"model.visual.blocks.0.attn.qkv.weight": 1, "model.language_model.layers.0.mlp.up_proj.weight": 2,
             "lm_head.weight": 3}
    assert gguf_vision.split_state(state, cfg) == (
        {"model.layers.0.mlp.up_proj.weight": 2, "lm_head.weight": 3}, {"visual.blocks.0.attn.qkv.weight": 1})


def test_the_adapter_card_names_it(plugged):
    from rocktune.tasks.vlm.vision.table import names

    assert "Plugin-VL" in names().split(", ")
