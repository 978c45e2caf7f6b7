"""The training-path tripwire (train/tripwire.py) in real runs of the tiny model: silent, and without effect on
what is trained, while the path is right; a stop with the named cause when it is not (the two failures that once
reached users, put back by hand)."""

from __future__ import annotations

import pytest
import torch

from rocktune import lora_fused
from rocktune.config import config_from_dict
from rocktune.tasks import train
from rocktune.train import tripwire
from tests.conftest import tiny_run_config
from tests.test_train import EXPECTED_LOSSES

pytestmark = pytest.mark.torches  # on every torch users run too (make test-torches)


def _run(tiny_model_dir, task_files, tmp_path, **training):
    cfg = tiny_run_config(tiny_model_dir, *task_files, tmp_path / "out", **training)
    cfg["reliability"] = {"check_path_every": 3, "min_free_disk_mb": 0}
    return train(config_from_dict(cfg), quiet=True)


@pytest.fixture
def probes(monkeypatch):
    """The steps at which the tripwire compared the path with the reference."""
    seen = []
    real = tripwire.Tripwire._probe

    def spy(self, batch):
        problems = real(self, batch)
        seen.append(problems)
        return problems

    monkeypatch.setattr(tripwire.Tripwire, "_probe", spy)
    return seen


def test_a_right_path_passes_and_trains_exactly_as_without_the_tripwire(tiny_model_dir, task_files, tmp_path,
                                                                         probes):
    """test_train's recorded losses (recorded without a tripwire) with checks at steps 1, 2, 3 and 6."""
    result = _run(tiny_model_dir, task_files, tmp_path)
    assert result.losses == pytest.approx(EXPECTED_LOSSES, rel=2e-3)
    assert probes == [[], [], [], []]


@pytest.mark.parametrize("optimizer", ["adamw_fused", "adamw_foreach"])
def test_a_stale_adapter_cast_stops_the_run_at_step_2(tiny_model_dir, task_files, tmp_path, monkeypatch, optimizer):
    frozen: dict = {}
    real = lora_fused._adapter_casts

    def stale(plan, a_params, b_params, dtype):  # the cache that fused AdamW never invalidated
        key = id(a_params[0])
        if key not in frozen:
            a, bs = real(plan, a_params, b_params, dtype)
            frozen[key] = (a.detach().clone(), [b.detach().clone() for b in bs])
        return frozen[key]

    monkeypatch.setattr(lora_fused, "_adapter_casts", stale)
    first = r"step 2: .*failed.*\. the run's forward matched PEFT's reference before the first update and not after"
    with pytest.raises(tripwire.TrainingPathWrong, match=first):
        _run(tiny_model_dir, task_files, tmp_path, optimizer=optimizer, warmup_steps=0)


def test_gradients_a_compiler_drops_stop_the_run_at_step_1(tiny_model_dir, task_files, tmp_path, monkeypatch):
    real = lora_fused.FusedLoRA.backward

    def dropped(ctx, *dys):  # torch 2.11's compiled graph: the input's gradient, none for A and B
        grads = real(ctx, *dys)
        return (*grads[:2], *[None if i % 4 >= 2 else g for i, g in enumerate(grads[2:])])

    monkeypatch.setattr(lora_fused.FusedLoRA, "backward", staticmethod(dropped))
    with pytest.raises(tripwire.TrainingPathWrong, match=r"step 1: .*LoRA side path computes no gradient"):
        _run(tiny_model_dir, task_files, tmp_path)


def test_an_optimizer_that_does_not_update_stops_the_run(tiny_model_dir, task_files, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, closure=None: None)
    with pytest.raises(tripwire.TrainingPathWrong, match=r"step \d: .*left the adapter unchanged"):
        _run(tiny_model_dir, task_files, tmp_path, warmup_steps=0)


def test_the_stop_is_final_and_named_for_the_supervisor(tmp_path):
    """A wrong path is a diagnosis a restart cannot fix: the worker's FATAL status, never retried."""
    from rocktune import exits
    from rocktune.train.guards import FatalNumerics

    assert issubclass(tripwire.TrainingPathWrong, FatalNumerics) and exits.FATAL in exits.FINAL
