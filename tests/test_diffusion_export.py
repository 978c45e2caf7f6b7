"""The Wan LoRA file (Wan's original names, for ComfyUI and diffusers), rendering with it, and `rocktune generate`."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from rocktune.tasks.wan.diffusion.comfy import (_IN_BLOCK, _OUTSIDE, check_targets, comfy_state_dict, original_name,
                                                 write_lora)
from rocktune.errors import UserError

BLOCKS = r"blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)|blocks\.\d+\.ffn\.net\.(0\.proj|2)"
WITH_OUTSIDE = rf"({BLOCKS}|proj_out|condition_embedder\.time_proj|condition_embedder\.text_embedder\.linear_1)"
PROMPT = "a red cube slides left"


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory) -> Path:
    from rocktune.tasks.wan.diffusion.tiny import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("wan") / "tiny")


@pytest.fixture(scope="session")
def base_transformer(tiny_wan):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(tiny_wan, subfolder="transformer").eval()


def trained(transformer, r: int, alpha: float, targets: str, std: float = 0.05):
    """A PEFT-wrapped copy whose lora_B is random: stands in for a trained adapter (fresh lora_B is zero)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(transformer), LoraConfig(r=r, lora_alpha=alpha, target_modules=targets))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    return model.eval()


def peft_state(model) -> dict:
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def forward(transformer) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 3, 4, 4, generator=gen)
    text = torch.randn(1, 7, 32, generator=gen)
    with torch.no_grad():
        return transformer(hidden_states=x, timestep=torch.tensor([600]), encoder_hidden_states=text).sample


def lora_modules(model) -> list[str]:
    from peft.tuners.lora import LoraLayer

    return [name.removeprefix("base_model.model.") for name, m in model.named_modules() if isinstance(m, LoraLayer)]


# --- names ---------------------------------------------------------------------------------------------------------


def test_original_names_follow_wan_checkpoints():
    assert original_name("blocks.7.attn1.to_out.0") == "blocks.7.self_attn.o"
    assert original_name("blocks.0.attn2.to_k") == "blocks.0.cross_attn.k"
    assert original_name("blocks.3.attn2.add_v_proj") == "blocks.3.cross_attn.v_img"
    assert original_name("blocks.12.ffn.net.0.proj") == "blocks.12.ffn.0"
    assert original_name("condition_embedder.time_proj") == "time_projection.1"
    assert original_name("proj_out") == "head.head"
    assert original_name("condition_embedder.time_embedder.linear_2") == "time_embedding.2"
    assert original_name("blocks.0.norm2") is None
    assert original_name("patch_embedding") is None


