"""The training-path tripwire knows the recurrent layers' kernels (train/tripwire.py, rocktune.kernels.recurrent):
its reference forward runs them on transformers' torch functions, so a fast kernel that passed its small self-test at
load and computes other values on the run's own batch stops the run at step 1, named as the cause; right kernels
leave the run exactly as on the torch path. Stand-ins for the GPU kernels, as in tests/test_recurrent_kernels.py."""

from __future__ import annotations

import pytest

from rocktune.config import config_from_dict
from rocktune.kernels import recurrent
from rocktune.train import tripwire
from tests.family_fixtures import BY_NAME, TEMPLATES, build_family, chat_records

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5TextConfig"):
    pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5 (rocktune chooses the kernels transformers "
                "5 resolves per modeling module)", allow_module_level=True)


@pytest.fixture(autouse=True)
def _transformers_own_kernels_after():
    yield
    recurrent.restore()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return build_family(BY_NAME["qwen3.5"], tmp_path_factory.mktemp("hybrid") / "qwen3.5")


def _run(model, tmp_path):
    from rocktune.tasks import train
    from tests.conftest import tiny_run_config, write_jsonl

    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(tmp_path / "train.jsonl", chat_records(16, TEMPLATES["qwen3.5"].system))
    cfg = tiny_run_config(model, data, None, tmp_path / "out", max_steps=2, micro_batch_size=4, grad_accum=1)
    cfg["reliability"] = {"min_free_disk_mb": 0}
    return train(config_from_dict(cfg), quiet=True)


def _loaded_with(monkeypatch, wrap):
    """Every model the run loads gets stand-ins for its recurrent kernels: their torch functions through ``wrap``."""
    def apply(model, device):
        kernels = recurrent.layer_kernels(model)
        recurrent.settle(model, device, {k.name: wrap(k.name, k.torch_fn) for k in kernels})
    monkeypatch.setattr(recurrent, "apply", apply)


@pytest.fixture
def probes(monkeypatch):
    seen = []
    real = tripwire.Tripwire._probe

    def spy(self, *args):
        seen.append(real(self, *args))
        return seen[-1]

    monkeypatch.setattr(tripwire.Tripwire, "_probe", spy)
    return seen


def test_right_fast_kernels_train_as_the_torch_path_and_pass_the_tripwire(hybrid, tmp_path, monkeypatch, probes):
    torch_path = _run(hybrid, tmp_path / "torch")
    used = []
    _loaded_with(monkeypatch, lambda name, fn: lambda *a, **k: used.append(name) or fn(*a, **k))
    fast = _run(hybrid, tmp_path / "fast")
    assert fast.losses == torch_path.losses and probes == [[], [], [], []]
    assert {"chunk_gated_delta_rule", "causal_conv1d_fn"} <= set(used)


def test_a_kernel_wrong_on_the_run_s_batch_stops_the_run_at_step_1_and_is_named(hybrid, tmp_path, monkeypatch):
    """Right on the self-test's two rows, wrong on any other batch: it passes at load, and the tripwire's probe (one
    example) disagrees with the reference; the same path with that one kernel on its torch function agrees, so it is
    named, alone of the four fast kernels (and its package)."""
    def wrap(name, fn):
        if name != "chunk_gated_delta_rule":
            return fn

        def wrong_beyond_the_self_test(q, *args, **kwargs):
            out, state = fn(q, *args, **kwargs)
            return (out if q.shape[0] == 2 else out * 1.3), state
        return wrong_beyond_the_self_test

    _loaded_with(monkeypatch, wrap)
    with pytest.raises(tripwire.TrainingPathWrong) as stop:
        _run(hybrid, tmp_path)
    msg = str(stop.value)
    assert msg.startswith("step 1: the training path check failed")
    assert ("the recurrent layers' fast kernels (chunk_gated_delta_rule (fla)) compute other values than "
            "transformers' torch functions on this run's batch (the same path with the torch functions in their "
            "place agrees with PEFT's reference): uninstall flash-linear-attention to train on transformers' torch "
            "path") in msg
    assert "probe loss" in msg  # the measured disagreement, as the probe found it
