"""What the launching process refuses for task=vlm before a worker starts: torch-free, from the config alone."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

from rocktune.config import RunConfig, refuse_inapplicable
from rocktune.errors import UserError
from rocktune.tasks.causal.launch import precheck  # noqa: F401 -- the same JSON check of the data files
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
    packs = packing_setting(cfg)
    if packs and transformers_major() < 5:
        raise UserError(f"{packs} with task=vlm needs transformers 5 (this is transformers "
                        f"{version('transformers')}): the Qwen-VL models of transformers 4 do not read packed "
                        "positions as packed, so each conversation would attend to those before it in its row "
                        f"(measured with 4.57). Drop {packs}, or use torch >= 2.6 with transformers 5.")
    attn = cfg.model.attn_implementation
    if attn not in ("auto", "varlen", "sdpa"):
        raise UserError(f"model.attn_implementation={attn} is not supported for task=vlm: use auto, varlen or sdpa "
                        "(the language model's attention; the vision tower keeps sdpa).")
    if attn == "varlen" and transformers_major() < 5:
        raise UserError("model.attn_implementation=varlen with task=vlm needs transformers 5 (one attention per "
                        f"model part; this is transformers {version('transformers')}): use auto or sdpa.")
    if options.auto_fit and packs:  # the vlm planner's fit sizes padded rows of whole conversations
        raise UserError(f"--auto plans task=vlm's rows one conversation each; with {packs} (rows of "
                        "data.max_length tokens) set data.max_pixels and training.micro_batch_size yourself, or drop "
                        "--auto.")
    if options.auto_fit and cfg.lora.vision != "none":
        raise UserError(f"--auto plans the vision tower frozen; with lora.vision={cfg.lora.vision} set data.max_pixels "
                        "and training.micro_batch_size yourself, or drop --auto.")


def packing_setting(cfg: RunConfig) -> str:
    """The setting that packs conversations into rows (tasks/vlm/data/vision_pack.py), as the refusals name it; "" for
    none. Token batching packs every step, so whatever refuses packing refuses it too."""
    if cfg.training.batching == "tokens":
        return "training.batching=tokens"
    return "data.packing" if cfg.data.packing else ""


def transformers_major() -> int:
    return int(version("transformers").split(".")[0])
