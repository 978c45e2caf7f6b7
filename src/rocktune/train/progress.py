"""What the user sees and what is kept: a rich progress bar and ``metrics.jsonl``."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from rocktune.atomic import kill_point
from rocktune.train.estimate import Estimate


class MetricsLog:
    """Append-only JSON lines; flushed per line so a crash loses at most the line being written. One process writes
    it (train/runlock.py), so the count kept here is the file's: a checkpoint records it, a resume cuts back to it."""

    def __init__(self, path: Path):
        self.path = path
        self._lines = len(path.read_text(encoding="utf-8").splitlines()) if path.is_file() else 0

    def write(self, record: dict) -> None:
        kill_point("metrics.appending")
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        kill_point("metrics.appended")
        self._lines += 1

    def lines(self) -> int:
        """Lines written so far; a checkpoint records it so a resume can drop what came after."""
        return self._lines

    def sync(self) -> None:
        """Flush the lines to the disk: a checkpoint (fsynced itself) never counts lines a power cut could take."""
        if self.path.is_file():
            fd = os.open(self.path, os.O_RDWR | getattr(os, "O_BINARY", 0))  # Windows' fsync needs write access
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class NullLog:
    """What ranks other than 0 log to: nothing (metrics come from rank 0)."""

    def write(self, record: dict) -> None:
        pass

    def lines(self) -> int:
        return 0

    def sync(self) -> None:
        pass


class ProgressBar:
    """A live bar on a terminal; in a log file (nohup, CI, a job scheduler), where a bar cannot redraw, plain
    progress lines instead: at the first step (so a log shows the run is alive), every ``PLAIN_EVERY_S`` seconds and
    at the last step, and no bar at all (rich would print its final state once more at exit)."""

    PLAIN_EVERY_S = 30.0

    def __init__(self, total_steps: int, start_step: int, quiet: bool = False, silent: bool = False):
        # silent: ranks other than 0 of a multi-process run say nothing (rank 0 speaks for the group)
        self.console = Console(stderr=True, soft_wrap=True, quiet=silent)
        self.total, self.quiet = total_steps, quiet
        self._last_plain = float("-inf")
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
            TimeRemainingColumn(), console=self.console, disable=quiet or not self.console.is_terminal,
            transient=False,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, stats="")
        self.t0 = time.perf_counter()
        self.estimate: Estimate | None = None  # the loop's: the time left, said in the plain lines
        self.printed: Callable[[], None] = lambda: None  # told of every line (the heartbeat waits after one)

    def __enter__(self) -> ProgressBar:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float, mem_bytes: int | None,
               task: str = "") -> None:
        """``task``: the task's own figures after the loss (GRPO's reward: its loss is near 0 by construction)."""
        mem = f" mem {mem_bytes / 2**30:.2f}GiB" if mem_bytes is not None else ""
        stats = f"loss {loss:.4f}{' ' + task if task else ''} lr {lr:.2e} {tokens_per_s:,.0f} tok/s{mem}"
        self.progress.update(self.task, completed=step, stats=stats)
        now = time.perf_counter()
        if not self.quiet and not self.console.is_terminal and (
                now - self._last_plain >= self.PLAIN_EVERY_S or step == self.total):
            self._last_plain = now
            left = self.estimate.left_text() if self.estimate is not None and step < self.total else ""
            self.log(f"step {step}/{self.total} {stats} ({now - self.t0:.0f} s{left})")

    def log(self, message: str) -> None:
        self.progress.console.print(message, highlight=False)
        self.printed()
