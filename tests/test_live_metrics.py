"""During training: sample generations at the eval points, TensorBoard event files, optional W&B / MLflow."""

from __future__ import annotations

import json
import math
import sys
import types

import pytest

from rocktune.config import config_from_dict
from rocktune.errors import UserError
from rocktune.train import sinks
from rocktune.tasks.causal.samples import SampleSettings, Sampler, prompts_from_examples
from tests.conftest import tiny_run_config, write_jsonl


@pytest.fixture(scope="module")
def live_run(tiny_model_dir, tmp_path_factory):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from rocktune.demo.task import make_task
    from rocktune.tasks import train

    tmp = tmp_path_factory.mktemp("live")
    tr, ev = make_task(n_train=64, n_eval=8, seed=1)
    cfg = tiny_run_config(tiny_model_dir, write_jsonl(tmp / "train.jsonl", tr), write_jsonl(tmp / "eval.jsonl", ev),
                          tmp / "out", max_steps=4, micro_batch_size=4, grad_accum=1, eval_every=2, sample_count=2,
                          sample_prompts=["add 1 2 ="], sample_max_new_tokens=4)
    cfg["output"]["tensorboard"] = True
    result = train(config_from_dict(cfg), quiet=True)
    return result, ev


def _events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_holds_the_logged_values(live_run):
    result, _ = live_run
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    acc = _events(result.run_dir / "tensorboard")
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert loss == pytest.approx({r["step"]: r["loss"] for r in lines if "loss" in r}, rel=1e-6)
    assert [e.step for e in acc.Scalars("eval/loss")] == [0, 2, 4]
    assert acc.Scalars("eval/loss")[-1].value == pytest.approx(result.eval_loss_after, rel=1e-6)
    assert {"train/lr", "train/grad_norm", "perf/useful_tokens_per_s", "perf/step_s"} <= set(acc.Tags()["scalars"])
    text = acc.Tensors("samples/text_summary")  # add_text stores the markdown as a string tensor
    assert [t.step for t in text] == [0, 2, 4]
    assert "add 1 2 =" in text[-1].tensor_proto.string_val[0].decode()


def test_samples_at_each_eval_point_with_fixed_prompts(live_run):
    result, ev = live_run
    rows = [json.loads(x) for x in (result.run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [0, 2, 4]
    for step in (0, 2, 4):
        at = [r for r in rows if r["step"] == step]
        assert [r["prompt"] for r in at] == [ev[0]["prompt"], ev[1]["prompt"], "add 1 2 ="]
        assert [r["expected"] for r in at] == [ev[0]["completion"], ev[1]["completion"], None]
    # The final model completes the prompts as logged at the last eval point (greedy: reproducible).
    again = Sampler(result.run_dir / "again.jsonl", result.tokenizer, [(result.tokenizer(ev[0]["prompt"])["input_ids"],
                    None)], [result.tokenizer.eos_token_id], SampleSettings(0, [], 4, "cpu"))
    assert again._complete(result.model, again.prompts[0][0]) == at[0]["output"]


def test_prompt_is_everything_before_the_first_trained_token():
    ids = [[5, 6, 7, 8, 9], [1, 2, 3]]
    labels = [[-100, -100, 7, 8, 9], [-100, -100, -100]]  # the second has nothing trained: skipped
    assert prompts_from_examples(ids, labels, 5) == [([5, 6], [7, 8, 9])]


def test_resume_drops_samples_after_the_checkpoint(tmp_path, tokenizer):
    path = tmp_path / "samples.jsonl"
    write_jsonl(path, [{"step": s, "prompt": "p", "output": "o"} for s in (0, 2, 4)])
    Sampler(path, tokenizer, [([1], None)], [256], SampleSettings(0, [], 4, "cpu"), redo_from=3)  # resumed at 2
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 2]
    # resumed at the last step (4 of 4): only the final phase is redone, so the final samples (step 4) go
    write_jsonl(path, [{"step": s, "prompt": "p", "output": "o"} for s in (0, 2, 4)])
    Sampler(path, tokenizer, [([1], None)], [256], SampleSettings(0, [], 4, "cpu"), redo_from=4)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 2]
    # a fresh run starts the file over
    Sampler(path, tokenizer, [([1], None)], [256], SampleSettings(0, [], 4, "cpu"), redo_from=0)
    assert path.read_text() == ""


