"""The LM run the fault-injection tests share: the demo task's data on the tiny Qwen2, 8 steps, a checkpoint every
2 steps, dropout on (resume must restore its RNG exactly). The fixtures ``data`` and ``reference`` are in conftest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rocktune.train.request import RunOptions, RunRequest
from tests.conftest import tiny_run_config

STEPS = 8
DETERMINISTIC = ("step", "loss", "lr", "grad_norm", "tokens", "batch_tokens", "samples", "eval_loss", "epoch")


def config(tiny_model_dir, data, out: Path, **training) -> dict:
    cfg = tiny_run_config(tiny_model_dir, data[0], data[1], out, **{"max_steps": STEPS, **training})
    cfg["lora"]["dropout"] = 0.1  # dropout draws from the RNG: resume must restore it exactly
    cfg["reliability"] = {"save_every": 2, "keep_checkpoints": 2, "min_free_disk_mb": 0}
    return cfg


def logged(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k in DETERMINISTIC} for r in rows]


def adapter_bytes(run_dir: Path) -> bytes:
    return (run_dir / "adapter" / "adapter_model.safetensors").read_bytes()


def run_worker(cfg: dict, faults: dict | None, resume: bool = False, overwrite: bool = True) -> int:
    request = RunRequest(cfg, RunOptions(overwrite=overwrite, resume=resume))
    env = dict(os.environ, ROCKTUNE_FAULTS=json.dumps(faults or {}))
    return subprocess.run([sys.executable, "-m", "rocktune.process.worker", request.to_json()], env=env,
                          capture_output=True, text=True).returncode
