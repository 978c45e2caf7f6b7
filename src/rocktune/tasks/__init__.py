"""The tasks rocktune trains, and ``train(cfg)``, which picks one and hands it to the one loop (train/loop.py).

- ``tasks/lm``: LoRA on a causal LM (chat, instruction, text data).
- ``tasks/wan``: LoRA on a Wan 2.1/2.2 transformer (video-lora, image-lora).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rocktune.config import RunConfig
from rocktune.train.request import RunOptions

if TYPE_CHECKING:  # the engine (and torch) only where a run starts: the launching process imports this package too
    from rocktune.train.faults import Faults
    from rocktune.train.loop import TrainResult


def make_task(cfg: RunConfig):
    if cfg.is_diffusion:
        from rocktune.tasks.wan.task import WanTask

        return WanTask(cfg)
    from rocktune.tasks.lm.task import LMTask

    return LMTask(cfg)


def refuse_before_launch(cfg: RunConfig, options: RunOptions) -> None:
    """In the launching process (the CLI), before the supervisor, torchrun or any worker starts: what the config, the
    number of processes and the checkpoints' records alone rule out, said once as one paragraph. Torch-free. The
    workers decide the same again (``task.refuse``, resume's checks): a request may come from elsewhere."""
    from pathlib import Path

    from rocktune.train.prelaunch import refuse_layout
    from rocktune.train.resume import check_world_before_launch

    if cfg.is_diffusion:
        from rocktune.tasks.wan.refuse import refuse

        refuse(cfg, options)
        return
    refuse_layout(options.processes, cfg.training.parallel, cfg.model.quantization)
    if options.resume:  # LM checkpoints record how many processes wrote them
        check_world_before_launch(Path(cfg.output.dir) / "checkpoints", options.processes, options.resume_force)


def train(cfg: RunConfig, options: RunOptions | None = None, *, quiet: bool = False, faults: Faults | None = None,
          on_ready=None, on_step_done=None) -> TrainResult:
    """Train ``cfg``. ``on_ready(model)`` (benchmarks): the model with its adapter is built; ``on_step_done(step)``
    (the supervised worker): an optimizer step has completed."""
    from rocktune.train import context, loop

    options = options or RunOptions()
    task = make_task(cfg)
    task.refuse(options)  # config-only refusals come before the device or any file is touched
    ctx = context.resolve(cfg, options, task.attn_setting(), faults, quiet)
    ctx.on_step_done = on_step_done
    return loop.run(task, ctx, on_ready)
