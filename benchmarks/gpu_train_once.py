"""The first run of tests/test_gpu_train.py alone, with the worker's log and metrics kept: the real train() on the
device with token batching, compile and a forced out-of-memory split at step 3, 8 steps of the tiny Qwen2.

    python benchmarks/gpu_train_once.py --device cuda --out /tmp/rt-train-once      # on a GPU
    python benchmarks/gpu_train_once.py --device cpu --out /tmp/rt-train-once       # the same on a CPU

pytest captures a worker's output; where the test runs out of its time on a device this says which step took how
long (``<out>/metrics.jsonl``: step_s, compiling, pieces) and what the worker logged (``<out>/worker.log``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="/tmp/rt-train-once")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds the worker may take")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # the tests' helpers build the run exactly as the test does

    from rocktune.demo.task import make_task
    from rocktune.demo.tiny import build_tiny_model
    from rocktune.train.request import RunOptions, RunRequest
    from tests.conftest import TINY_SHAPE, write_jsonl
    from tests.lm_runs import config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(out / "model", seed=0, **TINY_SHAPE)
    train, evals = make_task(n_train=200, n_eval=16, seed=2)
    data = (write_jsonl(out / "train.jsonl", train), write_jsonl(out / "eval.jsonl", evals))
    cfg = config(model, data, out / "run", device=args.device, precision="auto", batching="tokens", compile=True,
                 micro_batch_tokens=128)
    request = RunRequest(cfg, RunOptions(overwrite=True))
    env = dict(os.environ, ROCKTUNE_FAULTS=json.dumps({"oom_at_step": 3}))
    start = time.perf_counter()
    with open(out / "worker.log", "w") as log:
        try:
            rc = subprocess.run([sys.executable, "-m", "rocktune.process.worker", request.to_json()], env=env,
                                stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    metrics = out / "run" / "metrics.jsonl"
    steps = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    print(json.dumps({"device": args.device, "exit": rc, "wall_s": round(time.perf_counter() - start, 1),
                      "steps": [{k: r.get(k) for k in ("step", "step_s", "compiling", "pieces", "loss")}
                                for r in steps if "loss" in r]}, indent=1))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