def test_diffusers_single_file_converter_maps_every_original_name_back(base_transformer):
    """Wan's checkpoint converter in diffusers turns each original name into the module it came from, and the
    module's weight has the shape the LoRA factors expect."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    weights = dict(base_transformer.named_parameters())
    names = [f"blocks.5.{k}" for k in _IN_BLOCK] + list(_OUTSIDE)
    assert len(names) == 20
    present = 0
    for module in names:
        converted = convert_wan_transformer_to_diffusers({f"{original_name(module)}.weight": torch.zeros(1)})
        assert list(converted) == [f"{module}.weight"], module
        local = module.replace("blocks.5.", "blocks.1.")
        if f"{local}.weight" in weights:
            present += 1
    assert present == 16  # all but the image cross-attention and image embedder, which the tiny T2V model lacks


def test_file_keys_are_original_names_with_shapes_of_the_model(base_transformer):
    model = trained(base_transformer, 4, 8.0, WITH_OUTSIDE)
    sd = comfy_state_dict(peft_state(model), r=4, alpha=8.0)
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    weights = dict(base_transformer.named_parameters())
    modules = lora_modules(model)
    assert len(modules) == 2 * 10 + 3
    for module in modules:
        name = f"diffusion_model.{original_name(module)}"
        down, up = sd[f"{name}.lora_A.weight"], sd[f"{name}.lora_B.weight"]
        (target,) = convert_wan_transformer_to_diffusers({f"{original_name(module)}.weight": torch.zeros(1)})
        out_features, in_features = weights[target].shape
        assert down.shape == (4, in_features) and up.shape == (out_features, 4), module
        assert down.dtype == up.dtype == torch.float32 and down.is_contiguous() and up.is_contiguous()
    assert len(sd) == 3 * 20 + 2 * 3  # A, B, alpha in the blocks; A, B outside


def test_alpha_in_blocks_folded_outside(base_transformer):
    model = trained(base_transformer, 4, 8.0, WITH_OUTSIDE)
    state = peft_state(model)
    sd = comfy_state_dict(state, r=4, alpha=8.0)
    alpha = sd["diffusion_model.blocks.0.self_attn.q.alpha"]
    assert alpha.dim() == 0 and alpha.item() == 8.0
    assert sum(k.endswith(".alpha") for k in sd) == 20
    assert "diffusion_model.head.head.alpha" not in sd
    torch.testing.assert_close(sd["diffusion_model.head.head.lora_B.weight"],
                               state["base_model.model.proj_out.lora_B.weight"] * 2.0)
    torch.testing.assert_close(sd["diffusion_model.blocks.1.ffn.2.lora_B.weight"],
                               state["base_model.model.blocks.1.ffn.net.2.lora_B.weight"])
    half = comfy_state_dict(state, r=4, alpha=8.0, dtype=torch.bfloat16)
    assert half["diffusion_model.blocks.0.cross_attn.o.lora_A.weight"].dtype == torch.bfloat16


# --- loading in diffusers and the ComfyUI rule -----------------------------------------------------------------------


@pytest.mark.parametrize(("r", "alpha", "targets"), [(4, 8.0, WITH_OUTSIDE), (4, 4.0, WITH_OUTSIDE),
                                                     (2, 16.0, f"({BLOCKS})")])
def test_diffusers_loads_the_file_like_the_peft_model(tiny_wan, base_transformer, tmp_path, r, alpha, targets):
    from diffusers import WanPipeline

    model = trained(base_transformer, r, alpha, targets)
    path = write_lora(tmp_path / "wan_lora.safetensors", peft_state(model), r, alpha, {"task": "video-lora"})
    pipe = WanPipeline.from_pretrained(tiny_wan)
    before = forward(pipe.transformer)
    pipe.load_lora_weights(str(path))
    after, expected = forward(pipe.transformer), forward(model)
    assert (after - before).abs().max().item() > 1e-2
    assert (after - expected).abs().max().item() < 1e-5


def test_comfyui_rule_merges_to_the_peft_model(base_transformer):
    """ComfyUI adds (alpha / rank, or 1 without .alpha) * lora_B @ lora_A to the named weight (comfy/lora.py)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    model = trained(base_transformer, 4, 8.0, WITH_OUTSIDE)
    merged = copy.deepcopy(base_transformer)
    weights = dict(merged.named_parameters())
    sd = comfy_state_dict(peft_state(model), r=4, alpha=8.0)
    names = {k.removeprefix("diffusion_model.").rsplit(".lora_A", 1)[0] for k in sd if ".lora_A." in k}
    with torch.no_grad():
        for name in names:
            down, up = sd[f"diffusion_model.{name}.lora_A.weight"], sd[f"diffusion_model.{name}.lora_B.weight"]
            alpha = sd.get(f"diffusion_model.{name}.alpha")
            scale = 1.0 if alpha is None else alpha.item() / down.shape[0]
            (target,) = convert_wan_transformer_to_diffusers({f"{name}.weight": torch.zeros(1)})
            weights[target] += scale * up @ down
    assert (forward(merged) - forward(model)).abs().max().item() < 1e-5


# --- the file on disk ------------------------------------------------------------------------------------------------


