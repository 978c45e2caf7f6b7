"""task=vlm fed as examples or as tokens (training.batching), on the machine at hand: the tiny Qwen2.5-VL on the
colour task, data.max_length 240, micro-batch 8 x 2 (16 conversations a step), 20 steps, one run per setting. Per
setting: forwards a step, the padding share of the forwards' tokens, the mean step time (the first step left out),
the last loss. The tiny model says nothing about a real one's speed on a GPU; it shows what the feed does.

    OMP_NUM_THREADS=1 PYTHONPATH=src:. python benchmarks/vlm_batching.py [--steps 20] [--n-train 320]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--n-train", type=int, default=320)
    args = ap.parse_args()
    from rocktune.config import config_from_dict
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from rocktune.tasks.vlm.demo.vision_task import write_colour_task
    from rocktune.tasks import train
    from tests.test_vlm_train import vlm_config

    with tempfile.TemporaryDirectory(prefix="vlm-batching-") as tmp:
        root = Path(tmp)
        model = build_tiny_vlm(root / "model")
        data = write_colour_task(root / "colours", n_train=args.n_train, n_eval=16, seed=0)
        # examples; tokens at the CPU's auto (2 rows of 240 a forward); tokens at 8 rows (the whole step at once)
        for name, batching, extra in (("examples", "examples", {}), ("tokens", "tokens", {}),
                                      ("tokens 8 rows", "tokens", {"micro_batch_tokens": 8 * 240})):
            out = root / name.replace(" ", "-")
            cfg = vlm_config(model, data, out, max_steps=args.steps, micro_batch_size=8, grad_accum=2,
                             batching=batching, **extra)
            cfg["data"]["max_length"] = 240
            result = train(config_from_dict(cfg), quiet=True)
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            steps = [r for r in rows if "loss" in r][1:]
            real, tokens = sum(r["real_tokens"] for r in steps), sum(r["batch_tokens"] for r in steps)
            print(json.dumps({"setting": name, "forwards_per_step": sum(r["forwards"] for r in steps) / len(steps),
                              "padding": round(1 - real / tokens, 4),
                              "step_s": round(sum(r["step_s"] for r in steps) / len(steps), 4),
                              "last_loss": round(result.losses[-1], 4)}), flush=True)


if __name__ == "__main__":
    main()
