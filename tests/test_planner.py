"""Planner: shapes from config.json, the estimate's terms, the fit, and the `rocktune plan` CLI (no torch needed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rocktune.cli import main
from rocktune.errors import UserError
from rocktune.planner import RunSpec, estimate, load_shape, suggest_settings
from rocktune.planner.budget import parse_budget
from rocktune.planner.shapes import presets

SEED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("name", list(presets()))
def test_preset_param_count_matches_meta_model(name):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in presets()[name].items() if k != "source"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert load_shape(name).n_params == sum(p.numel() for p in model.parameters())


def test_published_parameter_counts():
    assert load_shape("Qwen2.5-3B").n_params == 3_085_938_688
    assert load_shape("meta-llama/Llama-3.1-8B-Instruct").n_params == 8_030_261_248
    assert load_shape("Phi-3-mini").n_params == 3_821_079_552


def test_config_file_and_directory(tmp_path):
    cfg = {k: v for k, v in presets()["Qwen2.5-0.5B"].items() if k != "source"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_shape(str(tmp_path)).n_params == load_shape(str(tmp_path / "config.json")).n_params == 494_032_768


@pytest.mark.parametrize("content, message", [
    ("{not json", "not a readable JSON"),
    ('{"model_type": "qwen2", "hidden_size": 64}', "incomplete"),
    ('{"model_type": "mamba", "hidden_size": 64}', "not supported"),
    ("[1, 2]", "JSON object"),
])
def test_bad_config_json(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(UserError, match=message):
        load_shape(str(path))


def test_unknown_preset_lists_known():
    with pytest.raises(UserError, match="Known presets: .*Qwen2.5-3B"):
        load_shape("Qwen9-1T")


@pytest.mark.parametrize("text, expected", [("32GiB", 32 * 2**30), ("24GB", 24 * 10**9), ("16G", 16 * 2**30),
                                            ("12000MiB", 12000 * 2**20), ("32", 32 * 2**30)])
def test_parse_budget(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text", ["lots", "-3GiB", "32 parsecs", ""])
def test_parse_budget_rejects(text):
    with pytest.raises(UserError, match="cannot read the memory budget"):
        parse_budget(text)


def seed_spec(**kw) -> RunSpec:
    base = dict(micro_batch=1, seq_len=1024, lora_r=8, targets=SEED_TARGETS, precision="fp32")
    return RunSpec(**{**base, **kw})


def test_seed_case_static_terms_are_lora_only():
    terms = estimate(load_shape("Qwen2.5-3B"), seed_spec()).by_name()
    n_lora = 36 * 8 * ((2048 + 2048) + 2 * (2048 + 256) + (2048 + 2048) + 3 * (2048 + 11008))  # q, k+v, o, mlp
    assert n_lora == 14_966_784
    assert terms["lora_params"] == terms["lora_grads"] == 4 * n_lora
    assert terms["adamw_states"] == 8 * n_lora  # not 2 x 3B params as seed 001 counted
    assert terms["base_weights"] == 4 * 3_085_938_688


def test_seed_case_fits_32gb_with_and_without_checkpointing():
    shape = load_shape("Qwen2.5-3B")
    off, on = estimate(shape, seed_spec()), estimate(shape, seed_spec(checkpointing=True))
    # the figures docs/planner.md documents (21.21 / 13.01 GiB): a change to a term shows here and there
    assert off.total_bytes / 2**30 == pytest.approx(21.21, abs=0.005)
    assert on.total_bytes / 2**30 == pytest.approx(13.01, abs=0.005)
    assert on.by_name()["activations"] == 36 * 1024 * 2048 * 4  # one fp32 layer input per layer


def test_activation_terms_scale_and_respond_to_settings():
    shape = load_shape("Qwen2.5-0.5B")
    one = estimate(shape, RunSpec(micro_batch=1, seq_len=512, precision="bf16")).by_name()["activations"]
    two = estimate(shape, RunSpec(micro_batch=2, seq_len=512, precision="bf16", padded=False)).by_name()["activations"]
    assert two == pytest.approx(2 * one, rel=1e-2)  # all but the autocast copies of the adapters
    eager = estimate(shape, RunSpec(micro_batch=1, seq_len=512, precision="bf16", attn="eager")).by_name()
    assert eager["attention_scores"] == 24 * 14 * 512 * 512 * (4 + 2)  # fp32 softmax + its bf16 copy, per layer
    drop = estimate(shape, RunSpec(seq_len=512, precision="bf16", lora_dropout=0.1)).by_name()
    assert drop["lora_dropout"] > 0
    full = estimate(shape, RunSpec(seq_len=512, loss_mode="full")).by_name()
    assert full["loss_saved"] > 511 * 151936 * 4


def test_quantised_weights_are_smaller():
    shape = load_shape("Qwen2.5-7B")
    sizes = [estimate(shape, RunSpec(precision="bf16", quant=q)).by_name()["base_weights"] for q in
             ("none", "int8", "nf4")]
    assert sizes[0] > sizes[1] > sizes[2] > shape.n_params * 0.5 * 0.5


def test_unknown_target_module():
    with pytest.raises(UserError, match="qkv_proj"):
        estimate(load_shape("Llama-3.2-1B"), RunSpec(targets=("qkv_proj",)))


def test_suggest_settings_fits_and_explains():
    sug = suggest_settings("Qwen2.5-3B", 32 * 2**30, RunSpec(seq_len=1024, lora_r=8,
                           targets=list(SEED_TARGETS), precision="fp32", attn="sdpa"), 8)
    assert sug.micro_batch_size * sug.grad_accum == 8
    assert sug.total_bytes <= 0.95 * 32 * 2**30 and sug.predicted_peak_bytes < sug.total_bytes
    assert sug.max_length == 1024 and sug.precision == "fp32"
    assert sug.reasons[0].startswith("chosen") and len(sug.reasons) >= 2


def test_small_budget_shortens_then_fails_with_smallest_budget():
    sug = suggest_settings("Qwen2.5-0.5B", 3 * 2**30, RunSpec(seq_len=8192, lora_r=8,
                           targets="all-linear", precision="bf16", attn="eager"), 4)
    assert sug.max_length < 8192 and any("shortened" in r for r in sug.reasons)
    with pytest.raises(UserError, match=r"budget of at least \d+\.\d+ GiB"):
        suggest_settings("Qwen2.5-7B", 4 * 2**30, RunSpec(seq_len=1024, lora_r=8,
                         targets="all-linear", precision="bf16", attn="sdpa"), 8)


def test_cli_json(capsys):
    assert main(["plan", "Qwen2.5-3B", "--vram", "32GiB", "--precision", "fp32", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"total_bytes", "fits", "terms", "settings", "fit"} <= set(doc)
    assert doc["fits"] is True and doc["terms"]["base_weights"] == 4 * 3_085_938_688
    t = doc["terms"]
    assert doc["total_bytes"] == doc["peak_allocated_bytes"] + t["allocator_overhead"] + t["device_context"]
    assert doc["other_checkpointing"]["total_bytes"] < doc["total_bytes"]


def test_cli_plans_rocktunes_gpu_path(capsys):
    """--attn varlen (no mask, the lean LoRA forward) and --compiled (no fp32 norm copies, no kept activation)."""
    argv = ["plan", "Qwen2.5-0.5B", "--vram", "80GiB", "--batch", "8", "--max-length", "2048", "--lora-r", "16",
            "--json"]
    sizes = {}
    for name, extra in (("sdpa", []), ("varlen", ["--attn", "varlen"]), ("compiled", ["--attn", "varlen",
                                                                                     "--compiled"])):
        assert main(argv + extra) == 0
        doc = json.loads(capsys.readouterr().out)
        sizes[name] = doc["terms"]["activations"]
        assert doc["settings"]["compiled"] == (name == "compiled")
    assert sizes["sdpa"] > sizes["varlen"] > sizes["compiled"]
    assert "attention_scores" not in doc["terms"]  # no mask is built for varlen


def test_a_grpo_plan_suggests_the_two_length_keys_apart(capsys):
    """The update's row is prompt + completion; the suggestion names each key, never their sum as max_length."""
    assert main(["plan", "Qwen2.5-0.5B", "--task", "grpo", "--vram", "24GiB", "--max-length", "256",
                 "--completion-length", "512"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "max_length=256 grpo.max_completion_length=512" in out and "max_length=768" not in out
    assert main(["plan", "Qwen2.5-0.5B", "--vram", "24GiB", "--max-length", "256"]) == 0
    assert "max_length=256" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("argv, message", [
    (["plan", "NoSuchModel"], "Known presets"),
    (["plan", "Qwen2.5-3B", "--vram", "lots"], "memory budget"),
    (["plan", "Qwen2.5-3B", "--precision", "fp8"], "precision must be"),
])
def test_cli_bad_input_exits_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_plan_does_not_import_torch():
    code = ("import sys, io, contextlib; from rocktune.cli import main; buf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf): rc = main(['plan', 'Qwen2.5-3B', '--vram', '32GiB'])\n"
            "assert rc == 0 and 'suggested' in buf.getvalue(), buf.getvalue()\n"
            "assert 'torch' not in sys.modules, 'plan imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
