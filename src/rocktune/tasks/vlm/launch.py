"""What the launching process refuses for task=vlm before a worker starts: torch-free, from the config alone."""

from __future__ import annotations

from pathlib import Path

from rocktune.config import RunConfig, refuse_inapplicable
from rocktune.errors import UserError
from rocktune.tasks.lm.launch import precheck  # noqa: F401 -- the same JSON check of the data files
from rocktune.train.request import RunOptions


def refuse(cfg: RunConfig, options: RunOptions) -> None:
    from rocktune.train.resume import check_world_before_launch

    refuse_inapplicable(cfg)
    if options.resume:  # a checkpoint records how many ranks wrote it
        check_world_before_launch(Path(cfg.output.dir) / "checkpoints", options.processes, options.resume_force)
    if options.processes > 1 and cfg.lora.vision != "none":  # DDP needs every adapter weight in every backward
        raise UserError(f"lora.vision={cfg.lora.vision} trains in one process for now: a rank whose micro-batch has "
                        "no image would leave the vision side's adapter without a gradient, which DDP does not "
                        "allow; drop --nproc or set lora.vision: none.")
    if cfg.lora.vision != "none" and cfg.lora.target_modules != "all-linear":
        raise UserError(f"lora.vision={cfg.lora.vision} chooses the vision side with lora.target_modules: all-linear; "
                        "with a list of target modules, name the vision modules in the list instead.")
    if options.auto_fit and cfg.lora.vision != "none":
        raise UserError(f"--auto plans the vision tower frozen; with lora.vision={cfg.lora.vision} set data.max_pixels "
                        "and training.micro_batch_size yourself, or drop --auto.")
