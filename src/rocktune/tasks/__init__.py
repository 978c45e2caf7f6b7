"""The tasks rocktune trains, and ``train(cfg)``, which picks one and hands it to the one loop (train/loop.py).

- ``tasks/lm``: LoRA on a causal LM (chat, instruction, text data).
- ``tasks/wan``: LoRA on a Wan 2.1/2.2 transformer (video-lora, image-lora).
"""

from __future__ import annotations

from rocktune.config import RunConfig
from rocktune.train import context, loop
from rocktune.train.faults import Faults
from rocktune.train.loop import TrainResult
from rocktune.train.request import RunOptions


def make_task(cfg: RunConfig):
    if cfg.is_diffusion:
        from rocktune.tasks.wan.task import WanTask

        return WanTask(cfg)
    from rocktune.tasks.lm.task import LMTask

    return LMTask(cfg)


def train(cfg: RunConfig, options: RunOptions | None = None, *, quiet: bool = False, faults: Faults | None = None,
          on_ready=None, on_step_done=None) -> TrainResult:
    """Train ``cfg``. ``on_ready(model)`` (benchmarks): the model with its adapter is built; ``on_step_done(step)``
    (the supervised worker): an optimizer step has completed."""
    options = options or RunOptions()
    task = make_task(cfg)
    task.refuse(options)  # config-only refusals come before the device or any file is touched
    ctx = context.resolve(cfg, options, task.attn_setting(), faults, quiet)
    ctx.on_step_done = on_step_done
    return loop.run(task, ctx, on_ready)
