"""The Wan planner: latent tokens, preset shapes, exact parameter counts, and saved-for-backward bytes of real steps.

The validation grid (32 points) is ``benchmarks/planner_validation_wan.py``; the default subset here covers both
models, both precisions, checkpointing on and off, video and image sizes; the rest is marked slow.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rocktune.errors import UserError
from rocktune.tasks.wan.plan import WanSpec, estimate_wan, largest_frames, load_wan_shape

_spec = importlib.util.spec_from_file_location(
    "planner_validation_wan", Path(__file__).parents[1] / "benchmarks" / "planner_validation_wan.py")
pvw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pvw)

WAN21 = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory) -> Path:
    from rocktune.tasks.wan.diffusion.tiny import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("planner_wan") / "tiny-wan")


def test_latent_tokens_follow_vae_and_patch():
    shape = load_wan_shape(WAN21)
    # 81 frames -> 21 latent frames; 480/8/2 = 30, 832/8/2 = 52
    assert estimate_wan(shape, WanSpec(832, 480, 81, 1, 512, 16, "bf16", True)).tokens == 21 * 30 * 52 == 32760
    assert estimate_wan(shape, WanSpec(480, 832, 33, 2, 512, 16, "bf16", True)).tokens == 2 * 9 * 52 * 30
    assert estimate_wan(shape, WanSpec(832, 480, 1, 1, 512, 16, "bf16", False)).tokens == 30 * 52
    ti2v = load_wan_shape("Wan-AI/Wan2.2-TI2V-5B-Diffusers")  # 16x VAE: 1280x704 -> 80x44 latents -> 40x22
    assert (ti2v.vae_spatial, ti2v.vae_temporal) == (16, 4)
    assert estimate_wan(ti2v, WanSpec(1280, 704, 121, 1, 512, 16, "bf16", True)).tokens == 31 * 22 * 40


@pytest.mark.parametrize("hub_id, low, high", [
    (WAN21, 1.3e9, 1.5e9), ("Wan-AI/Wan2.1-T2V-14B-Diffusers", 13.5e9, 15e9),
    ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", 4.8e9, 5.2e9), ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", 13.5e9, 15e9)])
def test_preset_parameter_counts(hub_id, low, high):
    shape = load_wan_shape(hub_id)
    assert low < shape.n_params < high, shape.n_params


def test_wan21_13b_shape_and_lora_count():
    shape = load_wan_shape(WAN21)
    assert (shape.layers, shape.dim, shape.ffn, shape.heads) == (30, 1536, 8960, 12)
    est = estimate_wan(shape, WanSpec(832, 480, 81, 1, 512, 16, "bf16", True))
    # r x (in + out) for 8 attention linears of 1536 and the FFN pair, 30 blocks
    lora = 30 * 16 * (8 * 2 * 1536 + 2 * (1536 + 8960))
    assert est.by_name()["lora_params"] == 4 * lora and est.by_name()["adamw_states"] == 8 * lora


def test_local_directory_counts_the_real_transformer(tiny_wan):
    import torch
    from diffusers import WanTransformer3DModel

    shape = load_wan_shape(str(tiny_wan))
    assert (shape.layers, shape.heads, shape.head_dim, shape.vae_spatial, shape.vae_temporal) == (2, 2, 12, 8, 4)
    model = WanTransformer3DModel.from_pretrained(tiny_wan, subfolder="transformer", torch_dtype=torch.bfloat16)
    assert shape.n_params == sum(p.numel() for p in model.parameters())
    assert shape.fp32_params() == sum(p.numel() for p in model.parameters() if p.dtype == torch.float32)


def test_checkpointing_and_precision_order_the_estimates():
    shape = load_wan_shape(WAN21)
    full = estimate_wan(shape, WanSpec(832, 480, 81, 1, 512, 16, "bf16", False))
    ckpt = estimate_wan(shape, WanSpec(832, 480, 81, 1, 512, 16, "bf16", True))
    fp32 = estimate_wan(shape, WanSpec(832, 480, 81, 1, 512, 16, "fp32", True))
    assert ckpt.saved_bytes * 10 < full.saved_bytes
    assert ckpt.total_bytes < full.total_bytes < full.reserved_bytes
    assert fp32.total_bytes > ckpt.total_bytes
    assert "recompute" in ckpt.by_name() and "recompute" not in full.by_name()


def test_largest_frames_is_a_4k_plus_1_bucket_that_fits():
    shape = load_wan_shape(WAN21)
    usable = 22 * 2**30
    most = largest_frames(shape, WanSpec(832, 480, 1, 1, 512, 16, "bf16", True), usable)
    assert most is not None and (most - 1) % 4 == 0
    assert estimate_wan(shape, WanSpec(832, 480, most, 1, 512, 16, "bf16", True)).reserved_bytes <= usable
    assert estimate_wan(shape, WanSpec(832, 480, most + 4, 1, 512, 16, "bf16", True)).reserved_bytes > usable
    # weights alone are 2.6 GiB
    assert largest_frames(shape, WanSpec(832, 480, 1, 1, 512, 16, "bf16", True), 2**30) is None


@pytest.mark.parametrize("call, words", [
    (lambda s: estimate_wan(s, WanSpec(830, 480, 81, 1, 512, 16, "bf16", True)), "multiples of 16"),
    (lambda s: estimate_wan(s, WanSpec(832, 480, 80, 1, 512, 16, "bf16", True)), r"4k\+1"),
    (lambda s: estimate_wan(s, WanSpec(832, 480, 81, 1, 512, 16, "int8", True)), "precision"),
])
def test_bad_settings_are_user_errors(call, words):
    with pytest.raises(UserError, match=words):
        call(load_wan_shape(WAN21))


def test_unknown_model_and_incomplete_directory(tmp_path):
    with pytest.raises(UserError, match="Known presets: Wan-AI/Wan2.1-T2V-1.3B-Diffusers"):
        load_wan_shape("Wan-AI/Wan9-T2V-1B")
    with pytest.raises(UserError, match="no transformer/config.json"):
        load_wan_shape(str(tmp_path))
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"num_layers": 2}))
    with pytest.raises(UserError, match="attention_head_dim"):
        load_wan_shape(str(tmp_path))


def test_plan_cli_video_json_without_torch():
    code = ("import sys; from rocktune.cli import main; main(['plan', 'Wan-AI/Wan2.1-T2V-1.3B-Diffusers', '--task', "
            "'video-lora', '--resolution', '832x480', '--frames', '81', '--vram', '24GiB', '--json']); "
            "sys.stderr.write(str('torch' in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert res.returncode == 0 and res.stderr.strip().endswith("False"), res.stderr
    doc = json.loads(res.stdout)
    assert doc["tokens"] == 32760 and doc["settings"]["frames"] == 81
    assert doc["fits"] is False and doc["checkpointing_needed"] is True  # --checkpointing not given: it is off
    assert (doc["largest_frames"]["with_checkpointing"] - 1) % 4 == 0
    assert doc["largest_frames"]["with_checkpointing"] >= 81 > doc["largest_frames"]["without_checkpointing"]


def test_plan_cli_image_uses_one_frame(capsys):
    from rocktune.cli import main

    assert main(["plan", WAN21, "--task", "image-lora", "--resolution", "624x624", "--vram", "24GiB",
                 "--checkpointing", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["frames"] == 1 and doc["tokens"] == 39 * 39 and doc["fits"] is True
    assert "largest_frames" not in doc


FAST = [("tiny", 32, 32, 9, 1, 16, "fp32", False, 512), ("tiny", 48, 32, 1, 1, 4, "bf16", True, 512),
        ("small", 64, 48, 5, 2, 16, "bf16", False, 512), ("small", 128, 128, 17, 1, 4, "fp32", True, 64)]
SLOW = [p for p in pvw.GRID if p not in FAST]


@pytest.mark.parametrize("point", FAST, ids=lambda p: "-".join(map(str, p)))
def test_saved_activations_match_real_steps(point):
    row = pvw.run_point(*point)
    assert abs(row["saved_error"]) < 0.05, row
    assert row["state_exact"], row


@pytest.mark.slow
@pytest.mark.parametrize("point", SLOW, ids=lambda p: "-".join(map(str, p)))
def test_saved_activations_match_real_steps_full_grid(point):
    row = pvw.run_point(*point)
    assert abs(row["saved_error"]) < 0.05, row
    assert row["state_exact"], row
