"""``rocktune bench --pick``: measure the rocktune candidates that run (and fit) here; write the fastest as YAML.

Candidates that fail (out of memory, a knob this machine cannot use) are reported and passed over, never guessed.
"""

from __future__ import annotations

from pathlib import Path

from rocktune.bench.configs import CONFIGS
from rocktune.errors import UserError

# Micro-batch variants first: on a GPU, a bigger micro-batch is where most throughput hides.
CANDIDATES = ["rocktune", "rt-mb4", "rt-mb8", "rt-packing", "rt-compile", "rt-no-liger"]


def candidates(device: str) -> str:
    names = [n for n in CANDIDATES if not (CONFIGS[n].needs_gpu and device == "cpu")
             and (device != "cpu" or CONFIGS[n].default_on_cpu)]
    return ",".join(names)


def fastest(report: dict) -> dict:
    ok = [r for r in report["configs"] if r["kind"] == "rocktune" and r["status"] == "ok"
          and r["useful_tokens_per_s"]]
    if not ok:
        reasons = "; ".join(f"{r['name']}: {r.get('reason')}" for r in report["configs"])
        raise UserError(f"no candidate configuration ran on this machine ({reasons})")
    return max(ok, key=lambda r: r["useful_tokens_per_s"])


def write_config(best: dict, report: dict, path: str, train_file: str | None) -> Path:
    """The winner's resolved settings, minus the bench's step count and scratch paths, as a `train -c` file."""
    import yaml

    from rocktune.config import config_from_dict, dump_config

    raw = best["resolved"]["config"]
    raw["training"].pop("max_steps", None)
    raw["training"].pop("log_every", None)
    raw["training"].pop("eval_every", None)
    raw["data"].pop("eval_fraction", None)
    raw["data"].pop("cache_dir", None)
    raw.pop("reliability", None)
    if train_file:
        raw["data"]["train_file"] = train_file
    raw["output"] = {"dir": "runs/tuned"}
    text = dump_config(config_from_dict(raw))  # validated: the file trains as written
    w = report["workload"]
    header = (f"# rocktune train -c {path}\n"
              f"# Fastest of the measured candidates on this machine: {best['name']} "
              f"({best['useful_tokens_per_s']:.0f} useful tokens/s, {best['step_s']:.2f} s/step, median of "
              f"{w['measured_steps']} steps; model {w['model']}).\n"
              "# Written by `rocktune bench --pick`; set data.train_file to your data and training.epochs or "
              "max_steps.\n")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + text, encoding="utf-8")
    yaml.safe_load(out.read_text())
    return out
