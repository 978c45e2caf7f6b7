"""CPU milliseconds of one training-path tripwire check (train/tripwire.py ``Tripwire.check_path``: the probe piece
through the run's path and PEFT's reference, forward and backward each) on the GRPO bench's tiny model as a run
builds it (Qwen2 hidden 128, 2 layers, LoRA r=16 on the fused side path, fp32), between a 32-row GRPO step's
backward and its update, as the loop calls it (GRPO's probe: two completions of one prompt, the shared-prompt
forward). Prints one JSON object: the check's median and quartiles over
``--reps`` calls (``time.thread_time``), beside the step's own forward and backward for scale.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/tripwire_probe.py [--reps 60]

The probe's forward and backward are the run's own, so most of the check is the two passes of one row through the
model; the rest (tripwire.py, lora/check.py) is what this measures when that code changes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROWS, WIDTH, PROMPT, GROUP = 32, 44, 12, 8


def grpo_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A step's rows as GRPO's feed collates them: 4 prompts of 12 tokens, 8 completions of 32 each."""
    from rocktune.tasks.grpo.feed import collate

    prompts = [tuple(torch.randint(0, 200, (PROMPT,), generator=gen).tolist()) for _ in range(ROWS // GROUP)]
    rows = [p for p in prompts for _ in range(GROUP)]
    completions = [torch.randint(0, 200, (WIDTH - PROMPT,), generator=gen).tolist() for _ in rows]
    return collate(rows, completions, torch.randn(ROWS, generator=gen).tolist(), [1.0] * ROWS, 0)


def main() -> None:
    from grpo_update_compile import build  # the bench's tiny model as a run builds it

    from rocktune.tasks.grpo.feed import RolloutFeed, StepShape
    from rocktune.tasks.grpo.loss import GRPOLoss, Objective
    from rocktune.train import build as train_build
    from rocktune.train.tripwire import Tripwire

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build(Path(tempfile.mkdtemp()))
    loss = GRPOLoss(model, Objective(), share_prompt=True)  # as a run's: grpo.share_prompt
    feed = RolloutFeed(ROWS // GROUP, StepShape(ROWS // GROUP, GROUP, ROWS, "dapo", WIDTH - PROMPT, "group", 0, 0),
                       rollout=None)  # only its probe_piece is asked for
    wire = Tripwire(model, loss, "cpu", train_build.autocast("cpu", "fp32"), "fp32", "adamw", lambda: feed)
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
