"""What the launching process refuses for task: grpo before the supervisor or any worker starts (torch-free): the
LM tasks' checks (the number of processes a resumed run was written with included), and what GRPO alone rules out.
The worker decides the same again (``GRPOTask.refuse``). A user's reward module that cannot be found or does not
compile is refused here too, before anything starts (user_reward.precheck: compiled, never run)."""

from __future__ import annotations

from rocktune.config import RunConfig
from rocktune.errors import UserError
from rocktune.tasks.causal import launch as lm_launch
from rocktune.tasks.grpo import user_reward
from rocktune.train.request import RunOptions

precheck = lm_launch.precheck


def refuse(cfg: RunConfig, options: RunOptions) -> None:
    lm_launch.refuse(cfg, options)
    refuse_grpo(cfg, options)
    for i, spec in enumerate(cfg.grpo.rewards):
        if ":" in spec.function:  # the built-ins have no module
            user_reward.precheck(spec.function, f"grpo.rewards[{i}]")


def refuse_grpo(cfg: RunConfig, options: RunOptions) -> None:
    t, g = cfg.training, cfg.grpo
    if options.auto_fit:
        raise UserError("--auto fits supervised LM runs; for task=grpo set training.micro_batch_size (completions "
                        "per forward) yourself: `rocktune plan MODEL --task grpo` shows what fits.")
    if t.parallel == "fsdp":
        raise UserError("task=grpo trains with training.parallel=ddp (or one process): every rank samples from the "
                        "whole model, so its layers are not sharded; set training.parallel=ddp.")
    if (t.micro_batch_size * t.grad_accum) % g.num_generations:
        raise UserError(f"task=grpo: training.micro_batch_size x grad_accum = {t.micro_batch_size * t.grad_accum} "
                        f"completions per step must be a multiple of grpo.num_generations={g.num_generations} "
                        "(each prompt's group is scored together); change one of them.")
