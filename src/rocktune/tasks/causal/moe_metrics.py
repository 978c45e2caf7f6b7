"""Router and balance of a mixture-of-experts model, as step metrics: the expert load and the auxiliary loss.

A forward hook on every router (``models.routers``) reads what the router decided; ``step_metrics`` turns one
optimizer step's calls into the metrics.jsonl fields:

- ``expert_load``: tokens routed to each expert in this step, summed over the MoE layers (one list entry per
  expert). The tokens are those the router saw, padding included; on several processes, every rank's (the step's
  counts are summed across the ranks, so a run on two processes logs what one process would).
- ``experts_idle``: (layer, expert) pairs that received no token in this step.
- ``router_aux_loss``: the family's load-balancing loss (transformers' ``load_balancing_loss_func``, the Switch
  Transformer's: experts x the sum over experts of (share of top-k picks) x (mean router probability)) over all the
  step's tokens and layers, for the families whose transformers code has one (not GLM-4.5 or Llama 4). It is
  logged, not added to the loss: the routers are frozen unless ``lora.train_router``. The shares and means are
  summed as the step runs, so no layer's logits are held until the step ends (the library function takes them all
  at once); tests/test_moe_router.py checks the two agree.

An expert that receives no token in ``patience`` steps in a row is said in the console once. The hook counts a
training forward only: not an eval pass or a sample generation (no gradients), and not the recomputation of a
checkpointed layer in backward (that forward ran already), nor the training-path tripwire's probe (``keep_apart``).
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from rocktune.models.routers import num_experts, router_modules, routing, top_k

PATIENCE = 50  # steps without a token before an expert is said to be idle


@dataclass
class _Sums:
    """One router's (one layer's) counts since the last step ended."""

    picks: torch.Tensor  # tokens per expert (int64)
    probs: torch.Tensor  # sum over tokens of the softmax of the logits (fp32)
    tokens: int = 0


@dataclass
class RouterWatch:
    names: list[str]
    experts: int
    top_k: int
    aux: bool  # the family's transformers code has a load-balancing loss
    log: Callable[[str], object] | None = None  # the console's log (bar.log): where an idle expert is said
    patience: int = PATIENCE
    sums: dict[int, _Sums] = field(default_factory=dict)
    idle_steps: torch.Tensor | None = None  # (layers, experts): steps in a row without a token
    said: set[tuple[int, int]] = field(default_factory=set)
    handles: list = field(default_factory=list)

    @classmethod
    def attach(cls, model, log=None, patience: int = PATIENCE) -> RouterWatch | None:
        """Hooks on the routers of ``model`` (a PEFT or transformers model); None when it has none (a dense model)."""
        found = router_modules(model)
        if not found:
            return None
        first = found[0][1]
        watch = cls([n for n, _ in found], num_experts(first), top_k(first), _has_aux(model), log, patience)
        for layer, (_, module) in enumerate(found):
            watch.handles.append(module.register_forward_hook(watch._hook(layer)))
        return watch

    def _hook(self, layer: int):
        @torch.compiler.disable  # a compiled decoder runs the hook eagerly (a graph break per router), not traced
        def hook(module, args, output):
            if not torch.is_grad_enabled() or _in_backward():
                return
            logits, chosen = routing(module, output, args)
            s = self.sums.get(layer)
            if s is None:
                s = self.sums[layer] = _Sums(torch.zeros(self.experts, dtype=torch.int64, device=logits.device),
                                             torch.zeros(self.experts, dtype=torch.float32, device=logits.device))
            s.picks += torch.bincount(chosen.reshape(-1), minlength=self.experts)[: self.experts]
            s.probs += torch.softmax(logits.float(), -1).sum(0)
            s.tokens += logits.shape[0]
        return hook

    def step_metrics(self) -> dict:
        """The step's fields for metrics.jsonl (empty when no training forward ran); resets the sums."""
        if not self.sums:
            return {}
        layers = sorted(self.sums)
        picks, probs, n = _across_ranks(torch.stack([self.sums[i].picks for i in layers]),  # (layers, experts)
                                        torch.stack([self.sums[i].probs for i in layers]),
                                        sum(self.sums[i].tokens for i in layers))
        out = {"expert_load": picks.sum(0).tolist(), "experts_idle": int((picks == 0).sum())}
        if self.aux:
            out["router_aux_loss"] = self._aux_loss(picks, probs, n)
        self._watch_idle(layers, picks)
        self.sums.clear()
        return out

    def _aux_loss(self, picks: torch.Tensor, probs: torch.Tensor, n: int) -> float:
        share = picks.sum(0).float() / (n * self.top_k)
        mean_prob = probs.sum(0) / n
        # load_balancing_loss_func's tokens_per_expert is (top-k, experts); summed over the top-k slots it is the
        # share of picks x top-k, which the top_k factor restores
        return float((share * self.top_k * mean_prob).sum() * self.experts)

    def _watch_idle(self, layers: list[int], picks: torch.Tensor) -> None:
        if self.idle_steps is None or self.idle_steps.shape != picks.shape:
            self.idle_steps = torch.zeros(picks.shape, dtype=torch.int64)
        self.idle_steps = torch.where(picks == 0, self.idle_steps + 1, 0)
        new = [(layers[li], e) for li, e in (self.idle_steps >= self.patience).nonzero().tolist()
               if (layers[li], e) not in self.said]
        if new and self.log is not None:
            where = ", ".join(f"{self.names[li]} expert {e}" for li, e in new[:8])
            more = f" and {len(new) - 8} more" if len(new) > 8 else ""
            self.log(f"[yellow]{len(new)} expert(s) received no token for {self.patience} steps: {where}{more}. "
                     "Their adapters do not train; the expert load is in metrics.jsonl and rocktune report.[/]")
        self.said.update(new)

    def state(self) -> dict:
        """The idle streaks and the experts already said, for a checkpoint (JSON): a resumed run says what the
        uninterrupted one does."""
        return {"idle_steps": None if self.idle_steps is None else self.idle_steps.tolist(),
                "said": sorted(list(pair) for pair in self.said)}

    def load_state(self, state: dict) -> None:
        if state.get("idle_steps") is not None:
            self.idle_steps = torch.tensor(state["idle_steps"], dtype=torch.int64)
        self.said = {(int(layer), int(e)) for layer, e in state.get("said", [])}

    @contextlib.contextmanager
    def separate(self):
        """Forwards that are not the step's own (the training-path tripwire's probe) count apart and are dropped."""
        outer, self.sums = self.sums, {}
        try:
            yield
        finally:
            self.sums = outer

    def keep_apart(self, loss_module) -> None:
        """Joins ``separate`` to the loss module's ``separate_stats`` (train/task.KeepsStats' protocol), which the
        engine enters around calls that are not the step's own."""
        own = getattr(loss_module, "separate_stats", None)

        @contextlib.contextmanager
        def both():
            with self.separate(), (own() if own is not None else contextlib.nullcontext()):
                yield

        loss_module.separate_stats = both

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _in_backward() -> bool:
    """Inside autograd's backward: a checkpointed layer recomputing its forward (torch has no public flag)."""
    return torch._C._current_graph_task_id() != -1


def _has_aux(model) -> bool:
    """Whether the family's transformers modeling module has the load-balancing loss."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    module = importlib.import_module(type(base).__module__)
    return hasattr(module, "load_balancing_loss_func")


def _across_ranks(picks: torch.Tensor, probs: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The step's counts of every rank, on the CPU. Every rank records every step (tasks/lm/task.py's ``record``
    runs on all of them), so the sums meet in one collective of a few hundred numbers."""
    import torch.distributed as td

    if td.is_available() and td.is_initialized() and td.get_world_size() > 1:
        flat = torch.cat([picks.double().reshape(-1), probs.double().reshape(-1),
                          torch.tensor([float(tokens)], dtype=torch.float64, device=picks.device)])
        td.all_reduce(flat)
        k = picks.numel()
        picks = flat[:k].round().to(torch.int64).reshape(picks.shape)
        probs = flat[k:2 * k].to(torch.float32).reshape(probs.shape)
        tokens = int(flat[-1].item())
    return picks.cpu(), probs.cpu(), tokens

