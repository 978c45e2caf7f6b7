"""Read a run directory as the report needs it; nothing here imports the training code.

Sources: ``metrics.jsonl`` (step lines and eval lines), ``config.yaml``, ``run_info.json`` (platform, advice,
planner's prediction, data statistics), ``samples.jsonl``, ``incidents.jsonl`` (the supervisor's restarts) and the
checkpoint directories. A resumed run's ``metrics.jsonl`` is already one clean series: resume truncates it to the
checkpoint's line count before it appends. A log of an older version may hold a step range twice (two processes
appended at once): each repeated line is left out, and said, like a damaged one.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from rocktune.errors import UserError
from rocktune.readers import metrics_log
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
    eval_stats: list[dict] = field(default_factory=list)  # other eval lines (a preference run's eval_rewards/...)
    config: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)
    incidents: list[dict] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    skipped_lines: list[tuple[str, int, str]] = field(default_factory=list)  # (file, line, why) of each left out
    warnings: list[dict] = field(default_factory=list)  # {"step", "warnings": [text]} lines (GRPO's rollout watch)

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
    if not run.exists():
        raise UserError(f"{run} does not exist; pass the output.dir of a run that rocktune train has started.")
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{run} is not a rocktune run directory (no metrics.jsonl); pass the output.dir of a run "
                        "that rocktune train has started.")
    skipped: list[tuple[str, int, str]] = []
    rows = _unique(_jsonl(metrics, skipped, _metrics_problem, numbered=True), metrics, skipped)
    config = read_yaml(run / "config.yaml", DAMAGED)[0] if (run / "config.yaml").is_file() else {}
    if not isinstance(config or {}, dict):
        raise UserError(f"{run / 'config.yaml'} does not hold a run's config (a mapping of sections); {DAMAGED}")
    info = read_json(run / "run_info.json", DAMAGED) if (run / "run_info.json").is_file() else {}
    ckpts = sorted(int(m.group(1)) for p in (run / "checkpoints").glob("step-*") if (m := CHECKPOINT.match(p.name)))
    return RunData(path=run, name=run.name if run.name != "run" else f"{run.parent.name}/{run.name}",
                   steps=[r for r in rows if "loss" in r], evals=[r for r in rows if "eval_loss" in r],
                   eval_stats=[r for r in rows if "loss" not in r and "eval_loss" not in r
                               and isinstance(r.get("step"), int) and any(k.startswith("eval_") for k in r)],
                   config=config or {}, info=info, samples=_jsonl(run / "samples.jsonl", skipped, _sample_problem),
                   incidents=_jsonl(run / "incidents.jsonl", skipped, _incident_problem), checkpoints=ckpts,
                   skipped_lines=skipped, warnings=[r for r in rows if isinstance(r.get("warnings"), list)])


def _unique(numbered: list[tuple[int, dict]], path: Path, skipped: list[tuple[str, int, str]]) -> list[dict]:
    """The lines of ``numbered`` (line number, record) but those a later line logs again (a log of an older version
    written by two processes at once holds steps twice): each dropped line noted as skipped, naming its copy."""
    again = metrics_log.repeats([rec for _, rec in numbered])
    kept_at = {metrics_log.line_key(rec): n for i, (n, rec) in enumerate(numbered) if i not in again}
    for i in sorted(again):
        n, rec = numbered[i]
        copy = kept_at[metrics_log.line_key(rec)]
        skipped.append((str(path), n, f"step {rec.get('step')} logged again at line {copy} (a repeat; the later copy "
                                      "is kept)"))
    return [rec for i, (_, rec) in enumerate(numbered) if i not in again]


def _jsonl(path: Path, skipped: list[tuple[str, int, str]], problem, numbered: bool = False) -> list:
    """Every line that parses and has the fields the report reads; any other line is left out and noted in
    ``skipped`` as (file, line, why) (a last line cut short by a crash is left out, as resume leaves it out, and
    said too). JSON too deep or too large to parse stays a refusal: no crash writes that."""
    if not path.is_file():
        return []
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = parse_json(line)
        except JsonProblem as exc:
            if exc.malformed:
                skipped.append((str(path), lineno, f"not JSON: {exc}"))
                continue
            raise UserError(f"{path}:{lineno}: {exc}; the run directory is damaged: remove that line, or restore "
                            "the file from a copy.") from None
        why = "not a JSON object" if not isinstance(rec, dict) else problem(rec)
        if why:
            skipped.append((str(path), lineno, why))
            continue
        out.append((lineno, rec) if numbered else rec)
    return out


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _metrics_problem(rec: dict) -> str | None:
    if not ("loss" in rec or "eval_loss" in rec):
        return None  # other lines (the run's start, notes) are not plotted
    if not isinstance(rec.get("step"), int) or isinstance(rec.get("step"), bool):
        return "no integer 'step'"
    bad = [k for k in ("loss", "eval_loss", "lr", "grad_norm", "pieces", "peak_mem_bytes", "step_s",
                       "useful_tokens_per_s") if k in rec and rec[k] is not None and not _number(rec[k])]
    return f"{bad[0]!r} is not a number" if bad else None


def _sample_problem(rec: dict) -> str | None:
    if not isinstance(rec.get("step"), int) or not isinstance(rec.get("prompt"), str) \
            or not isinstance(rec.get("output"), str):
        return "a sample needs an integer 'step' and 'prompt' and 'output' strings"
    return None


def _incident_problem(rec: dict) -> str | None:
    step = rec.get("last_logged_step", 0)
    return None if isinstance(step, int) and not isinstance(step, bool) else "'last_logged_step' is not an integer"


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
