"""Fault injection on CPU, the LM task: the supervisor, checkpoint writes, resume refusals, OOM at one example.
The contract every task holds (kills, damaged checkpoints, OOM split, NaN, Ctrl-C) is tests/test_task_contract.py.

The reference is one uninterrupted run; every faulted run must end with the same adapter bytes and the same logged
losses (bitwise) — or, for OOM recovery, the same samples per step and losses equal up to summation order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rocktune.config import config_from_dict
from rocktune.errors import UserError
from rocktune.train import checkpoint
from rocktune.train.faults import Faults
from rocktune.tasks import train
from rocktune.train.request import RunOptions, RunRequest
from tests.lm_runs import STEPS, adapter_bytes, config, logged, run_worker

def test_partial_checkpoint_without_manifest_is_skipped(tmp_path):
    (tmp_path / "step-0000009").mkdir(parents=True)
    assert "manifest" in checkpoint.verify(tmp_path / "step-0000009")
    for _ in range(2):  # and the same refusal again: nothing is renamed away when nothing could be loaded
        with pytest.raises(UserError, match="no checkpoint .* can be used"):
            checkpoint.restore(tmp_path, checkpoint.TrainState(None, None, None, None))
    assert (tmp_path / "step-0000009").is_dir()


def test_rollback_under_supervisor_falls_back_to_fp32_and_finishes(tiny_model_dir, data, tmp_path):
    from rocktune.process.supervisor import supervise

    cfg = config(tiny_model_dir, data, tmp_path / "run", precision="bf16")
    os.environ["ROCKTUNE_FAULTS"] = json.dumps({"nan_at_steps": [3, 4, 5], "marker": str(tmp_path / "m")})
    try:
        assert supervise(RunRequest(cfg, RunOptions(overwrite=True)), max_restarts=2) == 0
    finally:
        del os.environ["ROCKTUNE_FAULTS"]
    incidents = [json.loads(x) for x in (tmp_path / "run" / "incidents.jsonl").read_text().splitlines()]
    assert len(incidents) == 1 and "non-finite" in incidents[0]["cause"]
    import yaml

    assert yaml.safe_load((tmp_path / "run" / "adapter" / "rocktune_config.yaml").read_text()
                          )["training"]["precision"] == "fp32"


@pytest.mark.parametrize("kind", ["oserror", "runtime"])
def test_failed_checkpoint_write_keeps_previous(tiny_model_dir, data, reference, tmp_path, kind):
    cfg = config(tiny_model_dir, data, tmp_path / "run")
    cfg["reliability"]["keep_checkpoints"] = 5
    train(config_from_dict(cfg), quiet=True,
          faults=Faults({"fail_checkpoint_at_step": 4, "fail_checkpoint_kind": kind}))
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-0000002", "step-0000006", "step-0000008"]
    assert not list(ckpts.glob(".tmp-*"))
    assert all(checkpoint.verify(p) is None for p in ckpts.glob("step-*"))
    assert adapter_bytes(tmp_path / "run") == adapter_bytes(reference)


def test_full_disk_detected_before_writing(tiny_model_dir, data, tmp_path):
    cfg = config(tiny_model_dir, data, tmp_path / "run")
    cfg["reliability"]["min_free_disk_mb"] = 1 << 40  # more than any disk has: every save is refused up front
    result = train(config_from_dict(cfg), quiet=True)
    assert result.eval_loss_after is not None  # the run still finished and saved its adapter
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert not list((tmp_path / "run" / "checkpoints").glob("*step-*"))


@pytest.mark.long
def test_supervisor_restarts_killed_child(tiny_model_dir, data, reference, tmp_path):
    cfg = config(tiny_model_dir, data, tmp_path / "run")
    env = dict(os.environ, ROCKTUNE_FAULTS=json.dumps({"kill_at_step": 5, "marker": str(tmp_path / "m")}))
    cfg_file = tmp_path / "c.yaml"
    import yaml

    cfg_file.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "rocktune", "train", "-c", str(cfg_file)], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    incidents = [json.loads(x) for x in (tmp_path / "run" / "incidents.jsonl").read_text().splitlines()]
    assert [(i["cause"], i["last_logged_step"], i["restart"]) for i in incidents] == [("signal SIGKILL", 4, 1)]
    assert logged(tmp_path / "run") == logged(reference)
    assert adapter_bytes(tmp_path / "run") == adapter_bytes(reference)


def test_resume_refuses_changed_config_or_data(tiny_model_dir, data, tmp_path):
    own = tmp_path / "train.jsonl"
    own.write_text(Path(data[0]).read_text())
    cfg = config(tiny_model_dir, (own, data[1]), tmp_path / "run")
    assert run_worker(cfg, {"kill_at_step": 3}) == -signal.SIGKILL
    changed = json.loads(json.dumps(cfg))
    changed["lora"]["r"] = 4
    with pytest.raises(UserError, match=r"lora\.r.*--resume-force"):
        train(config_from_dict(changed), RunOptions(resume=True), quiet=True)
    own.write_text(own.read_text().replace("reverse", "invert"))
    with pytest.raises(UserError, match="training data"):
        train(config_from_dict(cfg), RunOptions(resume=True), quiet=True)
    own.write_text(Path(data[0]).read_text())
    longer = json.loads(json.dumps(cfg))
    longer["training"]["max_steps"] = STEPS + 2  # changes the lr schedule: only on purpose
    with pytest.raises(UserError, match="max_steps"):
        train(config_from_dict(longer), RunOptions(resume=True), quiet=True)
    assert train(config_from_dict(longer), RunOptions(resume=True, resume_force=True), quiet=True).steps == STEPS + 2


def test_oom_at_one_example_stops_with_planner_suggestion(tiny_model_dir, data, tmp_path):
    from rocktune.train.step import OutOfMemoryAtMinimum

    cfg = config(tiny_model_dir, data, tmp_path / "run", micro_batch_size=1)
    with pytest.raises(OutOfMemoryAtMinimum, match="one example per forward.*rocktune plan suggests"):
        train(config_from_dict(cfg), quiet=True, faults=Faults({"oom_at_step": 2, "oom_repeat": True}))


@pytest.mark.long
def test_repeated_fault_at_one_step_steps_down_then_gives_up(tiny_model_dir, data, tmp_path):
    import yaml

    cfg = config(tiny_model_dir, data, tmp_path / "run")
    cfg["reliability"]["max_restarts"] = 2
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, ROCKTUNE_FAULTS=json.dumps({"kill_at_step": 5}))  # no marker: dies there every time
    proc = subprocess.run([sys.executable, "-m", "rocktune", "train", "-c", str(cfg_file)], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 1
    incidents = [json.loads(x) for x in (tmp_path / "run" / "incidents.jsonl").read_text().splitlines()]
    assert [i["restart"] for i in incidents] == [1, 2, None] and {i["last_logged_step"] for i in incidents} == {4}
    assert "micro-batches split in 2" in proc.stderr and "restarts used up" in proc.stderr
    assert checkpoint.verify(tmp_path / "run" / "checkpoints" / "step-0000004") is None  # the work so far is intact


def test_deterministic_startup_error_is_not_restarted(tiny_model_dir, data, tmp_path):
    import yaml

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(config(tiny_model_dir, data, tmp_path / "run")))
    env = dict(os.environ, ROCKTUNE_FAULTS=json.dumps({"startup_error": True}))
    proc = subprocess.run([sys.executable, "-m", "rocktune", "train", "-c", str(cfg_file)], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.count("Traceback") == 1 and proc.stderr.count("not retried") == 1  # one attempt, one report
    assert "restart 1/" not in proc.stderr
    incidents = [json.loads(x) for x in (tmp_path / "run" / "incidents.jsonl").read_text().splitlines()]
    assert [(i["cause"], i["restart"]) for i in incidents] == [
        ("RuntimeError: injected start-up failure (ROCKTUNE_FAULTS)", None)]


@pytest.mark.parametrize("attempts, code, restarts", [
    ([(-9, None), (-9, None)], 1, [1, None]),  # killed twice before any step: the second is not retried
    ([(5, {"cause": "disk full: x"})], 5, [None]),  # a full disk is never retried
    ([(1, {"stepped": True, "cause": "E"}), (1, {"stepped": True, "cause": "E"}), (0, None)], 0, [1, 2]),
    ([(-9, None), (-9, {"stepped": True}), (0, None)], 0, [1, 2]),  # got past start-up the second time
])
def test_supervisor_restarts_only_what_a_restart_can_fix(tmp_path, monkeypatch, attempts, code, restarts):
    from rocktune.process import supervisor

    calls = iter(attempts)

    def fake_child(request):
        exit_code, status = next(calls)
        if status is not None:
            Path(request.status_file).write_text(json.dumps(status))
        return exit_code, False

    monkeypatch.setattr(supervisor, "_run_child", fake_child)
    run_dir = tmp_path / "run"
    request = RunRequest({"output": {"dir": str(run_dir)}, "training": {"precision": "fp32"}})
    assert supervisor.supervise(request, max_restarts=3) == code
    assert [json.loads(x)["restart"] for x in (run_dir / "incidents.jsonl").read_text().splitlines()] == restarts
    assert next(calls, None) is None  # every attempt was used, none more
