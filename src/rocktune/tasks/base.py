"""``TaskBase``: the usual answers to the optional hooks of train/task.py's ``Task``, so that a task writes only what
is its own. The hooks every task must answer itself (``refuse``, ``check``, ``prepare``, ``new_feed``, ``evaluate``,
``record``, ``oom_message``) have no default here: a task without one does not satisfy ``Task``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable


class TaskBase:
    kind: str = ""  # the task_registry name
    samples_what: str = ""  # no sample generations with the final metrics
    cfg: Any  # the run's RunConfig

    def attn_setting(self) -> str:
        return self.cfg.model.attn_implementation

    def check_resume(self, restored, force: bool) -> None:
        """Nothing of the task's own to check (the engine checks the data fingerprint)."""

    def resumed(self, restored) -> None:
        """No task state in the checkpoint besides the engine's."""

    def checkpoint_extra(self) -> dict:
        return {}

    def start(self, redo_from: int, metrics, log) -> None:
        """Nothing to open."""

    def after_eval(self, step: int, metrics, log) -> None:
        """Nothing besides the engine's eval metrics."""

    def progress(self, record: dict) -> str:
        return ""  # the loss says how the step went

    def final_files(self, run_dir: Path) -> list[tuple[str, Callable[[], None]]]:
        return []

    def outputs(self, run_dir: Path) -> list[str] | None:
        return None  # the LM's summary lines

    def uncompile(self) -> None:
        """Never compiled (training.compile is an SFT setting)."""
