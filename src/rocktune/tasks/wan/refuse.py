"""What a Wan run's config and its number of processes alone rule out; torch-free, so that the launching process
decides it (``tasks.refuse_before_launch``) before a worker starts, and ``WanTask.refuse`` again in the worker."""

from __future__ import annotations

from rocktune.config import RunConfig
from rocktune.errors import UserError
from rocktune.train.request import RunOptions


def refuse(cfg: RunConfig, options: RunOptions) -> None:
    if options.auto_fit:
        raise UserError(f"--auto chooses LM settings; for task={cfg.task} see what fits with `rocktune plan "
                        f"{cfg.model.name_or_path} --task {cfg.task} --resolution WxH --frames N --vram ...`.")
    refuse_lm_only(cfg)
    if options.processes > 1:
        raise UserError(f"task={cfg.task} trains in one process; multi-GPU diffusion LoRA is not supported "
                        "yet. Run without --nproc/--nnodes (docs/diffusion.md).")


def refuse_lm_only(cfg: RunConfig) -> None:
    """Settings that mean something for LMs only: asked for explicitly, they are refused rather than ignored."""
    m, t = cfg.model, cfg.training
    settings = {"model.quantization": (m.quantization, {"none"}), "model.liger": (m.liger, {"auto", "off"}),
                "training.compile": (t.compile, {"auto", False}),
                "training.batching": (t.batching, {"auto", "examples"}),
                "data.packing": (cfg.data.packing, {False}), "training.sample_count": (t.sample_count, {0}),
                "training.sample_prompts": (tuple(t.sample_prompts), {()})}
    asked = [f"{key}={value}" for key, (value, harmless) in settings.items() if value not in harmless]
    if asked:
        raise UserError(f"{', '.join(asked)}: only for task=lm, not supported for task={cfg.task} "
                        "(docs/diffusion.md lists what is; render samples after training with rocktune generate); "
                        "remove it from the config.")
