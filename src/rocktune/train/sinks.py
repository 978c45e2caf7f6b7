"""Where metrics go besides ``metrics.jsonl``: TensorBoard event files, Weights & Biases, MLflow — each only when
enabled in ``output`` and through its own client; and ``run_info.json``, the facts of the run the report shows.

The loop writes each record once; ``LiveLog`` keeps ``metrics.jsonl`` the record of truth (resume truncates it by
line count) and forwards the numbers to the sinks.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import math
import sys
import time
from typing import Any
from pathlib import Path

from rocktune.errors import UserError
from rocktune.atomic import write_atomic
from rocktune.readers import metrics_log
from rocktune.readers.json_file import JsonProblem, parse_json

_SORT_LAST_TRIES = 3

# metrics.jsonl key -> (chart tag, scale): the charts a person looks at, grouped as TensorBoard groups them.
TAGS = {"loss": ("train/loss", 1), "eval_loss": ("eval/loss", 1), "lr": ("train/lr", 1),
        "grad_norm": ("train/grad_norm", 1), "useful_tokens_per_s": ("perf/useful_tokens_per_s", 1),
        "peak_mem_bytes": ("perf/peak_mem_gib", 2**-30), "step_s": ("perf/step_s", 1),
        "rss_bytes": ("memory/rss_gib", 2**-30), "mem_allocated_bytes": ("memory/allocated_gib", 2**-30),
        "mem_reserved_bytes": ("memory/reserved_gib", 2**-30)}
CLIENTS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def require(tensorboard: bool, wandb: bool, mlflow: bool) -> None:
    """Refuse before the run starts when an enabled sink's client is not installed."""
    for key, on in (("tensorboard", tensorboard), ("wandb", wandb), ("mlflow", mlflow)):
        if on and importlib.util.find_spec(CLIENTS[key]) is None:
            extra = "pip install 'rocktune[tensorboard]'" if key == "tensorboard" else f"pip install {key}"
            raise UserError(f"output.{key}=true but the {key} package is not installed; {extra}, or set "
                            f"output.{key}=false.")


def scalars(record: dict) -> dict[str, float]:
    out = {}
    for key, (tag, scale) in TAGS.items():
        value = record.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[tag] = value * scale
    return out


class LiveLog:
    """``MetricsLog``'s interface (write, lines), fanned out to the enabled sinks."""

    def __init__(self, base, sinks: list):
        self.base, self.sinks = base, sinks
        atexit.register(self.close)  # the loop closes it; this covers a process that ends another way

    def write(self, record: dict) -> None:
        self.base.write(record)
        self.send(record)

    def send(self, record: dict) -> None:
        """To the sinks only (a line the log already holds, sent again after a resume: ``open_log``)."""
        values = scalars(record)
        if values and "step" in record:
            for sink in self.sinks:
                sink.scalars(values, int(record["step"]))

    def lines(self) -> int:
        return self.base.lines()

    def sync(self) -> None:
        self.base.sync()

    def text(self, tag: str, text: str, step: int) -> None:
        for sink in self.sinks:
            sink.text(tag, text, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def redo_from(start_step: int, total_steps: int) -> int:
    """The first step a run that starts after ``start_step`` logs anything at: 0 for a run from the start; the step
    after the checkpoint for a resume; the checkpoint's own step when that is the last one, since a resume there
    redoes only the final phase, whose lines (final eval, samples) are logged at the last step."""
    return start_step if start_step in (0, total_steps) else start_step + 1


def open_log(base, run_dir: Path, redo: int, tensorboard: bool, wandb: bool, mlflow: bool) -> LiveLog:
    """The sinks of a run that logs from step ``redo`` on (``redo_from``). TensorBoard's directory outlives an
    attempt: it is told to hide whatever an earlier attempt logged at ``redo`` and after, and the lines the log still
    holds from ``redo`` on (a final-phase resume's last training step) are sent again, so each step shows once. W&B
    and MLflow start a tracker run per attempt, which begins after the checkpoint: none holds a step twice."""
    sinks: list[Any] = []
    if tensorboard:
        sinks.append(_TensorBoard(run_dir / "tensorboard", redo))
    if wandb:
        sinks.append(_WandB(run_dir))
    if mlflow:
        sinks.append(_MLflow(run_dir))
    log = LiveLog(base, sinks)
    if sinks:
        for record in _logged_from(run_dir / "metrics.jsonl", redo):
            log.send(record)
    return log


def _logged_from(path: Path, step: int) -> list[dict]:
    """The log's lines at ``step`` and after (none but a final-phase resume's last step), repeats left out."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = parse_json(line)
        except JsonProblem:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] >= step:
            rows.append(rec)
    again = metrics_log.repeats(rows)
    return [r for i, r in enumerate(rows) if i not in again]


class _TensorBoard:
    def __init__(self, log_dir: Path, redo: int):
        from torch.utils.tensorboard import SummaryWriter

        # Every attempt logs into the same directory: purge_step hides what earlier attempts logged at ``redo`` and
        # after (a run restarted from nothing: everything; a resume: the steps after its checkpoint). The purge acts
        # on what the reader has read before this file, and the reader reads a directory's files in sorted name
        # order; the name holds the whole second it was made in, then host and pid. An attempt that starts in the
        # second its killed predecessor started in (a fast restart, a smaller pid) would sort first and be purged
        # by the old file instead, so the file is made again in a later second until it sorts last.
        log_dir.mkdir(parents=True, exist_ok=True)
        before = {p.name for p in log_dir.iterdir()}
        for tries_left in reversed(range(_SORT_LAST_TRIES)):
            self.writer = SummaryWriter(str(log_dir), purge_step=redo)
            self.writer.flush()
            mine = sorted({p.name for p in log_dir.iterdir()} - before)
            if not before or not mine or mine[0] > max(before):
                return
            if not tries_left:
                break
            self.writer.close()
            for name in mine:
                (log_dir / name).unlink(missing_ok=True)
            time.sleep(1.0 - time.time() % 1.0 + 0.01)
        print("tensorboard: this attempt's event file sorts before an earlier attempt's (the clock went back?); "
              "TensorBoard may show steps of both", file=sys.stderr)

    def scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a crash must not take the last minutes of curves with it

    def text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run_dir: Path):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project="rocktune", name=run_dir.name, dir=str(run_dir))

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        self.run.log({tag: self.wandb.Html(f"<pre>{text}</pre>")}, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, run_dir: Path):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment("rocktune")
        mlflow.start_run(run_name=run_dir.name)

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({k.replace("/", "_"): v for k, v in values.items()}, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        self.mlflow.log_text(text, f"{tag}/step-{step:07d}.md")

    def close(self) -> None:
        self.mlflow.end_run()


def write_info(run_dir: Path, device: str, precision: str, predicted_peak: int | None, notes: list[str],
               data: dict) -> None:
    """run_info.json with the task's own data statistics (``data``)."""
    import platform

    import torch

    info = {"device": device, "precision": precision, "predicted_peak_bytes": predicted_peak, "notes": notes,
            "platform": {"python": platform.python_version(), "os": platform.platform(), "torch": torch.__version__,
                         "hip": torch.version.hip, "cuda": torch.version.cuda,
                         "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor()},
            "data": data}
    write_atomic(run_dir / "run_info.json", json.dumps(info, indent=1) + "\n")
