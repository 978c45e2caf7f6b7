"""Integration: real training of a tiny model on CPU, through the same code path as `rocktune train`."""

import json

import pytest
import torch
from safetensors.torch import load_file

from rocktune.cli import main
from rocktune.config import config_from_dict
from rocktune.errors import UserError
from rocktune.tasks import train
from rocktune.train.request import RunOptions
from tests.conftest import tiny_run_config

# Recorded on CPU (torch 2.13, fp32, seed 0; the same with ATen's default and AVX2 kernels), in data.batch_order's
# default order (mixed, since 2026-11-28). Tolerance covers BLAS differences between machines, not drift:
# a change to masking, normalisation, the schedule or the batch order moves these by far more than 2e-3.
EXPECTED_LOSSES = [5.771548, 5.692133, 5.67455, 5.568407, 5.240755, 5.196017]


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    from rocktune.demo.task import make_task
    from tests.conftest import write_jsonl

    tmp = tmp_path_factory.mktemp("run")
    tr, ev = make_task(n_train=256, n_eval=32, seed=1)
    cfg = tiny_run_config(tiny_model_dir, write_jsonl(tmp / "train.jsonl", tr), write_jsonl(tmp / "eval.jsonl", ev),
                          tmp / "out")
    return train(config_from_dict(cfg), quiet=True)


@pytest.mark.torches
def test_losses_match_recorded_values(trained):
    assert len(trained.losses) == 6
    if EXPECTED_LOSSES is None:
        pytest.fail(f"record these: {trained.losses}")
    assert trained.losses == pytest.approx(EXPECTED_LOSSES, abs=2e-3)
    assert trained.eval_loss_after < trained.eval_loss_before


@pytest.mark.torches
def test_only_lora_weights_change(trained, tiny_model_dir):
    base = load_file(tiny_model_dir / "model.safetensors")
    state = trained.model.get_base_model().state_dict()

    def wrapped(key):  # PEFT moves an adapted Linear's weight to <module>.base_layer.weight
        module, leaf = key.rsplit(".", 1)
        return f"{module}.base_layer.{leaf}" if f"{module}.base_layer.{leaf}" in state else key

    assert all(torch.equal(state[wrapped(k)], v) for k, v in base.items())
    lora_b = [v for k, v in state.items() if "lora_B" in k]
    assert len(lora_b) == 2 * 7 and all(float(v.abs().sum()) > 0 for v in lora_b)  # zero-initialised, now trained
    trainable = {n for n, p in trained.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.torches
def test_adapter_loads_in_peft_with_identical_logits(trained, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = trained.run_dir / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert (adapter / "rocktune_config.yaml").is_file()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, adapter).eval()
    trained.model.eval()
    ids = torch.tensor([[97, 98, 99, 32, 61, 32, 100]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained.model(input_ids=ids).logits, rtol=0, atol=0)


def test_metrics_jsonl(trained):
    lines = [json.loads(x) for x in (trained.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]
    evals = [x for x in lines if "eval_loss" in x]
    assert [x["step"] for x in steps] == list(range(1, 7))
    assert [x["loss"] for x in steps] == pytest.approx(trained.losses)
    assert all(x["tokens"] > 0 and x["useful_tokens_per_s"] > 0 for x in steps)
    assert evals[0]["eval_loss"] == pytest.approx(trained.eval_loss_before)
    assert evals[-1]["eval_loss"] == pytest.approx(trained.eval_loss_after)


def test_refuses_existing_different_run_then_overwrite(trained, tiny_model_dir, capsys):
    out = trained.run_dir
    cfg = out / "config.yaml"
    before = sorted(p.name for p in out.iterdir())
    assert main(["train", "--no-supervise", "-c", str(cfg), "lora.r=4"]) == 2
    assert "different run" in capsys.readouterr().err
    assert main(["train", "--no-supervise", "-c", str(cfg)]) == 2
    assert "--resume" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before


def test_print_config(tmp_path, capsys):
    assert main(["train", "--print-config", "data.train_file=x.jsonl", "lora.r=4"]) == 0
    out = capsys.readouterr().out
    assert "r: 4" in out and "train_file: x.jsonl" in out and "precision: auto" in out


@pytest.mark.parametrize("override,pattern", [
    ("data.train_file={missing}", "does not exist"),
    ("model.name_or_path=./no/such/model", "model path ./no/such/model does not exist"),
    ("data.train_file={bad}", r"bad\.jsonl:2: malformed JSON"),
])
def test_bad_input_clear_error_nothing_written(tmp_path, tiny_model_dir, task_files, capsys, override, pattern):
    import re
    import yaml

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{oops\n')
    out = tmp_path / "out"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_run_config(tiny_model_dir, task_files[0], task_files[1], out)))
    code = main(["train", "--no-supervise", "-c", str(cfg),
                 override.format(missing=tmp_path / "missing.jsonl", bad=bad)])
    err = capsys.readouterr().err
    assert code == 2 and re.search(pattern, err) and "Traceback" not in err
    assert not out.exists()


def test_auto_fit_uses_the_planner(tiny_model_dir, task_files, tmp_path):
    from rocktune.planner import RunSpec, suggest_settings

    cfg = config_from_dict(tiny_run_config(tiny_model_dir, task_files[0], task_files[1], tmp_path / "out",
                                           max_steps=2, micro_batch_size=2, grad_accum=8))
    result = train(cfg, RunOptions(auto_fit=True, vram_bytes=2 * 2**30), quiet=True)
    sug = suggest_settings(str(tiny_model_dir), 2 * 2**30, RunSpec(seq_len=64, lora_r=8,
                           targets="all-linear", precision="fp32", attn="sdpa"), 16)
    import yaml

    saved = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert (saved["training"]["micro_batch_size"], saved["training"]["grad_accum"]) == \
        (sug.micro_batch_size, sug.grad_accum)
    assert sug.micro_batch_size * sug.grad_accum == 16
    with pytest.raises(UserError, match="smallest"):
        train(cfg, RunOptions(auto_fit=True, vram_bytes=2**20), quiet=True)


def test_one_list_of_notes_reaches_the_console_and_run_info(tiny_model_dir, task_files, tmp_path, capsys):
    """Every decision the run logs (environment, auto choices, feeding, data) is in run_info.json too, in order."""
    cfg = tiny_run_config(tiny_model_dir, *task_files, tmp_path / "out", max_steps=1)
    cfg["training"]["precision"] = "auto"
    train(config_from_dict(cfg))
    err = " ".join(capsys.readouterr().err.split())
    notes = json.loads((tmp_path / "out" / "run_info.json").read_text())["notes"]
    assert any(n.startswith("precision auto -> ") for n in notes) and any(n.startswith("batching: ") for n in notes)
    positions = [err.find(" ".join(n.split())) for n in notes]
    assert -1 not in positions and positions == sorted(positions), notes
