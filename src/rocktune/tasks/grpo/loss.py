"""The GRPO objective in one tested place (tests/test_grpo_trl.py compares it with TRL's GRPOTrainer).

A batch row is one completion after its prompt, right-padded: ``input_ids``, ``attention_mask``, ``completion_mask``
(1 on the completion's tokens), the completion's group-relative ``advantage`` and its aggregation ``weight``. The
per-token loss is PPO's clipped surrogate, ``-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)``, plus
``beta`` times the k3 estimate of the KL to the reference (times the ratio unless ``use_bias_correction_kl`` is
off, as TRL), which is the same model with the adapter switched off
(no second copy), run without gradients in the same call. One generation feeds one optimizer step, so the "old"
policy of the ratio is the current one detached (TRL's default, num_iterations=1): the ratio is 1 in value and its
gradient is the policy gradient.

``forward`` returns the sum over rows of ``weight * sum of the row's token losses``; the engine divides by the step's
normaliser, so every aggregation TRL offers is a choice of weight and normaliser (rollout.py's ``aggregation``):

- grpo: weight 1/|o_i|, normaliser the step's completions (each sequence's token mean, then the mean);
- dapo: weight 1, normaliser the step's completion tokens (the token mean over the whole step);
- dr_grpo: weight 1/max_completion_length, normaliser the step's completions.

Because every quantity is per row, micro-batching, the OOM split and gradient accumulation leave the step's loss as
it is.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from rocktune.tasks.grpo import prefix
from rocktune.tasks.causal.loss import hidden_and_head, target_logps
from rocktune.train.task import KeepsStats

STATS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@dataclass(frozen=True)
class Objective:
    """TRL's GRPOConfig settings of the same names."""

    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon (DAPO's clip-higher sets it above)
    loss_type: str = "dapo"  # grpo | dapo | dr_grpo
    max_completion_length: int = 512
    temperature: float = 1.0  # the rollouts': log-probabilities are of the distribution sampled from (as TRL)
    use_bias_correction_kl: bool = True  # the KL times the ratio: an unbiased reverse-KL gradient (TRL's default)


def token_logps(model, batch: dict[str, torch.Tensor], temperature: float = 1.0, share: bool = False
                ) -> torch.Tensor:
    """Log-probabilities of each row's tokens 1.. under ``model`` at ``temperature`` [rows, width - 1] (0 where not
    a completion token); the head runs on completion positions only: no full logits.

    The rows are right-padded (feed.collate), so causal attention alone keeps every real token from the pads after
    it, and the positions are 0.. either way: the model runs without the padding mask, which lets SDPA take its
    causal kernel (and grouped K/V un-repeated) instead of building and applying a mask. The pads' own outputs
    differ, and are never scored. ``share``: each prompt computed once for its group (prefix.py) where that applies.
    """
    shared = prefix.shared_logps(model, batch, temperature) if share else None
    if shared is not None:
        return shared
    ids, mask = batch["input_ids"], batch["completion_mask"][:, 1:].bool()
    inputs = {"input_ids": ids, "use_cache": False}
    hidden, head = hidden_and_head(model, inputs)
    rows, cols = mask.nonzero(as_tuple=True)
    picked = target_logps(head, hidden[:, :-1][rows, cols], ids[:, 1:][rows, cols], temperature)
    out = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.float32, device=ids.device)
    return out.index_put((rows, cols), picked)


def token_losses(o: Objective, logps: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None,
                 advantages: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token losses [rows, T] and per-row statistic sums (over the mask) for the metrics."""
    ratio = torch.exp(logps - old)
    high = o.epsilon if o.epsilon_high is None else o.epsilon_high
    clipped = torch.clamp(ratio, 1 - o.epsilon, 1 + high)
    a = advantages[:, None]
    losses = -torch.min(ratio * a, clipped * a)
    stats = {}
    if ref is not None and o.beta != 0.0:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        if o.use_bias_correction_kl:
            kl = kl * ratio  # 1 in value on-policy, but its gradient is what makes the KL estimate's unbiased
        losses = losses + o.beta * kl
        stats["kl"] = (kl.detach() * mask).sum(-1)
    low_hit = (ratio < 1 - o.epsilon) & (a < 0)
    high_hit = (ratio > 1 + high) & (a > 0)
    stats["clip_ratio/low_mean"] = (low_hit * mask).sum(-1).float()
    stats["clip_ratio/high_mean"] = (high_hit * mask).sum(-1).float()
    stats["clip_ratio/region_mean"] = ((low_hit | high_hit) * mask).sum(-1).float()
    return losses, stats


class GRPOLoss(KeepsStats):
    """batch -> the weighted sum of its completions' token losses; the engine normalises per step. Statistics
    (KL, clip ratios) are summed over completion tokens until ``take_stats``."""

    def __init__(self, model, objective: Objective, share_prompt: bool = False):
        super().__init__()
        self.model, self.objective, self.share_prompt = model, objective, share_prompt

    @contextlib.contextmanager
    def plain_path(self):
        """Inside: full rows, no shared prompt (the training-path tripwire's reference forward)."""
        saved, self.share_prompt = self.share_prompt, False
        try:
            yield
        finally:
            self.share_prompt = saved

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = batch["completion_mask"][:, 1:].float()
        o = self.objective
        logps = token_logps(self.model, batch, o.temperature, self.share_prompt)
        ref = None
        if o.beta != 0.0:
            with torch.no_grad(), _adapter_off(self.model):
                ref = token_logps(self.model, batch, o.temperature, self.share_prompt)
        old = batch.get("old_logps", logps.detach())  # given: the policy that sampled, if it was another
        losses, stats = token_losses(o, logps, old, ref, batch["advantage"], mask)
        self.add_stats({**{k: v.sum() for k, v in stats.items()}, "tokens": mask.sum()})
        return ((losses * mask).sum(-1) * batch["weight"]).sum()

    def take_stats(self, reduce=None, step_tokens: int | None = None) -> dict[str, float]:
        """Token means over the completions seen since the last call (one synchronisation), and reset; ``reduce``
        (sums -> sums over every rank) makes them the whole step's. ``step_tokens``: the step's completion tokens, the
        means' denominator (a row no forward computed, its advantage 0, adds 0 to every sum but counts in it);
        None: the tokens the forwards saw."""
        stats, self._stats = self._stats, {}
        tokens = stats.pop("tokens", None)
        if tokens is None:
            return {}
        keys = list(stats)
        values = torch.stack([torch.as_tensor(stats[k], dtype=torch.float32) for k in keys] + [tokens.float()])
        *sums, count = (reduce(values) if reduce is not None else values).tolist()
        count = count if step_tokens is None else step_tokens
        return {k: v / max(count, 1.0) for k, v in zip(keys, sums)}


def _adapter_off(model):
    """The reference: the base model, i.e. the same weights with the LoRA adapter switched off."""
    return model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()
