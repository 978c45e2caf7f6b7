"""What a Wan run's config and its number of processes alone rule out; torch-free, so that the launching process
decides it (``tasks.refuse_before_launch``) before a worker starts, and ``WanTask.refuse`` again in the worker.
Keys that apply to other tasks only are refused from the config's field tags (``config.refuse_inapplicable``)."""

from __future__ import annotations

from rocktune.config import RunConfig, refuse_inapplicable
from rocktune.errors import UserError
from rocktune.train.request import RunOptions


def refuse(cfg: RunConfig, options: RunOptions) -> None:
    if options.auto_fit:
        raise UserError(f"--auto chooses LM settings; for task={cfg.task} see what fits with `rocktune plan "
                        f"{cfg.model.name_or_path} --task {cfg.task} --resolution WxH --frames N --vram ...`.")
    refuse_inapplicable(cfg)
    if options.processes > 1:
        raise UserError(f"task={cfg.task} trains in one process; multi-GPU diffusion LoRA is not supported "
                        "yet. Run without --nproc/--nnodes (docs/diffusion.md).")


def precheck(cfg: RunConfig) -> None:
    """Media folders and manifests are checked by the Wan task itself, clip by clip."""