def test_scalars_map_and_skip_nonfinite():
    got = sinks.scalars({"step": 3, "loss": 1.5, "grad_norm": math.inf, "peak_mem_bytes": 2**31, "tokens": 9})
    assert got == {"train/loss": 1.5, "perf/peak_mem_gib": 2.0}


class _Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append((name, a, k)) or self


def test_mlflow_and_wandb_get_the_same_numbers(tmp_path, monkeypatch):
    mlflow, wandb = _Recorder(), _Recorder()
    run = _Recorder()
    wandb.init = lambda **k: wandb.calls.append(("init", (), k)) or run
    monkeypatch.setitem(sys.modules, "mlflow", types.SimpleNamespace(**{n: getattr(mlflow, n) for n in (
        "set_experiment", "start_run", "log_metrics", "log_text", "end_run")}))
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=wandb.init, Html=lambda s: s))
    base = _Recorder()
    log = sinks.open_log(base, tmp_path, 0, tensorboard=False, wandb=True, mlflow=True)
    log.write({"step": 1, "loss": 2.0, "lr": 1e-3})
    log.text("samples", "| a | b |", 1)
    log.close()
    assert ("write", ({"step": 1, "loss": 2.0, "lr": 1e-3},), {}) in base.calls  # metrics.jsonl first
    assert ("log_metrics", ({"train_loss": 2.0, "train_lr": 1e-3},), {"step": 1}) in mlflow.calls
    assert ("log", ({"train/loss": 2.0, "train/lr": 1e-3},), {"step": 1}) in run.calls
    assert ("end_run", (), {}) in mlflow.calls and ("finish", (), {}) in run.calls


def test_missing_client_is_refused_before_the_run(monkeypatch):
    monkeypatch.setattr(sinks.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="output.mlflow=true but the mlflow package is not installed"):
        sinks.require(tensorboard=False, wandb=False, mlflow=True)
    sinks.require(tensorboard=False, wandb=False, mlflow=False)


@pytest.mark.slow
def test_real_mlflow_and_wandb_clients_receive_the_run(tiny_model_dir, task_files, tmp_path, monkeypatch):
    """The real clients, locally: MLflow into a SQLite store (read back through its own client), W&B offline (its
    run file holds the logged series; the run's summary holds the last values). No server, no network."""
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    from rocktune.config import config_from_dict
    from rocktune.tasks import train
    from tests.conftest import tiny_run_config

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny_run_config(tiny_model_dir, *task_files, tmp_path / "run", max_steps=3)
    cfg["output"].update(mlflow=True, wandb=True)
    summaries = []
    original = sinks._WandB.close
    monkeypatch.setattr(sinks._WandB, "close", lambda self: summaries.append(dict(self.run.summary)) or original(self))
    train(config_from_dict(cfg), quiet=True)
    losses = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    [run] = MlflowClient().search_runs([mlflow.get_experiment_by_name("rocktune").experiment_id])
    history = MlflowClient().get_metric_history(run.info.run_id, "train_loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["loss"])) for r in losses]
    [wandb_file] = (tmp_path / "run").rglob("run-*.wandb")
    data = wandb_file.read_bytes()  # W&B's record log: each history item's key and value as JSON text
    assert b"train/loss" in data and b"perf/useful_tokens_per_s" in data
    assert all(json.dumps(r["loss"]).encode() in data for r in losses), [r["loss"] for r in losses]
    assert summaries and summaries[0]["_step"] >= 1
