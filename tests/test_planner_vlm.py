"""The vision-language planner (task=vlm): image tokens by the model's own processor, the frozen vision tower's
forward, the fit of data.max_pixels (plan and train --auto), and the plan against real steps of a tiny Qwen2.5-VL at
three image sizes: saved-for-backward bytes within 5% (the planner's CPU tolerance), the training state exact and the
step's CPU peak (the allocator's own events) within 10% (its tolerance for a measured peak).

The grid (16 points: two Qwen2.5-VL tower widths, checkpointing, bf16, Qwen3-VL, Qwen2-VL) is
``benchmarks/planner_validation_vlm.py``;
the default suite runs the three image sizes on the wide tower, whose forward sets the peak at the larger two, and
the tiny Gemma 3 and SmolVLM at three sizes each (their checkpointing points in ``long``), with their towers'
forward measured alone, and a tiny Qwen3.5 (its Gated DeltaNet language model) at the three sizes and checkpointing.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rocktune.cli import main

pytest.importorskip("PIL")

_spec = importlib.util.spec_from_file_location(
    "planner_validation_vlm", Path(__file__).parents[1] / "benchmarks" / "planner_validation_vlm.py")
pvv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pvv)

CHAT = Path(__file__).parents[1] / "examples" / "vision" / "chat.jsonl"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A folder where the benchmark's tiny models are built once, when first asked for."""
    return tmp_path_factory.mktemp("vlm-plan")


@pytest.fixture(scope="module")
def tiny(models) -> Path:
    return pvv.build_model_dir(models, "tiny")


