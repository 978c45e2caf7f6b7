"""Kill -9 a training run at random moments, resume it each time, and compare with a run never interrupted.

    python benchmarks/kill_resume_trials.py --trials 5 --steps 60 [--seed 0]

Prints one JSON object: per trial the kill times, the steps reached at each kill, where the kill landed (inside
which write, as the run directory shows it right after the kill, or outside every write), and whether the final
adapter bytes and the logged losses equal the uninterrupted reference; then how many kills landed inside a write,
by phase. Uses the demo's tiny model and task, on CPU. Kills aimed at each phase are tests/test_kill_phases.py's.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
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
                kills.append({"after_s": round(delay, 2), "last_logged_step": _last_step(root / f"trial{i}"),
                              "inside_write": write_in_progress(root / f"trial{i}")})
                resume = ["--resume"]
        done = subprocess.run(cmd + [str(cfg)] + resume, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"trial {i}: the final resume failed:\n{done.stderr}")
        got = _outcome(root / f"trial{i}")
        trials.append({"trial": i, "kills": kills, "adapter_bytes_equal": got["adapter"] == reference["adapter"],
                       "losses_equal": got["losses"] == reference["losses"]})
    landed = [k["inside_write"] for t in trials for k in t["kills"]]
    report = {"steps": args.steps, "reference_seconds": round(ref_seconds, 1), "trials": trials,
              "kills": len(landed), "kills_inside_a_write": sum(x is not None for x in landed),
              "inside_write_by_phase": dict(Counter(x for x in landed if x is not None)),
              "all_identical": all(t["adapter_bytes_equal"] and t["losses_equal"] for t in trials)}
    print(json.dumps(report, indent=1))
    return 0 if report["all_identical"] else 1


def write_in_progress(run: Path) -> str | None:
    """Which write a kill cut short, read off what it left (None: the kill landed between writes). The names are
    those of rocktune.atomic.PHASES, the phase that had last completed."""
    from rocktune.atomic import leftovers
    from rocktune.train import checkpoint

    ckpts = run / "checkpoints"
    for tmp in sorted(ckpts.glob(".tmp-step-*")):
        names = {p.name for p in tmp.iterdir()}
        for name, phase in ((checkpoint.MANIFEST, "checkpoint.before_fsync"),
                            ("meta.json", "checkpoint.before_manifest"), (checkpoint.STATE, "checkpoint.state_written"),
                            ("adapter_model.safetensors", "checkpoint.adapter_written")):
            if name in names:
                return phase
        return "checkpoint.adapter_being_written"  # inside save_pretrained: not one of the kill points
    steps = sorted(p for p in ckpts.glob("step-*") if p.is_dir())
    if any(not (p / checkpoint.MANIFEST).exists() for p in steps):
        return "checkpoint.pruning"
    latest = ckpts / checkpoint.LATEST
    if steps and latest.is_file() and latest.read_text().strip() != steps[-1].name:
        return "checkpoint.renamed"
    for target in (latest, run / "config.yaml", run / "run_info.json", run / "metrics.jsonl"):
        if leftovers(target):
            return f"atomic.written ({target.name})"
    if (run / "adapter.tmp").exists():  # its README.md is the last file written into it
        return "adapter.staged" if (run / "adapter.tmp" / "README.md").exists() else "adapter.weights_written"
    if (run / "adapter.old").exists():
        return "adapter.swapped"
    return None


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
