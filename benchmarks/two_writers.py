"""Issue 47 reproduced: a run killed mid-way, then resumed by two processes at once (a resume started while a killed
supervisor's orphaned worker still trains, or by hand while the supervisor restarts the run).

    python benchmarks/two_writers.py [--steps 40] [--kill-after 15]

Trains the demo's tiny model (``--no-supervise``, a checkpoint every step, a metrics line every 10 steps), kills it
once its checkpoint of step ``--kill-after`` appears, starts two ``--resume`` at once and waits for both. Prints one
JSON object: their exit statuses, whether one said it waited for the other (train/runlock.py), the (step, kind) of
every metrics line, the number of training-loss lines against the ``steps / 10`` an uninterrupted run logs, and
whether any line is there twice. Run it with ``PYTHONPATH`` naming another source tree to see that tree's behaviour.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-after", type=int, default=15)
    args = ap.parse_args()

    from rocktune.demo.run import MODEL_SHAPE, demo_config
    from rocktune.demo.task import make_task, write_jsonl
    from rocktune.demo.tiny import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="rocktune-two-"))
    build_tiny_model(root / "base", seed=0, **MODEL_SHAPE)
    tr, ev = make_task(n_train=400, n_eval=8, seed=0)
    write_jsonl(root / "data" / "train.jsonl", tr)
    write_jsonl(root / "data" / "eval.jsonl", ev)
    cfg = demo_config(root / "base", root / "data", root / "run", args.steps)
    cfg["training"].update(micro_batch_size=8, sample_count=0)
    cfg["reliability"] = {"save_every": 1}
    (root / "run.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "rocktune", "train", "--no-supervise", "-c", str(root / "run.yaml")]

    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = root / "run" / "checkpoints"
    while not any(int(p.name[5:]) >= args.kill_after for p in ckpts.glob("step-*")):
        if first.poll() is not None:
            raise SystemExit("the run finished before the kill; raise --steps")
        time.sleep(0.01)
    first.kill()
    first.wait()
    both = [subprocess.Popen(cmd + ["--resume"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    errs = [p.communicate()[1] for p in both]
    rows = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    lines = [(r["step"], "loss" if "loss" in r else "eval") for r in rows]
    print(json.dumps({"steps": args.steps, "killed_after_checkpoint": args.kill_after,
                      "exit_statuses": [p.returncode for p in both],
                      "one_waited_for_the_other": any("waiting for it to finish" in e for e in errs),
                      "loss_lines": sum(k == "loss" for _, k in lines), "expected_loss_lines": args.steps // 10,
                      "lines_twice": sorted(str(x) for x, n in Counter(lines).items() if n > 1), "lines": lines}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
