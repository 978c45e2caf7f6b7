"""The planner against real training steps: saved-for-backward bytes within 5%, training state exact.

The full grid (48 points, ~2.5 minutes) is ``benchmarks/planner_validation.py``; here a covering subset in which
every value of every axis (model, batch x length, rank, precision, attention, checkpointing, dropout) appears,
rocktune's GPU path (varlen attention, the lean LoRA forward) included.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "planner_validation", Path(__file__).parents[1] / "benchmarks" / "planner_validation.py")
pv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pv)

POINTS = [
    ("tiny-qwen2", 1, 128, 4, "fp32", "sdpa", False, 0.0),
    ("tiny-qwen2", 4, 64, 16, "bf16", "eager", False, 0.1),
    ("tiny-qwen2", 4, 64, 16, "fp32", "sdpa", True, 0.1),
    ("tiny-qwen2", 1, 128, 4, "bf16", "eager", True, 0.0),
    ("small-llama", 4, 64, 4, "fp32", "eager", False, 0.0),
    ("small-llama", 1, 128, 16, "bf16", "sdpa", False, 0.1),
    ("small-llama", 4, 64, 16, "bf16", "sdpa", True, 0.0),
    ("small-llama", 1, 128, 4, "fp32", "eager", True, 0.1),
    ("tiny-qwen3", 2, 64, 8, "bf16", "sdpa", False, 0.0),
    ("tiny-phi3", 2, 64, 8, "fp32", "sdpa", False, 0.0),
    ("tiny-phi3", 2, 64, 8, "bf16", "eager", True, 0.0),
    # rocktune's GPU path (torch's varlen op with a CPU kernel, the lean LoRA forward), K/V repeated or not
    ("tiny-qwen2", 4, 64, 16, "bf16", "varlen", False, 0.0),
    ("small-llama", 4, 64, 4, "fp32", "varlen-kv-copies", True, 0.0),
    ("tiny-phi3", 2, 64, 8, "bf16", "varlen", False, 0.0),
    ("tiny-qwen3", 2, 64, 8, "bf16", "varlen", False, 0.0),
    ("tiny-qwen2", 4, 64, 4, "bf16", "varlen", False, 0.1),
]


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS, ids=lambda p: "-".join(map(str, p)))
def test_saved_activations_within_5_percent(point):
    row = pv.run_point(*point)
    assert abs(row["saved_error"]) < 0.05, row
    assert row["state_exact"], row


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
@pytest.mark.parametrize("preset", ["Qwen2.5-0.5B", "Qwen2.5-1.5B"])
def test_gpu_peak_within_10_percent(preset):
    row = pv.gpu_check(preset, 1, 1024, "bf16", False)
    assert abs(row["peak_error"]) < 0.10, row


@pytest.mark.slow
def test_compiled_varlen_saved_activations_within_5_percent():
    """The decoder under torch.compile (about 2.5 minutes: Inductor's C++ backend), K/V repeated as torch 2.11's
    kernel needs them: Inductor keeps the copies, not the activation or the norms' fp32 copies."""
    row = pv.run_point(*pv.COMPILED_POINTS[1])
    assert abs(row["saved_error"]) < 0.05, row
