"""Kill -9 a training run at random moments, resume it each time, and compare with a run never interrupted.

    python benchmarks/kill_resume_trials.py --trials 5 --steps 60 [--seed 0]

Prints one JSON object: per trial the kill times, the steps reached at each kill, and whether the final adapter
bytes and the logged losses equal the uninterrupted reference. Uses the demo's tiny model and task, on CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-kills", type=int, default=3, help="kills per trial before letting it finish")
    args = ap.parse_args()

    from rocktune.demo.run import MODEL_SHAPE, demo_config
    from rocktune.demo.task import make_task, write_jsonl
    from rocktune.demo.tiny import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="rocktune-kill-"))
    base = build_tiny_model(root / "base_model", seed=0, **MODEL_SHAPE)
    tr, ev = make_task(n_train=2000, n_eval=50, seed=0)
    write_jsonl(root / "data" / "train.jsonl", tr)
    write_jsonl(root / "data" / "eval.jsonl", ev)

    def config_for(name: str) -> Path:
        cfg = demo_config(base, root / "data", root / name, args.steps)
        cfg["lora"]["dropout"] = 0.05
        cfg["reliability"] = {"save_every": 5, "keep_checkpoints": 2}
        path = root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    cmd = [sys.executable, "-m", "rocktune", "train", "--no-supervise", "-c"]
    t0 = time.perf_counter()
    subprocess.run(cmd + [str(config_for("reference"))], check=True, capture_output=True)
    ref_seconds = time.perf_counter() - t0
    reference = _outcome(root / "reference")

    rng = random.Random(args.seed)
    trials = []
    for i in range(args.trials):
        cfg = config_for(f"trial{i}")
        kills = []
        resume: list[str] = []
        for _ in range(args.max_kills):
            delay = rng.uniform(2.0, ref_seconds)
            proc = subprocess.Popen(cmd + [str(cfg)] + resume, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                proc.wait(timeout=delay)
                break  # finished before the kill
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                kills.append({"after_s": round(delay, 2), "last_logged_step": _last_step(root / f"trial{i}")})
                resume = ["--resume"]
        done = subprocess.run(cmd + [str(cfg)] + resume, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"trial {i}: the final resume failed:\n{done.stderr}")
        got = _outcome(root / f"trial{i}")
        trials.append({"trial": i, "kills": kills, "adapter_bytes_equal": got["adapter"] == reference["adapter"],
                       "losses_equal": got["losses"] == reference["losses"]})
    report = {"steps": args.steps, "reference_seconds": round(ref_seconds, 1), "trials": trials,
              "all_identical": all(t["adapter_bytes_equal"] and t["losses_equal"] for t in trials)}
    print(json.dumps(report, indent=1))
    return 0 if report["all_identical"] else 1


def _outcome(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {"adapter": (run / "adapter" / "adapter_model.safetensors").read_bytes(),
            "losses": [(r["step"], r.get("loss"), r.get("eval_loss")) for r in rows]}


def _last_step(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    steps = []
    for line in metrics.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass
    return max(steps, default=0)


if __name__ == "__main__":
    raise SystemExit(main())
