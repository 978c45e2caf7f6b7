"""Does the default batch order learn as well as a plain shuffled loop? A task where an example's length gives its
answer away: which shape (circle, square, triangle, cross; one colour) is drawn on a grey 56x56 image, the tiny
Qwen2.5-VL, LoRA r 16, lr 5e-3, micro-batch 8, the project's colour-test settings. Held-out accuracy (balanced,
chance 0.25) by greedy exact match, for rocktune at its default batch order, rocktune at each ``data.batch_order``
named, and a plain transformers + PEFT loop with shuffled micro-batches (bench/plain_loop.py). Prints one JSON object.

    PYTHONPATH=src python benchmarks/batch_order.py [--steps 600] [--seeds 0 1 2] [--orders default sorted]
        [--n-train 1000] [--n-eval 200]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path


def score(model, tokenizer, vision, eval_file: Path) -> float:
    """Greedy exact match on the held-out rows, through the same reply path for every side."""
    from rocktune.bench.plain_loop import vlm_accuracy

    return vlm_accuracy(model, tokenizer, vision, eval_file)


def rocktune_run(model_dir: Path, data: tuple[Path, Path], run: Path, seed: int, steps: int, order: str) -> float:
    from rocktune.config import config_from_dict
    from rocktune.export.source import resolve
    from rocktune.tasks.vlm.export.vision_generate import load
    from rocktune.tasks import train

    data_section = {"train_file": str(data[0]), "eval_fraction": 0.0, "max_length": 64}
    if order != "default":
        data_section["batch_order"] = order
    cfg = {"task": "vlm", "model": {"name_or_path": str(model_dir)}, "lora": {"r": 16, "alpha": 32},
           "data": data_section,
           "training": {"max_steps": steps, "micro_batch_size": 8, "grad_accum": 1, "lr": 5e-3, "warmup_steps": 5,
                        "eval_every": 0, "precision": "fp32", "device": "cpu", "seed": seed},
           "reliability": {"save_every": 0, "min_free_disk_mb": 0}, "output": {"dir": str(run)}}
    with contextlib.redirect_stdout(sys.stderr):
        train(config_from_dict(cfg), quiet=True)
    model, tok, vision = load(resolve(str(run)), "cpu")
    return score(model, tok, vision, data[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--orders", nargs="+", default=["default"], help="rocktune's data.batch_order values to run")
    p.add_argument("--no-plain", action="store_true", help="skip the plain loop")
    p.add_argument("--n-train", type=int, default=1000)
    p.add_argument("--n-eval", type=int, default=200)
    a = p.parse_args()

    from rocktune.bench.plain_loop import PlainSettings, plain_vlm
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from rocktune.tasks.vlm.demo.vision_task import write_shape_task

    results: dict[str, list] = {}
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="rocktune-batch-order-") as tmp:
        work = Path(tmp)
        model_dir = build_tiny_vlm(work / "model")
        data = write_shape_task(work / "data", a.n_train, a.n_eval, seed=0)
        for seed in a.seeds:
            for order in a.orders:
                t0 = time.perf_counter()
                acc = rocktune_run(model_dir, data, work / f"run-{order}-{seed}", seed, a.steps, order)
                results.setdefault(f"rocktune:{order}", []).append(acc)
                seconds[f"rocktune:{order}"] = seconds.get(f"rocktune:{order}", 0) + time.perf_counter() - t0
                print(f"seed {seed} rocktune:{order} {acc:.3f}", file=sys.stderr, flush=True)
            if not a.no_plain:
                t0 = time.perf_counter()
                model, tok, vision, _ = plain_vlm(model_dir, data[0], PlainSettings(steps=a.steps, seed=seed))
                acc = score(model, tok, vision, data[1])
                results.setdefault("plain-shuffled", []).append(acc)
                seconds["plain-shuffled"] = seconds.get("plain-shuffled", 0) + time.perf_counter() - t0
                print(f"seed {seed} plain-shuffled {acc:.3f}", file=sys.stderr, flush=True)
    print(json.dumps({"task": "which shape (4 classes, chance 0.25)", "steps": a.steps, "seeds": a.seeds,
                      "n_train": a.n_train, "n_eval": a.n_eval, "held_out_accuracy": results,
                      "mean": {k: round(sum(v) / len(v), 3) for k, v in results.items()},
                      "seconds": {k: round(v, 1) for k, v in seconds.items()}}))


if __name__ == "__main__":
    main()
