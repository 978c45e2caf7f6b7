"""The real training loop on a CUDA/ROCm device (``pytest -m gpu``; part a of benchmarks/gpu_check.sh): token
batching, compile, the guards and transfer checks, auto's attention choice, a forced out-of-memory split through the
fault hooks, a checkpoint, a kill and an exact resume. Skipped without a GPU: the same paths run on the CPU in
tests/test_reliability.py, tests/test_feed.py and tests/test_varlen_attention.py."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from tests.lm_runs import config, logged, run_worker

EXACT = ("step", "tokens", "batch_tokens", "samples", "lr", "epoch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_the_real_loop_on_the_gpu_splits_on_oom_and_resumes_exactly(tiny_model_dir, data, tmp_path):
    def gpu_config(name):
        return config(tiny_model_dir, data, tmp_path / name, device="cuda", precision="auto", batching="tokens",
                      compile=True, micro_batch_tokens=128)

    ref, part = gpu_config("ref"), gpu_config("part")
    assert run_worker(ref, {"oom_at_step": 3}) == 0
    assert run_worker(part, {"oom_at_step": 3, "kill_at_step": 5}) == -signal.SIGKILL  # checkpoint at step 4
    assert run_worker(part, {}, resume=True) == 0
    a, b = logged(tmp_path / "ref"), logged(tmp_path / "part")
    steps_a = [r for r in a if "loss" in r]
    steps_b = [r for r in b if "loss" in r]
    assert len(steps_a) == len(steps_b) == 8
    # the same examples, in the same forwards, at the same learning rates: the data position resumed exactly
    assert [{k: r.get(k) for k in EXACT} for r in steps_a] == [{k: r.get(k) for k in EXACT} for r in steps_b]
    # losses: bf16, and attention's backward accumulates with atomics on a GPU, so equal to rounding, not bits
    assert [r["loss"] for r in steps_b] == pytest.approx([r["loss"] for r in steps_a], rel=2e-2)
    rows = [json.loads(x) for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in rows if "loss" in r}
    assert by_step[3]["pieces"] >= 2 and by_step[1].get("compiling") is True  # the split, the compiled first step
    assert by_step[8]["peak_mem_bytes"] > 0
    notes = json.loads((tmp_path / "ref" / "run_info.json").read_text())["notes"]
    assert any(n.startswith("attention: ") for n in notes), notes
    assert (tmp_path / "part" / "adapter" / "adapter_model.safetensors").exists()
