"""What compiling the decoder would do to GRPO's update on the CPU: the policy's per-token log-probabilities
(tasks/grpo/loss.py, the bench's tiny model as a run builds it, LoRA r=16 on the fused side path), backward and
AdamW, on 32 rows of varying width (40-44 tokens, 12 of prompt: the completion lengths vary per step), eager or
with the decoder compiled. Prints one JSON object: the first steps' and the last ten steps' CPU seconds
(``time.thread_time``; the first step of a compiled mode holds its compile, a new width may recompile).

    PYTHONPATH=src python benchmarks/grpo_update_compile.py --mode eager|dynamic|cpp|static [--steps 20]

Modes: ``eager`` (what rocktune runs), ``dynamic`` (``compile(dynamic=True)``: one graph for every width),
``cpp`` (the same with Inductor's C++ wrapper, as the compiled rollout), ``static`` (torch's default: a graph per
width until it turns dynamic). One mode per process, so that no compile cache of another mode is in memory; run the
modes alternately to see the machine's noise.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

WIDTHS = (44, 43, 44, 40, 44, 41, 44, 44, 42, 44)
ROWS, PROMPT = 32, 12
COMPILE = {"dynamic": {"dynamic": True}, "cpp": {"dynamic": True, "options": {"cpp_wrapper": True}},
           "static": {"dynamic": False}}


def build(work: Path):
    from rocktune.config import config_from_dict
    from rocktune.demo.tiny import build_tiny_model
    from rocktune.tasks.causal import build as lm_build

    path = build_tiny_model(work / "model", seed=0, hidden=128, layers=2, heads=4, kv_heads=2)
    cfg = config_from_dict({"task": "grpo", "model": {"name_or_path": str(path)}, "lora": {"r": 16, "alpha": 32},
                            "data": {"train_file": "unused.jsonl"}, "output": {"dir": str(work / "out")}})
    torch.manual_seed(0)
    model, _ = lm_build.model_with_adapter(cfg.model, cfg.lora, "fp32", "sdpa", "cpu", False)
    return model.train()


def batch(width: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 200, (ROWS, width), generator=gen)
    completion = torch.zeros(ROWS, width, dtype=torch.long)
    completion[:, PROMPT:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion,
            "advantage": torch.randn(ROWS, generator=gen), "weight": torch.ones(ROWS)}


def main() -> None:
    from rocktune.tasks.grpo.loss import GRPOLoss, Objective

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("eager", *COMPILE), default="eager")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build(Path(tempfile.mkdtemp()))
    if args.mode != "eager":
        model.get_base_model().get_decoder().compile(**COMPILE[args.mode])
    loss = GRPOLoss(model, Objective())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    gen, seconds = torch.Generator().manual_seed(1), []
    for step in range(args.steps):
        b = batch(WIDTHS[step % len(WIDTHS)], gen)
        t0 = time.thread_time()
        loss(b).backward()
        opt.step()
        opt.zero_grad()
        seconds.append(time.thread_time() - t0)
    last = seconds[-10:]
    print(json.dumps({"mode": args.mode, "first_s": [round(s, 4) for s in seconds[:4]],
                      "last10_mean_s": round(sum(last) / len(last), 5),
                      "last10_median_s": round(sorted(last)[len(last) // 2], 5)}))


if __name__ == "__main__":
    main()