def _plan(capsys, *args) -> dict:
    capsys.readouterr()
    assert main(["plan", *map(str, args), "--task", "vlm", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


DEFAULT = [("wide-vision", w, h, 2, "fp32", False) for w, h in pvv.SIZES]


@pytest.mark.parametrize("point", DEFAULT, ids=lambda p: f"{p[1]}x{p[2]}")
def test_the_plan_holds_against_a_real_step_at_three_image_sizes(models, point):
    row = pvv.run_point(models, *point)
    assert abs(row["saved_error"]) < 0.05, row
    assert row["state_exact"], row
    assert abs(row["peak_error"]) < 0.10, row


@pytest.mark.long
@pytest.mark.parametrize("point", [p for p in pvv.GRID if p not in DEFAULT], ids=lambda p: "-".join(map(str, p)))
def test_the_plan_holds_on_the_rest_of_the_grid(models, point):
    """The narrow tower (the language model's backward sets the peak), checkpointing, bf16, Qwen3-VL and Qwen2-VL."""
    row = pvv.run_point(models, *point)
    assert abs(row["saved_error"]) < 0.05, row
    assert row["state_exact"], row
    assert abs(row["peak_error"]) < 0.10, row


# Qwen3.5 (not in the benchmark's grid): Qwen3-VL's tower 256 wide, 2 blocks, before a Gated DeltaNet layer and a
# full-attention one (the text planner's planner/recurrent.py); measured: saved within 1.8%, peak within 3.0%
QWEN35 = {"family": "qwen3_5", "vision_hidden": 256, "vision_depth": 2}
QWEN35_POINTS = [(w, h, False) for w, h in pvv.SIZES] + [(448, 336, True)]


@pytest.mark.parametrize("point", QWEN35_POINTS, ids=lambda p: f"{p[0]}x{p[1]}{'-ckpt' if p[2] else ''}")
def test_the_plan_holds_for_qwen3_5(models, monkeypatch, point):
    monkeypatch.setitem(pvv.MODELS, "qwen3-5-wide", QWEN35)
    width, height, ckpt = point
    row = pvv.run_point(models, "qwen3-5-wide", width, height, 2, "fp32", ckpt)
    assert abs(row["saved_error"]) < 0.05, row
    assert row["state_exact"], row
    assert abs(row["peak_error"]) < 0.10, row


def test_image_tokens_come_from_the_processors_own_resize(tiny, capsys):
    """448x336 under max_pixels 448x448 keeps its size: 24 x 32 patches of 14 pixels, merged 2 x 2 into 192 tokens;
    under 200,704 pixels (256 tokens) the processor's smart resize gives 16 x 12 = 192 too, and under 100,352 pixels
    it resizes to 252x364 (18 x 26 patches, 117 tokens)."""
    full = _plan(capsys, tiny, "--image-size", "448x336", "--max-pixels", 448 * 448, "--text-tokens", 40,
                 "--batch", 2, "--vram", "4GiB")
    assert full["images"]["tokens_per_image"] == {"min": 192, "max": 192}
    assert full["settings"]["seq_len"] == 40 + 192 and full["settings"]["patches"] == [768, 768]
    assert full["terms"]["pixel_values"] == 2 * 768 * 3 * 2 * 14 * 14 * 4
    assert full["terms"]["vision_forward"] > 0 and full["fits"]
    small = _plan(capsys, tiny, "--image-size", "448x336", "--max-pixels", 100352, "--vram", "4GiB")
    assert small["images"]["tokens_per_image"]["max"] == 117 and small["settings"]["patches"] == [468]
    assert small["images"]["pixels_per_token"] == 784


def test_the_data_file_is_read_as_training_reads_it(tiny, capsys):
    """examples/vision/chat.jsonl: four 56x56 images of 4 tokens; the longest conversation as data preview counts
    it."""
    doc = _plan(capsys, tiny, "--data", CHAT, "--vram", "4GiB")
    capsys.readouterr()
    assert main(["data", "preview", "--data", str(CHAT), "--model", str(tiny), "task=vlm", "--json"]) == 0
    preview = json.loads(capsys.readouterr().out)
    assert doc["images"]["conversations"] == doc["images"]["images"] == 4
    assert doc["images"]["tokens_per_image"] == {"min": 4, "max": 4}
    assert doc["images"]["longest_conversation"]["tokens"] == preview["tokens_per_example"]["max"]


def test_the_fit_picks_the_largest_max_pixels_that_fits(tiny, capsys):
    """A budget between two resolutions: the fit lowers max_pixels to a whole number of tokens' pixels (28 x 28)
    whose smallest setting fits, and one token more does not; a roomy budget keeps the asked resolution."""
    from rocktune.planner.fit import MARGIN

    args = (tiny, "--image-size", "1024x768", "--max-pixels", 1003520, "--text-tokens", 64, "--max-length", 4096,
            "--global-batch", 4, "--device", "gpu")
    tight = _plan(capsys, *args, "--vram", "620MiB")["fit"]
    assert tight["max_pixels"] % 784 == 0 and tight["max_pixels"] < 1003520
    assert tight["total_bytes"] <= 620 * 2**20 * (1 - MARGIN)
    assert "one token more per image) does not fit" in tight["reasons"][1]
    over = _plan(capsys, *args[:4], tight["max_pixels"] + 784, *args[5:], "--vram", "620MiB", "--batch", 1,
                 "--checkpointing")
    assert over["total_bytes"] > 620 * 2**20 * (1 - MARGIN)
    roomy = _plan(capsys, *args, "--vram", "8GiB")["fit"]
    assert roomy["max_pixels"] == 1003520 and roomy["micro_batch_size"] == 4
    assert roomy["reasons"][1] == "the asked max_pixels=1003520 fits: the resolution is kept"


def test_nothing_fits_says_what_would(tiny, capsys):
    doc = _plan(capsys, tiny, "--image-size", "448x336", "--vram", "200MiB", "--device", "gpu")
    assert "does not fit in 0.20 GiB (given) even at max_pixels=3136" in doc["fit"]["error"]
    assert "a budget of at least" in doc["fit"]["error"]


def test_pixel_options_belong_to_vlm(capsys):
    assert main(["plan", "Qwen2.5-0.5B", "--max-pixels", "50176"]) == 2
    assert "--max-pixels: only for --task vlm" in capsys.readouterr().err


def test_train_auto_lowers_max_pixels_to_the_budget(tiny, tmp_path):
    """train --auto with task=vlm: eight 448x336 images asked at full size on a budget that holds less; the run
    trains at the planner's max_pixels, micro-batch and checkpointing, and says so."""
    from PIL import Image

    from rocktune.config import config_from_dict
    from rocktune.tasks.vlm.demo.vision_task import row
    from rocktune.tasks import train
    from rocktune.train.request import RunOptions

    lines = []
    for i in range(8):
        Image.new("RGB", (448, 336), (30 * i, 60, 90)).save(tmp_path / f"{i}.png")
        lines.append(json.dumps(row(f"{i}.png", "red")))
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    cfg = {"task": "vlm", "model": {"name_or_path": str(tiny)}, "lora": {"r": 8, "alpha": 16},
           "data": {"train_file": str(tmp_path / "t.jsonl"), "max_length": 1024, "max_pixels": 448 * 448,
                    "eval_fraction": 0},
           "training": {"max_steps": 1, "micro_batch_size": 4, "grad_accum": 2, "precision": "fp32", "device": "cpu",
                        "eval_every": 0},
           "reliability": {"save_every": 0, "min_free_disk_mb": 0}, "output": {"dir": str(tmp_path / "run")}}
    train(config_from_dict(cfg), RunOptions(auto_fit=True, vram_bytes=1150 * 2**20), quiet=True)
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    chosen = next(n for n in info["notes"] if n.startswith("--auto: data.max_pixels="))
    picked = int(chosen.split("=")[1].split()[0])
    assert picked < 448 * 448 and picked % 784 == 0
    assert f"max_pixels: {picked}" in (tmp_path / "run" / "config.yaml").read_text()
    assert info["predicted_peak_bytes"] > 0


def test_checkpointing_leaves_the_frozen_tower_out_of_backward(tiny):
    """transformers hooks every input embedding to require a gradient under checkpointing; the vision tower's hook is
    removed (its backward would serve nothing), the language model's stays."""
    import torch

    from rocktune.config import LoraConfig, ModelConfig
    from rocktune.tasks.vlm.build import model_with_adapter

    model, _ = model_with_adapter(ModelConfig(name_or_path=str(tiny), gradient_checkpointing=True),
                                  LoraConfig(r=8, alpha=16), "fp32", "sdpa", "cpu")
    inner = model.get_base_model().model
    assert not inner.visual.patch_embed._forward_hooks
    assert inner.language_model.embed_tokens._forward_hooks
    pixels = torch.randn(16, 3 * 2 * 14 * 14)
    out = inner.visual(pixels, grid_thw=torch.tensor([[1, 4, 4]])).pooler_output
    assert not out.requires_grad


def test_a_vision_language_model_is_planned_as_one(tiny, capsys):
    assert main(["plan", str(tiny), "--vram", "4GiB"]) == 2
    assert "is a vision-language model (qwen2_5_vl_text); plan it with --task vlm" in capsys.readouterr().err


def test_images_longer_than_max_length_are_refused_as_training_refuses_them(tiny, capsys):
    assert main(["plan", str(tiny), "--task", "vlm", "--image-size", "1024x768", "--max-pixels", "1003520",
                 "--max-length", "512"]) == 2
    assert "make 999 tokens at max_pixels=1003520, not fewer than --max-length=512" in capsys.readouterr().err


# --- Gemma 3 and SmolVLM: a SigLIP tower at the processor's own resolution -----------------------------------------

FAMILY_DEFAULT = [(m, w, h, 2, "fp32", False) for m in pvv.FAMILY_MODELS for w, h in pvv.FAMILY_SIZES]


@pytest.mark.parametrize("point", FAMILY_DEFAULT, ids=lambda p: f"{p[0]}-{p[1]}x{p[2]}")
def test_gemma3_and_smolvlm_plans_hold_against_a_real_step_at_three_image_sizes(models, point):
    """SmolVLM's processor rescales every image to its longest_edge (128 here) and tiles it in 32 pixels: 64x64 makes
    4 x 4 tiles and the global view, 128x64 4 x 2, 128x32 4 x 1; Gemma 3 resizes every image to its one size."""
    row = pvv.run_point(models, *point)
    assert abs(row["saved_error"]) < 0.05, row
    assert row["state_exact"], row
    assert abs(row["peak_error"]) < 0.10, row
    views = {(64, 64): 17, (128, 64): 9, (128, 32): 5}[point[1:3]] if point[0].startswith("smolvlm") else 1
    assert row["patches"] == 2 * views * 16


@pytest.mark.parametrize("tower", pvv.TOWERS, ids=lambda t: f"{t[0]}-{t[1]}")
def test_the_siglip_towers_forward_is_planned(models, tower):
    """The tiny step grid's towers see too few patches to set a step's peak: the frozen tower's forward alone (34
    views), its CPU peak against the plan's vision_forward, at two widths."""
    row = pvv.tower_point(models, *tower)
    assert abs(row["error"]) < 0.05, row


@pytest.mark.long
@pytest.mark.parametrize("point", [p for p in pvv.GRID if p[0] in pvv.FAMILY_MODELS and p not in FAMILY_DEFAULT],
                         ids=lambda p: "-".join(map(str, p)))
def test_gemma3_and_smolvlm_plans_hold_with_checkpointing(models, point):
    row = pvv.run_point(models, *point)
    assert abs(row["saved_error"]) < 0.05, row
    assert row["state_exact"], row
    assert abs(row["peak_error"]) < 0.10, row


@pytest.fixture(scope="module")
def smolvlm(models) -> Path:
    """The demo's tiny SmolVLM as built (its processor: longest_edge 64, tiles of 32)."""
    from rocktune.tasks.vlm.demo.tiny_vlm_families import build_family_vlm

    return build_family_vlm(models / "smolvlm-demo", 0, "smolvlm")


@pytest.fixture(scope="module")
def gemma3(models) -> Path:
    from rocktune.tasks.vlm.demo.tiny_vlm_families import build_family_vlm

    return build_family_vlm(models / "gemma3-demo", 0, "gemma3")


def _image_rows(folder: Path, sizes) -> Path:
    from PIL import Image

    from rocktune.tasks.vlm.demo.vision_task import row

    folder.mkdir(exist_ok=True)
    lines = []
    for i, (w, h) in enumerate(sizes):
        Image.new("RGB", (w, h), (40 * i, 90, 160)).save(folder / f"{i}.png")
        lines.append(json.dumps(row(f"{i}.png", "blue")))
    (folder / "t.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "t.jsonl"


def test_tiles_are_counted_by_the_processors_own_split(smolvlm, tmp_path, capsys):
    """Longest edge 64 in tiles of 32: 64x64 is 2 x 2 tiles and the global view (5 x 4 tokens), 128x64 is rescaled
    to 64x32 (1 x 2 tiles, 12 tokens), 20x20 is rescaled up to 64x64 (20); the tokens and the longest conversation
    (tags included) as data preview counts them."""
    data = _image_rows(tmp_path, [(64, 64), (128, 64), (20, 20)])
    doc = _plan(capsys, smolvlm, "--data", data, "--vram", "4GiB")
    assert main(["data", "preview", "--data", str(data), "--model", str(smolvlm), "task=vlm", "--json"]) == 0
    preview = json.loads(capsys.readouterr().out)
    assert doc["images"]["tokens_per_image"] == {"min": 12, "max": 20}
    assert doc["images"]["max_pixels"] is None
    assert doc["images"]["longest_conversation"]["tokens"] == preview["tokens_per_example"]["max"]
    assert doc["fit"]["max_pixels"] is None
    assert "the resolution is smolvlm's processor's" in doc["fit"]["reasons"][1]
    assumed = _plan(capsys, smolvlm, "--image-size", "64x64", "--text-tokens", 30, "--vram", "4GiB")
    assert assumed["settings"]["patches"] == [5 * 16]  # 5 views of 4 x 4 patches
    # 20 image tokens and the tags: each of the 4 tiles' <fake_token_around_image><row_r_col_c>, a newline after each
    # of the 2 rows and one before the global view, <fake_token_around_image><global-img> ... <fake_token_around_image>
    assert assumed["settings"]["seq_len"] == 30 + 20 + 4 * 2 + 2 + 1 + 3


def test_gemma3_makes_its_fixed_tokens_at_any_size(gemma3, tmp_path, capsys):
    data = _image_rows(tmp_path, [(32, 32), (300, 40), (7, 9)])
    doc = _plan(capsys, gemma3, "--data", data, "--vram", "4GiB")
    assert doc["images"]["tokens_per_image"] == {"min": 4, "max": 4}
    assert doc["settings"]["patches"] == [16]
    assert doc["terms"]["local_rope"] > 0 and doc["terms"]["vision_forward"] > 0
    assert main(["plan", str(gemma3), "--task", "vlm", "--max-pixels", "50176"]) == 2
    assert "Gemma 3's sets it in the model's preprocessor_config.json" in capsys.readouterr().err
    assert main(["plan", str(gemma3), "--vram", "4GiB"]) == 2
    assert "is a vision-language model (gemma3_text); plan it with --task vlm" in capsys.readouterr().err


def test_train_auto_on_smolvlm_chooses_the_micro_batch_only(smolvlm, tmp_path):
    """A budget that holds a smaller micro-batch but not 8 (the plan: 1,100 MiB at 8, above 1,150 MiB less the margin):
    --auto lowers the micro-batch (the global batch kept) and leaves the resolution to the processor; the run
    trains."""
    from rocktune.config import config_from_dict
    from rocktune.tasks import train
    from rocktune.train.request import RunOptions

    data = _image_rows(tmp_path, [(64, 64)] * 8)
    cfg = {"task": "vlm", "model": {"name_or_path": str(smolvlm)}, "lora": {"r": 8, "alpha": 16},
           "data": {"train_file": str(data), "max_length": 512, "eval_fraction": 0},
           "training": {"max_steps": 1, "micro_batch_size": 8, "grad_accum": 1, "precision": "fp32", "device": "cpu",
                        "eval_every": 0},
           "reliability": {"save_every": 0, "min_free_disk_mb": 0}, "output": {"dir": str(tmp_path / "run")}}
    train(config_from_dict(cfg), RunOptions(auto_fit=True, vram_bytes=1150 * 2**20), quiet=True)
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    chosen = next(n for n in info["notes"] if n.startswith("--auto: "))
    assert chosen.startswith("--auto: micro_batch_size=") and "max_pixels" not in chosen
    micro, accum = (int(chosen.split(k + "=")[1].split()[0]) for k in ("micro_batch_size", "grad_accum"))
    assert micro < 8 and micro * accum == 8
    assert "max_pixels: null" in (tmp_path / "run" / "config.yaml").read_text()
    assert info["predicted_peak_bytes"] > 0
