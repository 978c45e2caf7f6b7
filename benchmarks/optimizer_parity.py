"""The demo's learning curve with every optimizer the config accepts, on the fused LoRA path: eval loss at steps 0,
20 and 40 of the demo's model and data (issue 43: fused AdamW once left the fused path with the first step's
adapter, 5.99 -> 4.06 -> 4.14 where foreach gave 5.99 -> 3.02 -> 2.22). Prints JSON.

    PYTHONPATH=src python benchmarks/optimizer_parity.py [--steps 40] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import typing
from pathlib import Path


def optimizers() -> list[str]:
    from rocktune.config import TrainingConfig

    return sorted(set(typing.get_args(TrainingConfig.model_fields["optimizer"].annotation)) - {"auto"})


def curves(out: Path, steps: int = 40, every: int = 20) -> dict[str, list[float]]:
    """Eval losses (step 0, every ``every``, the end) per optimizer, from one demo model and data set."""
    from rocktune.config import config_from_dict
    from rocktune.demo.run import DEMO_SKILLS, MODEL_SHAPE, demo_config
    from rocktune.demo.task import make_task, write_jsonl
    from rocktune.demo.tiny import build_tiny_model
    from rocktune.tasks import train

    build_tiny_model(out / "base", seed=0, **MODEL_SHAPE)
    train_rows, eval_rows = make_task(n_train=4000, n_eval=100, seed=0, skills=DEMO_SKILLS)
    write_jsonl(out / "data" / "train.jsonl", train_rows)
    write_jsonl(out / "data" / "eval.jsonl", eval_rows)
    found = {}
    for opt in optimizers():
        cfg = demo_config(out / "base", out / "data", out / opt, steps)
        cfg["training"].update(optimizer=opt, eval_every=every, sample_count=0)
        result = train(config_from_dict(cfg), quiet=True)
        rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        found[opt] = [r["eval_loss"] for r in rows if "eval_loss" in r]
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", help="work directory (default: a temporary one)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        got = curves(Path(args.out or tmp), args.steps)
    import torch

    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                      "load_average": list(os.getloadavg()), "steps": args.steps, "eval_loss": got,
                      "seconds": round(time.perf_counter() - t0, 1)}, indent=1))


if __name__ == "__main__":
    main()
