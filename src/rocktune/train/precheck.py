"""What ``rocktune train`` can refuse within a second, in the command's own process, before a child imports torch
and loads a tokenizer: the run directory (unless ``--auto``, whose fitted config is what it compares). The task's
own inputs are checked by its launch module (task_registry), through ``tasks.precheck``."""

from __future__ import annotations

from pathlib import Path

from rocktune.config import RunConfig
from rocktune.train.request import RunOptions
from rocktune.train.rundir import check_output_dir


def check_before_start(cfg: RunConfig, options: RunOptions) -> None:
    if not options.auto_fit:
        check_output_dir(Path(cfg.output.dir), cfg.model_dump(mode="json"), options.overwrite, options.resume)
