"""The planner in the real training loop: predicted vs measured peak allocated memory across token budgets.

    python benchmarks/auto_peak.py --device cuda --model qwen2.5-1.5b-shape     # on a GPU
    python benchmarks/auto_peak.py --device cpu --model tiny                     # dry run (no peak on a CPU)

For each point (token budget x checkpointing) rocktune's own loop trains 3 steps on the bench's 50-2,000-token data
with batching=tokens; the measured figure is the largest per-step ``torch.cuda.max_memory_allocated`` (metrics.jsonl),
the prediction the planner's estimate for the same rows, length and settings. One JSON line per point.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

POINTS = [("auto", False), (8192, False), (16384, False), (16384, True), (32768, True)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="qwen2.5-1.5b-shape")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--points", type=int, default=len(POINTS), help="the first N points only (a shorter check)")
    ap.add_argument("--dry-run", action="store_true", help="1 step of 4 examples per point: the code path only")
    args = ap.parse_args(argv)

    from rocktune.bench import workload
    from rocktune.config import config_from_dict
    from rocktune.planner import RunSpec, estimate, load_shape
    from rocktune.tasks import train
    from rocktune.train.request import RunOptions

    tmp = Path(tempfile.mkdtemp(prefix="rt-auto-peak-"))
    cache = Path("/tmp/rt-suite") / args.model / "cache"  # the suite's cached model and data, when it ran first
    model_dir = workload.model_dir(args.model, cache)
    data = workload.data_file(None, 256, cache, token_range=(50, 2000))
    shape = load_shape(model_dir)
    precision = "bf16" if args.device == "cuda" else "fp32"
    for budget, ckpt in POINTS[: args.points]:
        raw = {"model": {"name_or_path": model_dir, "gradient_checkpointing": ckpt},
               "data": {"train_file": data, "eval_fraction": 0.0, "max_length": args.max_length,
                        "cache_dir": str(cache / "tokens")},
               "training": {"max_steps": 1 if args.dry_run else 3, "micro_batch_size": 2 if args.dry_run else 8,
                            "grad_accum": 2 if args.dry_run else 8, "batching": "tokens",
                            "micro_batch_tokens": budget, "precision": precision, "device": args.device,
                            "eval_every": 0, "compile": False},
               "reliability": {"save_every": 0}, "output": {"dir": str(tmp / f"{budget}-{ckpt}")}}
        point = {"model": args.model, "micro_batch_tokens": budget, "checkpointing": ckpt}
        try:
            train(config_from_dict(raw), RunOptions(overwrite=True), quiet=True)
            rows = [json.loads(x) for x in (tmp / f"{budget}-{ckpt}" / "metrics.jsonl").read_text().splitlines()]
            steps = [r for r in rows if "loss" in r]
            forward_rows = max(-(-r["batch_tokens"] // (r["forwards"] * args.max_length)) for r in steps)
            est = estimate(shape, RunSpec(micro_batch=forward_rows, seq_len=args.max_length, lora_r=16,
                                          precision=precision, checkpointing=ckpt, loss_chunk=2048, padded=True,
                                          device="gpu" if args.device == "cuda" else "cpu"))
            measured = max((r.get("peak_mem_bytes") or 0) for r in steps) or None
            point.update(rows_per_forward=forward_rows, predicted=est.peak_allocated, measured=measured,
                         error=(est.peak_allocated - measured) / measured if measured else None,
                         useful_tokens_per_s=steps[-1]["useful_tokens_per_s"],
                         terms={t.name: t.bytes for t in est.terms})
        except Exception as exc:  # noqa: BLE001 - one failing point must not hide the others
            point["error_message"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(point), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
