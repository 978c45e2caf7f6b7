"""The tasks rocktune trains, and ``train(cfg)``, which builds the one ``cfg.task`` names (task_registry.TASKS) and
hands it to the one loop (train/loop.py).

Every task is a row of task_registry.TASKS: its builder (the task object, in the task's folder here) and its launch
module. ``tasks/causal`` is no task: it is the causal-LM kit the LM-based tasks share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rocktune.task_registry import load
from rocktune.train.request import RunOptions

if TYPE_CHECKING:  # the engine (and torch) only where a run starts: the launching process imports this package too;
    # and the config only for its type: config.py composes its model from the task sections in these folders
    from rocktune.config import RunConfig
    from rocktune.train.faults import Faults
    from rocktune.train.loop import TrainResult


def make_task(cfg: RunConfig):
    return load(cfg.spec.builder)(cfg)


def refuse_before_launch(cfg: RunConfig, options: RunOptions) -> None:
    """In the launching process (the CLI), before the supervisor, torchrun or any worker starts: what the config, the
    number of processes and the checkpoints' records alone rule out, said once as one paragraph. Torch-free. The
    workers decide the same again (``task.refuse``, resume's checks): a request may come from elsewhere."""
    load(cfg.spec.launch).refuse(cfg, options)


def precheck(cfg: RunConfig) -> None:
    """The task's inputs that can be checked within a second in the launching process (e.g. LM data JSON)."""
    load(cfg.spec.launch).precheck(cfg)


def train(cfg: RunConfig, options: RunOptions | None = None, *, quiet: bool = False, faults: Faults | None = None,
          on_ready=None, on_step_done=None) -> TrainResult:
    """Train ``cfg``. ``on_ready(model)`` (benchmarks): the model with its adapter is built; ``on_step_done(step)``
    (the supervised worker): an optimizer step has completed."""
    from rocktune.train import context, loop, runlock

    options = options or RunOptions()
    task = make_task(cfg)
    task.refuse(options)  # config-only refusals come before the device or any file is touched
    ctx = context.resolve(cfg, options, task.attn_setting(), faults, quiet)
    ctx.on_step_done = on_step_done
    # One process trains a run directory at a time, from before it is read until the process ends (runlock.py).
    with runlock.RunLock(ctx.run_dir, enabled=ctx.dist.main) as ctx.run_lock:
        return loop.run(task, ctx, on_ready)
