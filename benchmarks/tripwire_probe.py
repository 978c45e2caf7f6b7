"""CPU milliseconds of one training-path tripwire check (train/tripwire.py ``Tripwire.check_path``: the probe piece
through the run's path and PEFT's reference, forward and backward each) on the GRPO bench's tiny model as a run
builds it (Qwen2 hidden 128, 2 layers, LoRA r=16 on the fused side path, fp32), between a 32-row GRPO-shaped step's
backward and its update, as the loop calls it. Prints one JSON object: the check's median and quartiles over
``--reps`` calls (``time.thread_time``), beside the step's own forward and backward for scale.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/tripwire_probe.py [--reps 60]

The probe's forward and backward are the run's own, so most of the check is the two passes of one row through the
model; the rest (tripwire.py, lora_check.py) is what this measures when that code changes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROWS, WIDTH, PROMPT = 32, 44, 12


def build(work: Path):
    from rocktune.config import config_from_dict
    from rocktune.demo.tiny import build_tiny_model
    from rocktune.tasks.lm import build as lm_build

    path = build_tiny_model(work / "model", seed=0, hidden=128, layers=2, heads=4, kv_heads=2)
    cfg = config_from_dict({"task": "grpo", "model": {"name_or_path": str(path)}, "lora": {"r": 16, "alpha": 32},
                            "data": {"train_file": "unused.jsonl"}, "output": {"dir": str(work / "out")}})
    torch.manual_seed(0)
    model, _ = lm_build.model_with_adapter(cfg.model, cfg.lora, "fp32", "sdpa", "cpu", False)
    return model.train()


def grpo_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 200, (ROWS, WIDTH), generator=gen)
    completion = torch.zeros(ROWS, WIDTH, dtype=torch.long)
    completion[:, PROMPT:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion,
            "advantage": torch.randn(ROWS, generator=gen), "weight": torch.ones(ROWS)}


def main() -> None:
    from rocktune.tasks.grpo.loss import GRPOLoss, Objective
    from rocktune.train import build as train_build
    from rocktune.train.step import split_by_rows
    from rocktune.train.tripwire import Tripwire

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build(Path(tempfile.mkdtemp()))
    loss = GRPOLoss(model, Objective())
    wire = Tripwire(model, loss, "cpu", train_build.autocast("cpu", "fp32"), "fp32", "adamw", split_by_rows,
                    lambda b: b["input_ids"].shape[0])
    batch = grpo_batch(torch.Generator().manual_seed(1))
    t0 = time.thread_time()
    (loss(batch) / ROWS).backward()  # the step's gradients, which the check sets aside and puts back
    step_s = time.thread_time() - t0
    held = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    seconds = []
    for _ in range(args.reps):
        t0 = time.thread_time()
        wire.check_path(1, batch, print)
        seconds.append(time.thread_time() - t0)
    kept = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(held, kept)) and len(held) == len(kept)
    q1, median, q3 = statistics.quantiles(seconds, n=4)
    print(json.dumps({"check_ms_median": round(1e3 * median, 2), "check_ms_q1": round(1e3 * q1, 2),
                      "check_ms_q3": round(1e3 * q3, 2), "reps": args.reps,
                      "step_forward_backward_ms": round(1e3 * step_s, 1), "batch": [ROWS, WIDTH],
                      "torch": torch.__version__, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
