"""The vision patch embedding as a matmul (model.vision_patch_embed: linear): the Conv3d whose stride equals its
kernel computes, per patch, the dot product with each filter, so one F.linear gives the same output, the same
gradients and the same training, with the weights and saved files unchanged. On ROCm, where that Conv3d was
reported to crash (platform/knowledge.yaml rocm-conv3d-patch-embed), the run says so and how to switch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rocktune.tasks.vlm.vision.model import patch_embed_as_linear

PLATFORMS = Path(__file__).parent / "data" / "platforms"


@pytest.mark.parametrize(("kernel", "bias", "shape"), [((2, 14, 14), False, (50, 3, 2, 14, 14)),
                                                       ((2, 16, 16), True, (3, 3, 4, 32, 48))])
def test_the_matmul_equals_the_convolution_and_its_gradients(kernel, bias, shape):
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, 24, kernel, stride=kernel, bias=bias)
    holder = torch.nn.Module()
    holder.visual = torch.nn.Module()
    holder.visual.proj = conv
    x = torch.randn(shape, requires_grad=True)
    ref = conv(x)
    (gx_ref, gw_ref) = torch.autograd.grad(ref.square().sum(), (x, conv.weight))
    before = {k: v.clone() for k, v in holder.state_dict().items()}
    assert patch_embed_as_linear(holder) == 1
    got = conv(x)
    (gx, gw) = torch.autograd.grad(got.square().sum(), (x, conv.weight))
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(gx, gx_ref)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-4)
    assert all(torch.equal(v, before[k]) for k, v in holder.state_dict().items())


def test_only_whole_patch_convolutions_of_the_vision_tower_are_replaced():
    m = torch.nn.Module()
    m.visual = torch.nn.Module()
    m.visual.overlapping = torch.nn.Conv3d(3, 4, 3, stride=1)
    m.other = torch.nn.Conv3d(3, 4, 2, stride=2)  # outside the vision tower
    assert patch_embed_as_linear(m) == 0


def _platform(name: str):
    from rocktune.platform.detect import Platform

    return Platform.from_dict(json.loads((PLATFORMS / f"{name}.json").read_text()))


def test_the_rocm_report_is_shown_for_auto_and_nothing_changes_by_itself(tmp_path):
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from rocktune.tasks.vlm.build import patch_embed
    from rocktune.tasks.vlm.vision.model import load_vlm

    model = load_vlm(str(build_tiny_vlm(tmp_path / "m")), "fp32", "sdpa", "cpu")
    conv = model.model.visual.patch_embed.proj
    rocm, cpu = _platform("mi300x_gfx942"), _platform("cpu_only")
    (note,) = patch_embed(model, "auto", rocm)
    assert "SIGSEGV on ROCm" in note and "model.vision_patch_embed: linear" in note
    assert "forward" not in vars(conv)  # auto leaves the Conv3d: a reported rule is shown, not applied
    assert patch_embed(model, "auto", cpu) == [] and patch_embed(model, "conv3d", rocm) == []
    assert patch_embed(model, "linear", cpu) == ["vision patch embedding: 1 Conv3d run as one matmul each "
                                                 "(model.vision_patch_embed=linear)"]
    assert "forward" in vars(conv)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen2_vl", "qwen3_5"])
def test_training_with_the_matmul_gives_the_same_losses(tmp_path, family):
    from rocktune.config import config_from_dict
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from rocktune.tasks.vlm.demo.vision_task import write_colour_task
    from rocktune.tasks import train
    from tests.test_vlm_train import vlm_config

    model, data = build_tiny_vlm(tmp_path / "m", family=family), write_colour_task(tmp_path / "d", 16, 4, seed=3)
    losses, notes = {}, {}
    for setting in ("conv3d", "linear"):
        cfg = vlm_config(model, data, tmp_path / setting, max_steps=4, micro_batch_size=4)
        cfg["model"]["vision_patch_embed"] = setting
        train(config_from_dict(cfg), quiet=True)
        rows = [json.loads(x) for x in (tmp_path / setting / "metrics.jsonl").read_text().splitlines()]
        losses[setting] = [r["loss"] for r in rows if "loss" in r] + [r["eval_loss"] for r in rows if "eval_loss" in r]
        notes[setting] = json.loads((tmp_path / setting / "run_info.json").read_text())["notes"]
    assert losses["linear"] == pytest.approx(losses["conv3d"], rel=1e-5)
    assert any("1 Conv3d run as one matmul" in n for n in notes["linear"])
    assert not any("matmul" in n for n in notes["conv3d"])
