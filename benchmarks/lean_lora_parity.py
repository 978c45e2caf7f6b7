"""The lean LoRA side path against PEFT's own forward over a real CPU run (docs/speed.md section 6).

    python benchmarks/lean_lora_parity.py --steps 50

Trains the tiny random Qwen2 of the test suite on the demo task's 256 examples (fp32, CPU, 8 x 2 per step) twice,
once with PEFT's forward and once with rocktune's lean one, and prints the largest relative loss difference per step.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)

    from rocktune.config import config_from_dict
    from rocktune.demo.task import make_task
    from rocktune.demo.tiny import build_tiny_model
    from rocktune.lean_lora import lean_lora
    from rocktune.tasks import train
    from rocktune.tasks.lm import build

    tmp = Path(tempfile.mkdtemp(prefix="rt-lean-"))
    model_dir = build_tiny_model(tmp / "model", seed=0, hidden=64, layers=2, heads=4, kv_heads=2)
    train_file = tmp / "train.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in make_task(n_train=256, n_eval=16, seed=1)[0]))
    losses = {}
    for mode, patch in (("peft", lambda model: None), ("lean", lean_lora)):
        build.lean_lora = patch  # the one switch: model_with_adapter calls it after PEFT wraps the base
        raw = {"model": {"name_or_path": str(model_dir)}, "lora": {"r": 8, "alpha": 16},
               "data": {"train_file": str(train_file), "eval_fraction": 0.0, "max_length": 64,
                        "cache_dir": str(tmp / "cache")},
               "training": {"max_steps": args.steps, "micro_batch_size": 8, "grad_accum": 2, "lr": 3e-3,
                            "warmup_steps": 5, "eval_every": 0, "precision": "fp32", "device": "cpu", "seed": 0},
               "output": {"dir": str(tmp / mode)}}
        losses[mode] = train(config_from_dict(raw), quiet=True).losses
    rel = max(abs(a - b) / abs(a) for a, b in zip(losses["peft"], losses["lean"]))
    print(json.dumps({"steps": len(losses["lean"]), "max_rel_diff": rel, "final_peft": losses["peft"][-1],
                      "final_lean": losses["lean"][-1]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
