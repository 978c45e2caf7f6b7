"""A resume is checked before anything is applied: the saved per-rank RNG states must fit this launch (fewer GPUs or
processes than saved was an IndexError after the adapter had been restored)."""

from __future__ import annotations

import signal

import pytest

from rocktune.config import config_from_dict
from rocktune.errors import UserError
from rocktune.tasks import train
from rocktune.train import checkpoint_state, distributed
from rocktune.train.distributed import Dist
from rocktune.train.request import RunOptions
from tests.lm_runs import config, run_worker

CPU_STATE = {"cpu": "AAAA"}
GPU_STATE = {"cpu": "AAAA", "cuda": "AAAA"}


def test_rng_states_that_do_not_fit_the_launch_are_named_before_use(monkeypatch):
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(distributed.torch.cuda, "device_count", lambda: 1)  # this machine: one GPU
    assert distributed.rng_mismatch(Dist(rank=1, world=2, local_rank=1), None) is None
    assert distributed.rng_mismatch(Dist(rank=0, world=2), [GPU_STATE, GPU_STATE]) is None
    # saved by 4 ranks, 2 now (and the reverse: rank 3 of 4 finds 2 states, formerly states[3] -> IndexError)
    assert "saved for 4 process(es), this launch has 2" in distributed.rng_mismatch(Dist(rank=1, world=2),
                                                                                    [CPU_STATE] * 4)
    assert "saved for 2 process(es), this launch has 4" in distributed.rng_mismatch(Dist(rank=3, world=4),
                                                                                    [CPU_STATE] * 2)
    # rank 1 on GPU 1, which this machine does not have
    gone = distributed.rng_mismatch(Dist(rank=1, world=2, local_rank=1), [GPU_STATE, GPU_STATE])
    assert gone == "rank 1 saved the RNG state of its GPU 1, but this machine shows 1 GPU(s)"
    with pytest.raises(UserError, match="--resume: rank 1 saved the RNG state of its GPU 1.*--resume-force"):
        distributed.check_rng(Dist(rank=1, world=2, local_rank=1), [GPU_STATE, GPU_STATE], force=False)
    note = distributed.check_rng(Dist(rank=1, world=2, local_rank=1), [GPU_STATE, GPU_STATE], force=True)
    assert note.startswith("resume: rank 1 saved") and "fresh random numbers" in note
    distributed.restore_rng(Dist(rank=3, world=4), [CPU_STATE] * 2)  # forced: skipped, not an IndexError
    distributed.restore_rng(Dist(rank=1, world=2), None)  # a one-process checkpoint: nothing to restore, no TypeError


def test_a_refused_resume_applies_nothing(tiny_model_dir, data, tmp_path, monkeypatch):
    """The LM task's resume checks run on the checkpoint read, before checkpoint_state.apply touches the model."""
    cfg = config(tiny_model_dir, data, tmp_path / "run")
    assert run_worker(cfg, {"kill_at_step": 3}) == -signal.SIGKILL  # a checkpoint at step 2
    applied = []
    monkeypatch.setattr(checkpoint_state, "apply", lambda *a, **k: applied.append(a))

    def refuse(dist, states, force):
        raise UserError("--resume: RNG states were saved for 2 process(es), this launch has 1 (fed in)")

    monkeypatch.setattr(distributed, "check_rng", refuse)
    with pytest.raises(UserError, match="fed in"):
        train(config_from_dict(cfg), RunOptions(resume=True), quiet=True)
    assert applied == []


def test_a_key_a_newer_version_added_at_its_default_does_not_refuse_the_resume(tmp_path):
    """An upgrade between a kill and its resume: the run's config.yaml lacks the new key. At its default it computes
    what the old version computed; set to anything else it is a change like any other."""
    import yaml

    from rocktune.errors import UserError
    from rocktune.train.resume import check_config
    from rocktune.train.rundir import CONFIG_NAME

    now = {"training": {"lr": 1e-3, "optimizer": "auto"}, "reliability": {"check_path_every": 500}}
    (tmp_path / CONFIG_NAME).write_text(yaml.safe_dump({"training": {"lr": 1e-3}}))
    check_config(tmp_path, now, force=False)
    with pytest.raises(UserError, match="training.optimizer"):
        check_config(tmp_path, {**now, "training": {"lr": 1e-3, "optimizer": "adamw_torch"}}, force=False)
