"""The vision-language task on one device: a tiny random-init Qwen2.5-VL learns the colour of a shape drawn in
generated images (rocktune.tasks.vlm.demo.vision_task), and the run's speed. Prints one JSON object.

    PYTHONPATH=src python benchmarks/vlm_learns.py [--device cpu|cuda] [--precision fp32|bf16] [--steps 300]
        [--family qwen2_5_vl|qwen3_vl|qwen2_vl]

The same model, data and settings as tests/test_vlm_train.py's learning test (256 training images, 32 held out,
micro-batch 8, lr 5e-3, LoRA r=16 on the language model only). Four colours, so chance is 25%. It reports the eval
loss first -> last, the held-out greedy accuracy (by ``generate``'s own path), the training seconds and the
loss-bearing tokens per second from the run's metrics. A speed whose loss did not fall is marked ``"valid": false``.
The GPU check runs it on the device (benchmarks/gpu_check.sh tasks).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path


def accuracy(run: Path, eval_file: Path, device: str) -> float:
    """Held-out greedy exact match through export's loader and reply, as ``rocktune generate --image`` answers."""
    from rocktune.bench.plain_loop import vlm_accuracy
    from rocktune.export.source import resolve
    from rocktune.tasks.vlm.export.vision_generate import load

    model, tok, vision = load(resolve(str(run)), device)
    return vlm_accuracy(model, tok, vision, eval_file, max_new_tokens=8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--family", default="qwen2_5_vl", choices=("qwen2_5_vl", "qwen3_vl", "qwen2_vl"))
    p.add_argument("--packing", action="store_true", help="data.packing: 2 rows of 240 tokens a step (on a GPU, "
                   "model.attn_implementation auto takes the varlen kernel where its self-test passes)")
    a = p.parse_args()

    from rocktune.config import config_from_dict
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from rocktune.tasks.vlm.demo.vision_task import write_colour_task
    from rocktune.tasks import train

    with tempfile.TemporaryDirectory(prefix="rocktune-vlm-learns-") as tmp:
        work = Path(tmp)
        model = build_tiny_vlm(work / "model", family=a.family)
        train_file, eval_file = write_colour_task(work / "data", n_train=256, n_eval=32, seed=0)
        run = work / "run"
        batch = {"micro_batch_size": 2} if a.packing else {"micro_batch_size": 8}
        cfg = {"task": "vlm", "model": {"name_or_path": str(model)}, "lora": {"r": 16, "alpha": 32},
               "data": {"train_file": str(train_file), "eval_file": str(eval_file),
                        **({"packing": True, "max_length": 240} if a.packing else {"max_length": 64})},
               "training": {"max_steps": a.steps, **batch, "grad_accum": 1, "lr": 5e-3,
                            "warmup_steps": 5, "eval_every": 0, "precision": a.precision, "device": a.device,
                            "seed": 0},
               "reliability": {"save_every": 0, "min_free_disk_mb": 0}, "output": {"dir": str(run)}}
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON alone
            train(config_from_dict(cfg), quiet=True)
        seconds = time.perf_counter() - t0
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
        steps = [r for r in rows if "loss" in r and "step" in r]
        tps = [r["useful_tokens_per_s"] for r in steps[len(steps) // 2:] if r.get("useful_tokens_per_s")]
        acc = accuracy(run, eval_file, a.device)
        notes = json.loads((run / "run_info.json").read_text()).get("notes", [])
    print(json.dumps({"device": a.device, "precision": a.precision, "family": a.family, "steps": a.steps,
                      "packing": a.packing, "attention_notes": [n for n in notes if "attention" in n.lower()],
                      "eval_loss_first": evals[0] if evals else None, "eval_loss_last": evals[-1] if evals else None,
                      "held_out_accuracy": acc, "chance": 0.25, "train_s": round(seconds, 1),
                      "useful_tokens_per_s_median_second_half": sorted(tps)[len(tps) // 2] if tps else None,
                      "valid": bool(evals) and evals[-1] < evals[0] * 0.5}))


if __name__ == "__main__":
    main()
