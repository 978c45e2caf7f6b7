"""DPO and ORPO losses over packed pairs, in one tested place (tests/test_preference.py compares them with TRL).

A batch row is one pair: prompt + chosen, then prompt + rejected, each with its own position ids (packed, so the
two never attend to each other) and ``side`` saying which token is which (1 chosen, 2 rejected, 0 padding). One
forward of the policy (adapter on) gives both answers' summed log-probabilities; DPO's reference is the same model
with the adapter switched off, run without gradients in the same call: no second copy of the model in memory.

``forward`` returns the *sum* of per-pair losses; the engine divides by the pairs of the whole optimizer step, so
gradient accumulation, the OOM split and several ranks give the mean over the step's pairs, as TRL's batch mean.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from rocktune.data.encode import IGNORE
from rocktune.tasks.causal.loss import hidden_and_head, varlen_inputs
from rocktune.train.task import KeepsStats

MODEL_INPUTS = ("input_ids", "position_ids")
STATS = ("pairs", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
         "logps/rejected", "nll_loss", "log_odds_ratio")


@dataclass(frozen=True)
class Objective:
    """What the pairs are trained for: ``method`` dpo or orpo, and TRL's settings of the same names."""

    method: str
    beta: float = 0.1
    loss_type: str = "sigmoid"  # dpo: sigmoid | ipo
    label_smoothing: float = 0.0  # dpo sigmoid: conservative DPO


@dataclass
class SequenceLogps:
    """Per pair: summed answer log-probabilities and answer token counts [pairs, 2] (chosen, rejected); ORPO also
    the summed negative log-likelihood of the whole chosen sequence (prompt included, as TRL's ORPOTrainer)."""

    sums: torch.Tensor
    counts: torch.Tensor
    nll: torch.Tensor | None = None


def sequence_logps(model, batch: dict[str, torch.Tensor], with_nll: bool = False) -> SequenceLogps:
    side, labels, ids = batch["side"], batch["labels"], batch["input_ids"]
    # No KV cache: with one, transformers stops reading packed position ids as sequence bounds, and the rejected
    # answer would attend to the chosen one.
    inputs = {**{k: batch[k] for k in MODEL_INPUTS}, "use_cache": False}
    if "cu_seq_lens" in batch:
        inputs.update(varlen_inputs(batch))
    # The token at t+1 is predicted at t only within one sequence: never across the chosen/rejected boundary.
    same = (side[:, 1:] == side[:, :-1]) & (side[:, 1:] > 0)
    answer = same & (labels[:, 1:] != IGNORE)
    wanted = answer | (same & (side[:, 1:] == 1)) if with_nll else answer
    hidden, head = hidden_and_head(model, inputs)
    rows, cols = wanted.nonzero(as_tuple=True)
    logits = head(hidden[:, :-1][rows, cols]).float()  # only the positions that are scored: no full logits
    token_logps = torch.log_softmax(logits, -1).gather(1, ids[:, 1:][rows, cols][:, None]).squeeze(1)
    which = side[:, 1:][rows, cols] - 1
    is_answer = answer[rows, cols]
    sums = torch.zeros(ids.shape[0], 2, dtype=torch.float32, device=ids.device)
    sums.index_put_((rows, which), torch.where(is_answer, token_logps, 0.0), accumulate=True)
    counts = torch.zeros_like(sums).index_put_((rows, which), is_answer.float(), accumulate=True)
    nll = None
    if with_nll:
        nll = torch.zeros(ids.shape[0], dtype=torch.float32, device=ids.device)
        nll.index_put_((rows,), torch.where(which == 0, -token_logps, 0.0), accumulate=True)
    return SequenceLogps(sums, counts, nll)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def pair_losses(objective: Objective, policy: SequenceLogps, reference: SequenceLogps | None,
                nll_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(per-pair losses, per-pair statistics) from the log-probabilities. ORPO's likelihood term is the chosen
    sequences' token-mean NLL over the step (``nll_scale`` = step pairs / step chosen tokens, per row), so that the
    step's mean over pairs equals TRL's batch loss, nll mean + odds-ratio mean."""
    o = objective
    pc, pr = policy.sums.unbind(1)
    nc, nr = policy.counts.clamp(min=1).unbind(1)
    stats = {"logps/chosen": pc.detach(), "logps/rejected": pr.detach()}
    if o.method == "orpo":
        ac, ar = pc / nc, pr / nr  # ORPO's odds are of the per-token average probability
        log_odds = (ac - ar) - (log1mexp(ac) - log1mexp(ar))
        ratio = F.logsigmoid(log_odds)
        nll = cast(torch.Tensor, policy.nll) * cast(torch.Tensor, nll_scale)  # ORPO: both given
        losses = nll - o.beta * ratio
        chosen, rejected = o.beta * ac.detach(), o.beta * ar.detach()
        stats.update({"logps/chosen": ac.detach(), "logps/rejected": ar.detach(), "nll_loss": nll.detach(),
                      "log_odds_ratio": ratio.detach()})
    else:
        rc, rr = cast(SequenceLogps, reference).sums.unbind(1)  # DPO: the reference pass ran
        chosen_ratio, rejected_ratio = pc - rc, pr - rr
        if o.loss_type == "ipo":  # per-token average log-ratios, as TRL (the IPO authors' normalisation)
            losses = ((chosen_ratio / nc - rejected_ratio / nr) - 1 / (2 * o.beta)) ** 2
        else:
            margin = o.beta * (chosen_ratio - rejected_ratio)
            losses = -F.logsigmoid(margin) * (1 - o.label_smoothing) - F.logsigmoid(-margin) * o.label_smoothing
        chosen, rejected = o.beta * chosen_ratio.detach(), o.beta * rejected_ratio.detach()
    stats.update({"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen - rejected,
                  "rewards/accuracies": (chosen > rejected).float()})
    return losses, stats


class PreferenceLoss(KeepsStats):
    """The model and its pair loss as one module (DDP wraps it: its forward is the call that computes the loss).
    Statistics of every pair it sees are summed on the device (no synchronisation) until ``take_stats``."""

    def __init__(self, model, objective: Objective):
        super().__init__()
        self.model, self.objective = model, objective

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        losses, stats = self.pair_losses(batch)
        self.add_stats({**{k: v.sum() for k, v in stats.items()}, "pairs": losses.shape[0]})
        return losses.sum()

    def pair_losses(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        orpo = self.objective.method == "orpo"
        policy = sequence_logps(self.model, batch, with_nll=orpo)
        reference = None
        if not orpo:
            with torch.no_grad(), _adapter_off(self.model):
                reference = sequence_logps(self.model, batch)
        return pair_losses(self.objective, policy, reference, batch.get("nll_scale"))

    def take_stats(self) -> dict[str, float]:
        """The means over the pairs seen since the last call (one synchronisation), and reset."""
        stats, self._stats = self._stats, {}
        pairs = stats.pop("pairs", 0)
        if not pairs:
            return {}
        keys = list(stats)
        values = torch.stack([torch.as_tensor(stats[k], dtype=torch.float32) for k in keys]).tolist() if keys else []
        return {k: v / pairs for k, v in zip(keys, values)}


def _adapter_off(model):
    """DPO's reference: the base model, i.e. the same weights with the LoRA adapter switched off."""
    return model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()
