"""The ``grpo:`` config section of task: grpo; config.py composes it into the run config from the
task's registry row."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from rocktune.config_base import _Section


class RewardSpec(_Section):
    """One reward function of task: grpo (docs/rl.md); the run's reward is the weighted sum."""

    function: str = Field(description="exact (the completion's answer equals the reference), numeric (its last number "
                          "within tolerance of the reference's), regex (matches pattern: a format reward), length "
                          "(DAPO's overlong penalty), or module:function, the user's own reward with TRL's signature, "
                          "imported by the training process only.")
    weight: float = Field(1.0, description="Its weight in the sum (TRL's reward_weights).")
    name: str | None = Field(None, description="Its name in the metrics (rewards/NAME/mean); default: the function's.")
    pattern: str | None = Field(None, description="regex: the pattern a completion must contain (re.search, DOTALL).")
    tolerance: float = Field(1e-6, ge=0.0, description="numeric: the largest absolute difference that still counts.")
    max_tokens: PositiveInt | None = Field(None, description="length: the longest completion (default: "
                                           "grpo.max_completion_length); reward -1 there.")
    buffer: int | None = Field(None, ge=0, description="length: the tokens before max_tokens where the penalty grows "
                               "linearly from 0 to -1 (default: max_tokens / 4).")

    @model_validator(mode="after")
    def _check(self) -> RewardSpec:
        import re

        built_in = ("exact", "numeric", "regex", "length")
        if self.function not in built_in and (":" not in self.function or self.function.startswith(":")):
            raise ValueError(f"function={self.function!r}: one of {', '.join(built_in)}, or module:function for a "
                             "reward of your own")
        if self.function == "regex":
            if not self.pattern:
                raise ValueError("function=regex needs pattern, the regular expression a completion must contain")
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise ValueError(f"pattern={self.pattern!r} is not a regular expression: {exc}") from None
        return self


class GRPOConfig(_Section):
    """task: grpo only (docs/rl.md); TRL's GRPOConfig names and meanings."""

    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt (the group G); "
                                 "training.micro_batch_size x grad_accum completions per step must be a multiple.")
    max_completion_length: PositiveInt = Field(512, description="Most tokens a completion may have.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature of the rollouts.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling of the rollouts (1: off).")
    top_k: int = Field(0, ge=0, description="Top-k sampling of the rollouts (0: off).")
    stop: list[str] = Field(default_factory=list, description="Strings that end a completion (besides EOS and the "
                            "chat template's end of turn); the completion keeps them.")
    beta: float = Field(0.0, ge=0.0, description="Weight of the KL to the reference (the model with its adapter off); "
                        "0: no reference forward at all (TRL's default).")
    use_bias_correction_kl: bool = Field(True, description="Multiply the KL term by the probability ratio, which "
                                         "makes its gradient the unbiased reverse-KL gradient (TRL's default).")
    epsilon: float = Field(0.2, gt=0.0, lt=1.0, description="Clipping of the probability ratio, below (and above "
                           "unless epsilon_high).")
    epsilon_high: float | None = Field(None, gt=0.0, description="Upper clipping (DAPO's clip-higher, e.g. 0.28).")
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = Field(
        "dapo", description="Aggregation of token losses: grpo (each sequence's token mean, then the mean), dapo (the "
        "token mean over the step), dr_grpo (the sum over completions x max_completion_length).")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Advantages divided by the reward std of the group, of the whole step, or not at all "
        "(none: Dr. GRPO's fix).")
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(function="exact")],
                                      description="The reward functions, summed with their weights.")
    compile_rollout: bool = Field(False, description="torch.compile the rollout's decode step over a static KV cache "
                                  "(data.max_length + max_completion_length positions): compiled once per batch size "
                                  "(tens of seconds on a CPU, in the first step), then fewer, generated kernels per "
                                  "token (docs/rl.md measures it). A compile failure falls back to eager.")
    share_prompt: bool = Field(True, description="The update computes each prompt once for its group of completions "
                               "(a KV cache indexed out to the group's rows) instead of once per completion: the same "
                               "log-probabilities up to rounding, fewer positions. Models with sliding-window or "
                               "non-attention layers, and gradient checkpointing, take the plain forward.")
