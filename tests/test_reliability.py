"""Fault injection on CPU: kills, corrupted checkpoints, OOM, NaN, full disk, a supervised crash, Ctrl-C.

The reference is one uninterrupted run; every faulted run must end with the same adapter bytes and the same logged
losses (bitwise) — or, for OOM recovery, the same samples per step and losses equal up to summation order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rocktune.config import config_from_dict
from rocktune.errors import UserError
from rocktune.train import checkpoint
from rocktune.train.faults import Faults
from rocktune.train.guards import FatalNumerics, RollbackRequired
from rocktune.train.loop import train
from tests.conftest import tiny_run_config, write_jsonl

STEPS = 8
DETERMINISTIC = ("step", "loss", "lr", "grad_norm", "tokens", "batch_tokens", "samples", "eval_loss", "epoch")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from rocktune.demo.task import make_task

    tmp = tmp_path_factory.mktemp("rel")
    tr, ev = make_task(n_train=200, n_eval=16, seed=2)
    return write_jsonl(tmp / "train.jsonl", tr), write_jsonl(tmp / "eval.jsonl", ev)


def config(tiny_model_dir, data, out: Path, **training) -> dict:
    cfg = tiny_run_config(tiny_model_dir, data[0], data[1], out, max_steps=STEPS, **training)
    cfg["lora"]["dropout"] = 0.1  # dropout draws from the RNG: resume must restore it exactly
    cfg["reliability"] = {"save_every": 2, "keep_checkpoints": 2, "min_free_disk_mb": 0}
    return cfg


def logged(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k in DETERMINISTIC} for r in rows]


def adapter_bytes(run_dir: Path) -> bytes:
    return (run_dir / "adapter" / "adapter_model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def reference(tiny_model_dir, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    train(config_from_dict(config(tiny_model_dir, data, out)), quiet=True)
    return out


def run_worker(cfg: dict, faults: dict | None, resume: bool = False, overwrite: bool = True) -> int:
    payload = {"config": cfg, "overwrite": overwrite, "resume": resume, "resume_force": False, "pieces": 1}
    env = dict(os.environ, ROCKTUNE_FAULTS=json.dumps(faults or {}))
    return subprocess.run([sys.executable, "-m", "rocktune.train.worker", json.dumps(payload)], env=env,
                          capture_output=True, text=True).returncode


@pytest.mark.parametrize("kill_at", [1, 3, 6])
def test_sigkill_then_resume_is_bitwise_identical(tiny_model_dir, data, reference, tmp_path, kill_at):
    cfg = config(tiny_model_dir, data, tmp_path / "run")
    assert run_worker(cfg, {"kill_at_step": kill_at}) == -signal.SIGKILL
    result = train(config_from_dict(cfg), resume_run=True, quiet=True)
    assert not result.interrupted
    assert logged(tmp_path / "run") == logged(reference)
    assert adapter_bytes(tmp_path / "run") == adapter_bytes(reference)


def test_corrupt_newest_checkpoint_falls_back_to_previous(tiny_model_dir, data, reference, tmp_path):
    cfg = config(tiny_model_dir, data, tmp_path / "run")
    assert run_worker(cfg, {"kill_at_step": 7}) == -signal.SIGKILL
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-0000004", "step-0000006"]
    victim = ckpts / "step-0000006" / "adapter_model.safetensors"
    victim.write_bytes(victim.read_bytes()[:100])  # a torn write
    assert "sha256" in checkpoint.verify(ckpts / "step-0000006")
    train(config_from_dict(cfg), resume_run=True, quiet=True)
    assert (ckpts / "damaged-step-0000006").is_dir()  # kept as evidence, out of the way of pruning
    assert logged(tmp_path / "run") == logged(reference)
    assert adapter_bytes(tmp_path / "run") == adapter_bytes(reference)


def test_partial_checkpoint_without_manifest_is_skipped(tmp_path):
    (tmp_path / "step-0000009").mkdir(parents=True)
    assert "manifest" in checkpoint.verify(tmp_path / "step-0000009")
    for _ in range(2):  # and the same refusal again: nothing is renamed away when nothing could be loaded
        with pytest.raises(UserError, match="no checkpoint .* can be used"):
            checkpoint.restore(tmp_path, None, None, None, None)
    assert (tmp_path / "step-0000009").is_dir()


def test_oom_mid_run_splits_and_sees_same_samples(tiny_model_dir, data, tmp_path):
    cfgs = {}
    for name in ("plain", "oom"):
        cfgs[name] = config(tiny_model_dir, data, tmp_path / name)
        cfgs[name]["lora"]["dropout"] = 0.0  # dropout masks depend on piece shapes; compare the arithmetic only
    train(config_from_dict(cfgs["plain"]), quiet=True)
    # The OOM hits the step's second micro-batch, after the first one already accumulated gradients.
    train(config_from_dict(cfgs["oom"]), quiet=True, faults=Faults({"oom_at_step": 3, "oom_at_forward": 2}))
    got, want = logged(tmp_path / "oom"), logged(tmp_path / "plain")
    assert [r.get("samples") for r in got] == [r.get("samples") for r in want]
    assert [r.get("tokens") for r in got] == [r.get("tokens") for r in want]
    for g, w in zip(got, want):
        for key in ("loss", "eval_loss"):
            if key in w:
                assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6)
    state = json.loads((tmp_path / "oom" / "checkpoints" / "step-0000008" / "meta.json").read_text())
    assert state["extra"]["pieces"] == 2


def test_nan_step_is_skipped_and_k_in_a_row_roll_back(tiny_model_dir, data, tmp_path):
    cfg = config(tiny_model_dir, data, tmp_path / "a")
    train(config_from_dict(cfg), quiet=True, faults=Faults({"nan_at_steps": [3]}))
    state = json.loads((tmp_path / "a" / "checkpoints" / "step-0000008" / "meta.json").read_text())
    assert state["extra"]["skipped_steps"] == 1
    cfg = config(tiny_model_dir, data, tmp_path / "b")
    with pytest.raises(RollbackRequired, match="3 steps in a row"):
        train(config_from_dict(cfg), quiet=True, faults=Faults({"nan_at_steps": [3, 4, 5]}))
    assert (tmp_path / "b" / "checkpoints" / "step-0000002").is_dir()


def test_rollback_under_supervisor_falls_back_to_fp32_and_finishes(tiny_model_dir, data, tmp_path):
    from rocktune.train.supervisor import supervise

    cfg = config(tiny_model_dir, data, tmp_path / "run", precision="bf16")
    os.environ["ROCKTUNE_FAULTS"] = json.dumps({"nan_at_steps": [3, 4, 5], "marker": str(tmp_path / "m")})
    try:
        payload = {"config": cfg, "overwrite": True, "resume": False, "resume_force": False, "pieces": 1}
        assert supervise(payload, max_restarts=2) == 0
    finally:
        del os.environ["ROCKTUNE_FAULTS"]
    incidents = [json.loads(x) for x in (tmp_path / "run" / "incidents.jsonl").read_text().splitlines()]
    assert len(incidents) == 1 and "non-finite" in incidents[0]["cause"]
    import yaml

    assert yaml.safe_load((tmp_path / "run" / "adapter" / "rocktune_config.yaml").read_text()
                          )["training"]["precision"] == "fp32"


def test_silent_zeros_and_corrupt_transfer_stop_with_diagnosis(tiny_model_dir, data, tmp_path):
    with pytest.raises(FatalNumerics, match="rocktune doctor"):
        train(config_from_dict(config(tiny_model_dir, data, tmp_path / "a")), quiet=True,
              faults=Faults({"zero_loss": True}))
    with pytest.raises(FatalNumerics, match="host-to-device transfers are corrupting"):
        train(config_from_dict(config(tiny_model_dir, data, tmp_path / "b")), quiet=True,
              faults=Faults({"corrupt_transfer_at_step": 2}))


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


def test_ctrl_c_checkpoints_and_resume_finishes(tiny_model_dir, data, reference, tmp_path):
    import yaml

    cfg = config(tiny_model_dir, data, tmp_path / "run")
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    # Slow steps give a wide, deterministic window to press Ctrl-C in.
    env = dict(os.environ, ROCKTUNE_FAULTS=json.dumps({"slow_steps": 1.0}))
    proc = subprocess.Popen([sys.executable, "-m", "rocktune", "train", "-c", str(cfg_file)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.is_file() and '"loss"' in metrics.read_text()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # to the supervisor, as a terminal's Ctrl-C would be
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted: checkpoint at step" in err
    assert (tmp_path / "run" / "checkpoints" / "latest").is_file()
    assert not (tmp_path / "run" / "adapter").exists()
    train(config_from_dict(cfg), resume_run=True, quiet=True)
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
        train(config_from_dict(changed), resume_run=True, quiet=True)
    own.write_text(own.read_text().replace("reverse", "invert"))
    with pytest.raises(UserError, match="training data"):
        train(config_from_dict(cfg), resume_run=True, quiet=True)
    own.write_text(Path(data[0]).read_text())
    longer = json.loads(json.dumps(cfg))
    longer["training"]["max_steps"] = STEPS + 2  # changes the lr schedule: only on purpose
    with pytest.raises(UserError, match="max_steps"):
        train(config_from_dict(longer), resume_run=True, quiet=True)
    assert train(config_from_dict(longer), resume_run=True, resume_force=True, quiet=True).steps == STEPS + 2


def test_oom_at_one_example_stops_with_planner_suggestion(tiny_model_dir, data, tmp_path):
    from rocktune.train.step import OutOfMemoryAtMinimum

    cfg = config(tiny_model_dir, data, tmp_path / "run", micro_batch_size=1)
    with pytest.raises(OutOfMemoryAtMinimum, match="one example per forward.*rocktune plan suggests"):
        train(config_from_dict(cfg), quiet=True, faults=Faults({"oom_at_step": 2, "oom_repeat": True}))


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
    from rocktune.train import supervisor

    calls = iter(attempts)

    def fake_child(payload):
        exit_code, status = next(calls)
        if status is not None:
            Path(payload["status_file"]).write_text(json.dumps(status))
        return exit_code, False

    monkeypatch.setattr(supervisor, "_run_child", fake_child)
    run_dir = tmp_path / "run"
    payload = {"config": {"output": {"dir": str(run_dir)}, "training": {"precision": "fp32"}}, "pieces": 1}
    assert supervisor.supervise(payload, max_restarts=3) == code
    assert [json.loads(x)["restart"] for x in (run_dir / "incidents.jsonl").read_text().splitlines()] == restarts
    assert next(calls, None) is None  # every attempt was used, none more
