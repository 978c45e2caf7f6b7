"""fp16 with a GradScaler — what Volta/Turing (and fp16-only AMD arches) train with — and torch.compile, trained on
the CPU: an fp16 overflow is the scaler's to skip (not the guard's), its state is checkpointed, and a killed fp16
run resumes exactly; compile runs on static-width rows and a real compiler failure falls back to eager."""

from __future__ import annotations

import json
import math
import signal

import pytest
import torch

from rocktune.config import config_from_dict
from rocktune.tasks import train
from rocktune.train.faults import Faults
from rocktune.train.request import RunOptions
from tests.lm_runs import adapter_bytes, config, logged, run_worker


def scaler_state(run, step: int) -> dict:
    state = torch.load(run / "checkpoints" / f"step-{step:07d}" / "trainer_state.pt", weights_only=True)
    return state["scaler"]


@pytest.mark.slow
def test_fp16_overflow_is_skipped_by_the_scaler_and_its_state_checkpointed(tiny_model_dir, data, tmp_path):
    clean = config(tiny_model_dir, data, tmp_path / "clean", precision="fp16", max_steps=4)
    train(config_from_dict(clean), quiet=True)
    hit = config(tiny_model_dir, data, tmp_path / "hit", precision="fp16", max_steps=4)
    result = train(config_from_dict(hit), quiet=True, faults=Faults({"overflow_at_step": 3}))
    assert all(math.isfinite(x) for x in result.losses)  # the loss stayed finite: no guard skip, no rollback
    meta = json.loads((tmp_path / "hit" / "checkpoints" / "step-0000004" / "meta.json").read_text())
    assert meta["extra"]["skipped_steps"] == 0
    want, got = scaler_state(tmp_path / "clean", 4), scaler_state(tmp_path / "hit", 4)
    assert want["scale"] > 0 and got["scale"] == pytest.approx(want["scale"] / 2)  # the overflow halved the scale
    rows = [json.loads(x) for x in (tmp_path / "hit" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert not math.isfinite(rows[2]["grad_norm"]) and all(math.isfinite(r["grad_norm"]) for r in rows[:2])


@pytest.mark.slow
def test_fp16_run_killed_mid_way_resumes_exactly(tiny_model_dir, data, tmp_path):
    straight = config(tiny_model_dir, data, tmp_path / "straight", precision="fp16", max_steps=4)
    train(config_from_dict(straight), quiet=True)
    cfg = config(tiny_model_dir, data, tmp_path / "killed", precision="fp16", max_steps=4)
    assert run_worker(cfg, {"kill_at_step": 3}) == -signal.SIGKILL
    train(config_from_dict(cfg), RunOptions(resume=True), quiet=True)
    assert logged(tmp_path / "killed") == logged(tmp_path / "straight")
    assert adapter_bytes(tmp_path / "killed") == adapter_bytes(tmp_path / "straight")
    assert scaler_state(tmp_path / "killed", 4)["scale"] == scaler_state(tmp_path / "straight", 4)["scale"]


def _compiled_run(tiny_model_dir, data, out, **training) -> dict:
    cfg = config(tiny_model_dir, data, out, max_steps=3, batching="tokens", micro_batch_tokens=256, **training)
    cfg["lora"]["dropout"] = 0.0
    return cfg


@pytest.mark.long
@pytest.mark.slow
def test_compile_on_the_cpu_with_static_width_rows_and_a_real_compiler_failure_falling_back(
        tiny_model_dir, data, tmp_path, capsys):
    """compile=true: the decoder is compiled (rows padded to max_length, so one shape) and trains to eager's losses;
    with the C++ compiler Inductor calls made to fail, the real error falls back to eager and the run finishes."""
    pytest.importorskip("torch._inductor")
    eager = train(config_from_dict(_compiled_run(tiny_model_dir, data, tmp_path / "eager", compile=False)),
                  quiet=True)
    compiled = train(config_from_dict(_compiled_run(tiny_model_dir, data, tmp_path / "compiled", compile=True)),
                     quiet=True)
    rows = [json.loads(x) for x in (tmp_path / "compiled" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert [r["compiling"] for r in rows] == [True, False, False]
    assert all(r["batch_tokens"] % 64 == 0 for r in rows)  # static width: every row padded to max_length (64)
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-4)

    import torch._inductor.config as inductor

    torch._dynamo.reset()
    # inductor.patch, not monkeypatch: monkeypatch's undo leaves the config option missing for later compiles.
    with inductor.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        fell_back = train(config_from_dict(_compiled_run(tiny_model_dir, data, tmp_path / "broken", compile=True)))
    err = capsys.readouterr().err
    assert "torch.compile failed" in err and "continuing without it" in err
    assert fell_back.losses == pytest.approx(eager.losses, rel=1e-4)
