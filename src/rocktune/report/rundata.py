"""Read a run directory as the report needs it; nothing here imports the training code.

Sources: ``metrics.jsonl`` (step lines and eval lines), ``config.yaml``, ``run_info.json`` (platform, advice,
planner's prediction, data statistics), ``samples.jsonl``, ``incidents.jsonl`` (the supervisor's restarts) and the
checkpoint directories. A resumed run's ``metrics.jsonl`` is already one clean series: resume truncates it to the
checkpoint's line count before it appends.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from rocktune.errors import UserError
from rocktune.readers.json_file import JsonProblem, parse_json, read_json
from rocktune.readers.yaml_file import read_yaml

# the run directory's files are written by rocktune; one that does not read was damaged or replaced
DAMAGED = "the run directory is damaged: restore the file from a copy, or delete it to report without it."

CHECKPOINT = re.compile(r"step-(\d+)$")


@dataclass
class RunData:
    path: Path
    name: str
    steps: list[dict]  # lines with a training loss
    evals: list[dict]  # lines with eval_loss
    config: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)
    incidents: list[dict] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)

    def series(self, key: str, scale: float = 1.0, skip_compiling: bool = False) -> tuple[list[int], list[float]]:
        rows = [r for r in self.steps if _finite(r.get(key)) and not (skip_compiling and r.get("compiling"))]
        return [r["step"] for r in rows], [r[key] * scale for r in rows]

    def skipped_steps(self) -> list[int]:
        """Steps whose update was skipped: a non-finite loss or gradient norm was logged."""
        return [r["step"] for r in self.steps if not (_finite(r.get("loss")) and _finite(r.get("grad_norm", 0.0)))]

    def oom_splits(self) -> list[tuple[int, int]]:
        """``(step, pieces)`` where a micro-batch began to be split after running out of memory."""
        out, last = [], 1
        for r in self.steps:
            if r.get("pieces", 1) > last:
                out.append((r["step"], r["pieces"]))
            last = max(last, r.get("pieces", 1))
        return out

    def incident_steps(self) -> list[tuple[int, str]]:
        return [(int(i.get("last_logged_step", 0)), str(i.get("cause", "?"))) for i in self.incidents]

    def sample_steps(self) -> list[int]:
        return sorted({s["step"] for s in self.samples})

    def predicted_peak(self) -> int | None:
        return self.info.get("predicted_peak_bytes")


def load_run(path: str | Path) -> RunData:
    run = Path(path)
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{run} is not a rocktune run directory (no metrics.jsonl); pass the output.dir of a run "
                        "that rocktune train has started.")
    rows = _jsonl(metrics)
    config = read_yaml(run / "config.yaml", DAMAGED)[0] if (run / "config.yaml").is_file() else {}
    info = read_json(run / "run_info.json", DAMAGED) if (run / "run_info.json").is_file() else {}
    ckpts = sorted(int(m.group(1)) for p in (run / "checkpoints").glob("step-*") if (m := CHECKPOINT.match(p.name)))
    return RunData(path=run, name=run.name if run.name != "run" else f"{run.parent.name}/{run.name}",
                   steps=[r for r in rows if "loss" in r], evals=[r for r in rows if "eval_loss" in r],
                   config=config or {}, info=info, samples=_jsonl(run / "samples.jsonl"),
                   incidents=_jsonl(run / "incidents.jsonl"), checkpoints=ckpts)


def _jsonl(path: Path) -> list[dict]:
    """Every complete line; a last line cut short by a crash is left out, as resume leaves it out."""
    if not path.is_file():
        return []
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        try:
            rec = parse_json(line)
        except JsonProblem as exc:
            if exc.malformed:
                continue
            raise UserError(f"{path}:{lineno}: {exc}; the run directory is damaged: remove that line, or restore "
                            "the file from a copy.") from None
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
