"""What the launching process refuses for task=vlm before a worker starts: torch-free, from the config alone."""

from __future__ import annotations

from rocktune.config import RunConfig, refuse_inapplicable
from rocktune.errors import UserError
from rocktune.tasks.lm.launch import precheck  # noqa: F401 -- the same JSON check of the data files
from rocktune.train.request import RunOptions


def refuse(cfg: RunConfig, options: RunOptions) -> None:
    refuse_inapplicable(cfg)
    if options.processes > 1:
        raise UserError("task=vlm trains in one process for now (several ranks are not yet supported for "
                        "vision-language models); drop --nproc.")
    if cfg.lora.vision != "none" and cfg.lora.target_modules != "all-linear":
        raise UserError(f"lora.vision={cfg.lora.vision} chooses the vision side with lora.target_modules: all-linear; "
                        "with a list of target modules, name the vision modules in the list instead.")
    if options.auto_fit:
        raise UserError("--auto fits supervised text runs; for task=vlm set training.micro_batch_size and "
                        "data.max_pixels yourself (docs/vision.md).")