def test_write_has_metadata_and_round_trips(base_transformer, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from rocktune import __version__

    model = trained(base_transformer, 4, 8.0, f"({BLOCKS})")
    state = peft_state(model)
    path = write_lora(tmp_path / "wan_lora.safetensors", state, 4, 8.0, {"base_model": "tiny", "task": "video-lora"})
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["rocktune_version"] == __version__ and meta["base_model"] == "tiny" and meta["task"] == "video-lora"
    assert meta["lora_rank"] == "4" and float(meta["lora_alpha"]) == 8.0
    loaded = load_file(str(path))
    expected = comfy_state_dict(state, 4, 8.0)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert [p.name for p in tmp_path.iterdir()] == ["wan_lora.safetensors"]


def test_write_is_atomic(base_transformer, tmp_path, monkeypatch):
    import safetensors.torch

    def half_then_fail(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    state = peft_state(trained(base_transformer, 4, 8.0, f"({BLOCKS})"))
    target = tmp_path / "wan_lora.safetensors"
    target.write_bytes(b"previous")
    monkeypatch.setattr(safetensors.torch, "save_file", half_then_fail)
    with pytest.raises(OSError):
        write_lora(target, state, 4, 8.0, {})
    assert target.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["wan_lora.safetensors"]
    target.unlink()
    with pytest.raises(OSError):
        write_lora(target, state, 4, 8.0, {})
    assert list(tmp_path.iterdir()) == []


# --- refusals ----------------------------------------------------------------------------------------------------


def test_check_targets_refuses_what_the_file_cannot_name():
    check_targets(["blocks.0.attn1.to_q", "blocks.0.ffn.net.2", "proj_out"])
    with pytest.raises(UserError, match=r"blocks\.0\.norm2.*lora\.target_modules"):
        check_targets(["blocks.0.attn1.to_q", "blocks.0.norm2"])
    with pytest.raises(UserError, match="no module inside the transformer blocks"):
        check_targets(["proj_out", "condition_embedder.time_proj"])
    with pytest.raises(UserError, match="add_k_proj without its pair"):
        check_targets(["blocks.0.attn2.to_q", "blocks.0.attn2.add_k_proj"])


def test_state_with_dora_magnitudes_is_refused():
    state = {"base_model.model.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(2, 4),
             "base_model.model.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(4, 2),
             "base_model.model.blocks.0.attn1.to_q.lora_magnitude_vector": torch.zeros(4)}
    with pytest.raises(UserError, match="lora_magnitude_vector"):
        comfy_state_dict(state, 2, 2.0)


# --- rendering and media -------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def lora_file(tmp_path_factory, base_transformer) -> Path:
    model = trained(base_transformer, 4, 8.0, f"({BLOCKS})", std=0.5)  # strong enough to show in 2 steps
    out = tmp_path_factory.mktemp("lora") / "wan_lora.safetensors"
    return write_lora(out, peft_state(model), 4, 8.0, {"task": "video-lora"})


def test_render_with_and_without_lora(tiny_wan, lora_file):
    from rocktune.tasks.wan.diffusion.render import Shot, render

    shot = Shot(PROMPT, width=32, height=32, frames=9, steps=2, seed=3, guidance=1.0)
    base = render(str(tiny_wan), None, shot, "cpu")
    again = render(str(tiny_wan), None, shot, "cpu")
    tuned = render(str(tiny_wan), lora_file, shot, "cpu")
    assert base.shape == tuned.shape == (9, 32, 32, 3) and base.dtype == np.uint8
    assert np.array_equal(base, again)
    diff = np.abs(base.astype(int) - tuned)
    assert diff.max() >= 10 and diff.mean() > 0.3  # without the LoRA the two are identical (same seed, same noise)


def read_video(path: Path) -> list[np.ndarray]:
    av = pytest.importorskip("av")  # optional (absent on the GPU test machine)

    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def test_write_media_mp4_and_png(tmp_path):
    from PIL import Image

    from rocktune.tasks.wan.diffusion.render import write_media

    rng = np.random.default_rng(0)
    clip = np.repeat(np.linspace(0, 255, 9, dtype=np.uint8)[:, None, None, None], 3, axis=3)
    clip = np.broadcast_to(clip, (9, 32, 48, 3)).copy()
    frames = read_video(write_media(clip, tmp_path / "clip.mp4", fps=8))
    assert len(frames) == 9 and frames[0].shape == (32, 48, 3)
    assert abs(int(frames[8].mean()) - 255) < 8 and int(frames[0].mean()) < 8  # the fade survived encoding
    odd = read_video(write_media(clip[:, :31, :47], tmp_path / "odd.mp4"))
    assert len(odd) == 9 and odd[0].shape == (32, 48, 3)
    image = rng.integers(0, 255, (1, 24, 40, 3), dtype=np.uint8)
    png = write_media(image, tmp_path / "still.png")
    assert np.array_equal(np.asarray(Image.open(png)), image[0])
    with pytest.raises(UserError, match=r"9 frames make a video; name the output \.mp4"):
        write_media(clip, tmp_path / "clip.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4", "odd.mp4", "still.png"]


# --- rocktune generate -------------------------------------------------------------------------------------------


def fake_run(root: Path, tiny_wan: Path, lora_file: Path | None, task: str = "video-lora") -> Path:
    root.mkdir()
    config = {"task": task, "model": {"name_or_path": str(tiny_wan)}, "lora": {"r": 4, "alpha": 8.0},
              "diffusion": {"resolutions": [[48, 32]], "frames": [5]}}
    (root / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    if lora_file is not None:
        (root / "wan_lora.safetensors").write_bytes(lora_file.read_bytes())
    return root


def test_generate_renders_a_finished_run(tiny_wan, lora_file, tmp_path, capsys):
    from rocktune.cli import main

    run = fake_run(tmp_path / "run", tiny_wan, lora_file)
    rc = main(["generate", str(run), "--prompt", PROMPT, "--steps", "2", "--guidance", "1", "--device", "cpu",
               "--compare"])
    tuned = run / "samples" / "a-red-cube-slides-left-seed0.mp4"
    base = tuned.with_name("a-red-cube-slides-left-seed0-base.mp4")
    assert rc == 0 and capsys.readouterr().out.split() == [str(tuned), str(base)]
    tuned_frames, base_frames = read_video(tuned), read_video(base)
    assert len(tuned_frames) == len(base_frames) == 5 and tuned_frames[0].shape == (32, 48, 3)
    diff = np.abs(np.stack(tuned_frames).astype(int) - np.stack(base_frames))
    assert diff.max() >= 10 and diff.mean() > 0.3


def test_generate_image_run_writes_png(tiny_wan, lora_file, tmp_path, capsys):
    from rocktune.cli import main

    run = fake_run(tmp_path / "run", tiny_wan, lora_file, task="image-lora")
    out = tmp_path / "still.png"
    rc = main(["generate", str(run), "--prompt", PROMPT, "--steps", "1", "--guidance", "1", "--device", "cpu",
               "--size", "32x16", "--out", str(out)])
    assert rc == 0 and capsys.readouterr().out.strip() == str(out)
    from PIL import Image

    assert Image.open(out).size == (32, 16)


def test_generate_refuses_unfinished_run_and_bad_options(tiny_wan, lora_file, tmp_path, capsys):
    from rocktune.cli import main

    unfinished = fake_run(tmp_path / "unfinished", tiny_wan, None)
    assert main(["generate", str(unfinished), "--prompt", PROMPT]) == 2
    assert "the run has not finished" in capsys.readouterr().err
    run = fake_run(tmp_path / "run", tiny_wan, lora_file)
    assert main(["generate", str(run), "--prompt", PROMPT, "--frames", "8"]) == 2
    assert "4k+1" in capsys.readouterr().err
    assert main(["generate", str(run), "--prompt", PROMPT, "--size", "40x32"]) == 2
    assert "multiples of 16" in capsys.readouterr().err
    assert main(["generate", str(run), "--chat"]) == 2
    assert "give --prompt TEXT" in capsys.readouterr().err
    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "config.yaml").write_text(yaml.safe_dump({"task": "lm"}), encoding="utf-8")
    assert main(["generate", str(lm), "--prompt", "hi", "--steps", "4"]) == 2
    assert "--steps apply to video-lora/image-lora runs only" in capsys.readouterr().err
