"""The training-path tripwire (train/tripwire.py) in real runs of the tiny model: silent, and without effect on
what is trained, while the path is right; a stop with the named cause when it is not (the two failures that once
reached users, put back by hand)."""

from __future__ import annotations

import pytest
import torch

from rocktune.lora import fused as lora_fused
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

    def spy(self, *args):
        problems = real(self, *args)
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


def _dropout_model(tiny_model_dir, device: str):
    from rocktune.lora.lean import lean_lora
    from rocktune.models.load import apply_lora, load_model

    torch.manual_seed(0)
    model = apply_lora(load_model(str(tiny_model_dir), "fp32", "sdpa", False, device), 8, 16, 0.1, "all-linear", False)
    for n, p in model.named_parameters():  # LoRA B starts at zero: give it values so the side path matters
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    lean_lora(model, fused=True)
    return model.train()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")])])
def test_the_probe_seeds_dropout_as_torch_manual_seed_did_and_leaves_the_run_s_rng(tiny_model_dir, monkeypatch,
                                                                                    device):
    """The probe seeds only the generators it forked (lora_check._seed): the same dropout masks, to the bit, as the
    torch.manual_seed it replaced, the path and the reference agree under them, and the run's RNG stream is where
    it was. The adapter tensors handed in are the ones it would find itself."""
    from rocktune.lora import check as lora_check

    model = _dropout_model(tiny_model_dir, device)
    ids = torch.arange(5, 37, device=device).view(1, 32)

    def loss_fn(m):
        return m(input_ids=ids).logits.float().logsumexp(-1).sum()

    before = torch.get_rng_state(), torch.cuda.get_rng_state() if device == "cuda" else None
    got = lora_check.probe(model, loss_fn, params=lora_check.adapter_params(model))
    assert torch.equal(torch.get_rng_state(), before[0])
    assert device == "cpu" or torch.equal(torch.cuda.get_rng_state(), before[1])
    with lora_check.reference_mode(model):
        ref = lora_check.probe(model, loss_fn)
    assert lora_check.compare_probe(got, ref, "fp32") == []
    monkeypatch.setattr(lora_check, "_seed", lambda seed, devices: torch.manual_seed(seed))
    old = lora_check.probe(model, loss_fn)
    assert got.loss == old.loss and list(got.grads) == list(old.grads)
    assert all(torch.equal(got.grads[n], old.grads[n]) for n in old.grads)
    assert lora_check.probe(model, loss_fn, seed=1).loss != got.loss  # dropout is on: another seed, other masks


@pytest.mark.parametrize("rows,pieces", [(5, 2), (5, 3), (5, 5), (32, 32), (4, 1)])
def test_row_pieces_are_cut_when_asked_and_are_the_eager_split(rows, pieces):
    """The tripwire takes only the first piece of split_by_rows, which cuts no other: every piece is the rows an
    eager split gave, by index, from the end, by slice and by iteration (the OOM split's use)."""
    from rocktune.train.step import split_by_rows

    batch = {"input_ids": torch.arange(rows * 3).view(rows, 3), "weight": torch.arange(rows, dtype=torch.float32)}
    size = -(-rows // pieces)
    eager = [{k: v[i: i + size] for k, v in batch.items()} for i in range(0, rows, size)]
    got = split_by_rows(batch, pieces)

    def same(a, b):
        return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)

    assert len(got) == len(eager) and all(same(a, b) for a, b in zip(got, eager, strict=True))
    assert same(got[0], eager[0]) and same(got[-1], eager[-1])
    assert all(same(a, b) for a, b in zip(got[1:], eager[1:], strict=True))
    with pytest.raises(IndexError):
        got[len(eager)]
