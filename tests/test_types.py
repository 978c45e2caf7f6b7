"""Issue 52, item 4: types are checked. mypy runs on the engine, the tasks, the registry and the config (the
paths and settings are pyproject.toml's [tool.mypy], the same run as ``make test``'s), and a task class that lacks
a hook of train/task.py's ``Task`` (one tasks/base.py's ``TaskBase`` gives no default for) is rejected: every
registry task is returned as a ``Task`` in src/rocktune/tasks/conformance.py.

Both mypy cases share the repository's .mypy_cache: after ``make test``'s own mypy run they take seconds; from a
cold cache about a minute on 2 CPU cores."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rocktune import task_registry

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["src/rocktune/train", "src/rocktune/tasks", "src/rocktune/task_registry.py", "src/rocktune/config.py"]
needs_mypy = pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                                reason="mypy is not installed in this environment (the dev extra has it): types "
                                       "are not checked here")

MISSING_HOOK = '''
from rocktune.config import RunConfig
from rocktune.tasks.base import TaskBase
from rocktune.train.task import Task


class HalfTask(TaskBase):
    """Every hook TaskBase gives a default for, but no ``evaluate``, ``new_feed``, ``prepare`` of its own."""

    kind = "half"

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def refuse(self, options) -> None: ...

    def check(self, ctx) -> None: ...

    def record(self, fed) -> dict:
        return {}

    def oom_message(self, step: int, exc: BaseException) -> str:
        return ""


def _half(cfg: RunConfig) -> Task:
    return HalfTask(cfg)
'''


def _mypy(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MYPYPATH": str(ROOT / "src")}  # a file outside src/ imports rocktune from the checkout
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
@needs_mypy
def test_engine_tasks_registry_and_config_type_check():
    done = _mypy(*PATHS)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
@needs_mypy
def test_a_task_missing_a_hook_is_rejected(tmp_path):
    src = tmp_path / "half_task.py"
    src.write_text(textwrap.dedent(MISSING_HOOK))
    done = _mypy("--config-file", str(ROOT / "pyproject.toml"), str(src))
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert re.search(r'half_task\.py:\d+: error: Incompatible return value type \(got "HalfTask", expected "Task"\)',
                     out), out


def test_every_registry_task_is_in_the_conformance_check():
    """A new task's class is checked against ``Task`` only if conformance.py returns it as one."""
    text = (ROOT / "src/rocktune/tasks/conformance.py").read_text()
    for name, spec in task_registry.TASKS.items():
        module, cls = spec.builder.split(":")
        assert f"from {module} import {cls}" in text and f"return {cls}(cfg)" in text, \
            f"task {name}: add its builder {spec.builder} to src/rocktune/tasks/conformance.py"
