"""MoE families on the stack of an older torch (transformers 4.57 with torch 2.4.1, `make test-torches`), where the
modules are laid out as transformers 4 had them: Granite 4's router keeps its Linear one level down
(``router.layer``) and its expert stacks are parameters called plain ``weight``; GLM-4.5's router returns the chosen
experts and their weights, no logits. On transformers 5 the same tests hold for its layout."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.family_fixtures import BY_NAME, build_family

pytestmark = pytest.mark.torches


@pytest.mark.parametrize("name", ["granite4", "glm4.5"])
def test_an_moe_family_trains_with_its_router_frozen_and_watched(tmp_path, name):
    """A few real training steps: the loss is finite and falls, the router is left out by name and never adapted,
    the expert stacks are adapted (their LoRA factors change), and the run records the experts' load."""
    from rocktune.config import config_from_dict
    from rocktune.tasks import train
    from tests.conftest import tiny_run_config, write_jsonl

    from tests.family_fixtures import TEMPLATES, chat_records

    model_dir = build_family(BY_NAME[name], tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", chat_records(64, TEMPLATES[BY_NAME[name].template].system))
    cfg = tiny_run_config(model_dir, data, None, tmp_path / "out", max_steps=4, micro_batch_size=8, grad_accum=1,
                          lr=1e-2, warmup_steps=0)
    cfg["data"].update(max_length=96, eval_fraction=0.0)
    cfg["lora"]["r"] = 4
    result = train(config_from_dict(cfg), quiet=True)
    assert all(math.isfinite(x) for x in result.losses) and result.losses[-1] < result.losses[0]
    notes = json.loads((tmp_path / "out" / "run_info.json").read_text())["notes"]
    said = next(n for n in notes if n.startswith("lora targets: "))
    # a router that is a Linear (Granite's, GLM-4.5's on transformers 5) is named as left out; transformers 4's
    # GLM-4.5 router is a module of its own, not a Linear, which all-linear never takes
    assert "left out: router" in said or name == "glm4.5"
    from safetensors.torch import load_file

    adapter = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    assert not [k for k in adapter if "router" in k or ".mlp.gate." in k]
    stacks = [k for k in adapter if {"granite4": "block_sparse_moe.", "glm4.5": "mlp.experts"}[name] in k]
    assert stacks and any(adapter[k].abs().sum() > 0 for k in stacks if "lora_B" in k)
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    loads = [m["expert_load"] for m in metrics if "expert_load" in m]
    if name == "glm4.5":  # its router is watched on both layouts (the logits recomputed where not returned)
        assert len(loads) == 4 and all(len(x) == 4 and sum(x) > 0 and sum(x) % 2 == 0 for x in loads)  # top-2


def test_expert_stacks_called_weight_are_named_so_only_they_match():
    """PEFT matches ``target_parameters`` by suffix: stacks called ``weight`` (transformers 4's Granite MoE) are
    named by the shortest tail no other parameter ends with; transformers 5's names stay as they are."""
    from rocktune.models.load import moe_expert_parameters

    class ParallelExperts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 8, 8))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.input_linear, self.output_linear = ParallelExperts(), ParallelExperts()
            self.router = torch.nn.Module()
            self.router.layer = torch.nn.Linear(8, 4, bias=False)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe, self.norm = Block(), torch.nn.LayerNorm(8)
            self.shared = torch.nn.Module()
            self.shared.input_linear = torch.nn.Linear(8, 8)

    model = torch.nn.Sequential(Layer(), Layer())
    # the shared MLP's input_linear.weight would match a shorter name; no other output_linear.weight exists
    assert moe_expert_parameters(model) == ["moe.input_linear.weight", "output_linear.weight"]
    from rocktune.models.targets import router_modules

    assert router_modules(model) == [model[0].moe.router.layer, model[1].moe.router.layer]


def test_a_router_that_returns_no_logits_has_them_recomputed():
    """transformers 4's GLM-4.5 router returns (indices, weights): the logits are its input times its weight."""
    from rocktune.models.routers import routing

    router = torch.nn.Linear(8, 4, bias=False)
    x = torch.randn(2, 3, 8)
    indices, weights = torch.tensor([[0, 1]] * 6), torch.rand(6, 2)
    logits, chosen = routing(router, (indices, weights), (x,))
    torch.testing.assert_close(logits, x.reshape(6, 8) @ router.weight.T)
    assert torch.equal(chosen, indices)
