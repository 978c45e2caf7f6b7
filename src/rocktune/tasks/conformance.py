"""Every task object of task_registry.py satisfies train/task.py's ``Task`` protocol: checked by mypy, not run.

One function per registry ``builder``, each returning its task as a ``Task``: a task class that lacks a required
hook (one without a default in tasks/base.py's ``TaskBase``), or answers one with the wrong signature, fails
``make test``'s mypy run (tests/test_types.py). A new task adds its line here; tests/test_types.py checks that every
builder in the registry has one. Nothing is imported at run time."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rocktune.config import RunConfig
    from rocktune.tasks.grpo.task import GRPOTask
    from rocktune.tasks.lm.task import LMTask
    from rocktune.tasks.preference.task import PreferenceTask
    from rocktune.tasks.vlm.task import VLMTask
    from rocktune.tasks.wan.task import WanTask
    from rocktune.train.task import Task

    def _lm(cfg: RunConfig) -> Task:
        return LMTask(cfg)

    def _preference(cfg: RunConfig) -> Task:
        return PreferenceTask(cfg)

    def _grpo(cfg: RunConfig) -> Task:
        return GRPOTask(cfg)

    def _vlm(cfg: RunConfig) -> Task:
        return VLMTask(cfg)

    def _wan(cfg: RunConfig) -> Task:
        return WanTask(cfg)
