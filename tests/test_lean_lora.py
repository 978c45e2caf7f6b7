"""The lean LoRA side path (rocktune.lora.lean): PEFT's parameters and files, the same values, fewer ops per adapted
linear (no fp32 round trip of the input under autocast)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from rocktune.lora.lean import lean_lora
from rocktune.models.load import apply_lora, load_model


# every torch users run (make test-torches): the side paths are where a torch release can make training silently wrong
pytestmark = pytest.mark.torches


def _model(model_dir, precision="fp32", dora=False):
    torch.manual_seed(0)
    model = apply_lora(load_model(str(model_dir), precision, "sdpa", False, "cpu"), 8, 16, 0.0, "all-linear", False)
    for n, p in model.named_parameters():  # LoRA B starts at zero: give it values so the side path matters
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    return model


def _forward_backward(model, autocast: bool):
    ids = torch.arange(5, 69).view(2, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
    loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return logits.detach().float(), grads


@pytest.mark.parametrize("precision,autocast,tol", [("fp32", False, 0.0), ("bf16", True, 2e-2)])
def test_the_lean_path_computes_what_peft_computes(tiny_model_dir, precision, autocast, tol):
    peft_model = _model(tiny_model_dir, precision)
    want_out, want = _forward_backward(peft_model, autocast)
    note = lean_lora(peft_model, fused=False)
    assert note == "LoRA side path: lean forward on 14 adapted linear layers (no fp32 round trip of the input)"
    got_out, got = _forward_backward(peft_model, autocast)
    assert (got_out - want_out).abs().max() <= tol * want_out.abs().max()
    assert want.keys() == got.keys() and len(got) == 28
    assert max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want) <= max(tol, 0.0) + 1e-6


def _op_calls(model) -> int:
    _forward_backward(model, True)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _forward_backward(model, True)
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def test_fewer_ops_per_adapted_linear_under_autocast(tiny_model_dir):
    """bf16 base under bf16 autocast, as on a GPU: PEFT casts each adapted linear's input to fp32 and autocast casts
    it back; the lean path does neither (13 fewer aten calls per adapted linear, forward and backward, here)."""
    model = _model(tiny_model_dir, "bf16")
    before = _op_calls(model)
    lean_lora(model, fused=False)
    after = _op_calls(model)
    assert before - after >= 10 * 14, (before, after)


def test_disabled_merged_and_variant_adapters_keep_peft_s_forward(tiny_model_dir):
    model = _model(tiny_model_dir)
    lean_lora(model)
    ids = torch.arange(5, 37).view(1, 32)
    with torch.no_grad():
        with model.disable_adapter():
            off = model(input_ids=ids).logits
        base = load_model(str(tiny_model_dir), "fp32", "sdpa", False, "cpu")(input_ids=ids).logits
        on = model(input_ids=ids).logits
    assert torch.allclose(off, base, atol=1e-6) and not torch.allclose(on, base, atol=1e-3)
    from peft import LoraConfig, get_peft_model

    dora = get_peft_model(load_model(str(tiny_model_dir), "fp32", "sdpa", False, "cpu"),
                          LoraConfig(r=4, target_modules="all-linear", use_dora=True))
    assert lean_lora(dora) is None  # DoRA is a variant: PEFT's forward stays


def test_an_adapter_trained_on_the_lean_path_loads_in_peft_unchanged(tiny_model_dir, tmp_path):
    from peft import PeftModel

    model = _model(tiny_model_dir)
    lean_lora(model, fused=False)  # the fused path: tests/test_lora_fused.py
    model.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(load_model(str(tiny_model_dir), "fp32", "sdpa", False, "cpu"),
                                       tmp_path / "adapter")
    mine = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    theirs = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids = torch.arange(5, 37).view(1, 32)
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, loaded(input_ids=ids).logits, atol=1e-6)


def _train_losses(tiny_model_dir, train_file, out, monkeypatch, steps: int, modes=("peft", "lean", "fused")) -> dict:
    import functools

    from rocktune.config import config_from_dict
    from rocktune.tasks import train
    from rocktune.tasks.causal import build
    from tests.conftest import tiny_run_config

    losses = {}
    for mode in modes:
        patch = (lambda model: None) if mode == "peft" else functools.partial(lean_lora, fused=mode == "fused")
        monkeypatch.setattr(build, "lean_lora", patch)
        raw = tiny_run_config(tiny_model_dir, train_file, None, out / mode, max_steps=steps)
        raw["data"]["eval_fraction"] = 0.0
        losses[mode] = train(config_from_dict(raw), quiet=True).losses
    return losses


def test_training_runs_the_lean_and_fused_paths_with_peft_s_losses(tiny_model_dir, task_files, tmp_path,
                                                                   monkeypatch):
    """rocktune train with each side path: the same losses (fp32 on a CPU; 50 steps in the slow test below and
    docs/speed.md, 8 here), and the note says which ran."""
    import json

    losses = _train_losses(tiny_model_dir, task_files[0], tmp_path, monkeypatch, 8)
    assert losses["lean"] == pytest.approx(losses["peft"], rel=1e-6) and len(losses["lean"]) == 8
    assert losses["fused"] == pytest.approx(losses["lean"], rel=1e-5)
    notes = json.loads((tmp_path / "fused" / "run_info.json").read_text())["notes"]
    assert any(n.startswith("LoRA side path: fused on 14 of 14 adapted linear layers") for n in notes)


@pytest.mark.slow  # two 50-step runs
def test_fifty_steps_of_the_fused_path_keep_the_lean_path_s_losses(tiny_model_dir, task_files, tmp_path,
                                                                   monkeypatch):
    losses = _train_losses(tiny_model_dir, task_files[0], tmp_path, monkeypatch, 50, ("lean", "fused"))
    assert len(losses["fused"]) == 50
    worst = max(abs(f - le) / abs(le) for f, le in zip(losses["fused"], losses["lean"]))
    assert worst <= 1e-3, worst
