"""A run checks its own training path: at its first two steps (a resumed run's too), then every
``reliability.check_path_every`` steps.

Two checks, both cheap next to a step:

- the path against the reference: one small piece of the step's first micro-batch (the feed's smallest split: one
  example, one pair) through the run's own forward and backward (its side path, its compiled graph, the fast kernels
  its recurrent layers chose), then through PEFT's own eager forward on the same adapter values
  (rocktune.lora.check.reference_mode; a task loss's own faster forward, e.g. GRPO's shared prompt, off too: its
  ``plain_path``; Gated DeltaNet and Mamba2 layers on transformers' torch kernels: rocktune.kernels.recurrent);
  losses and adapter gradients must agree within the precision's rounding (lora_check.TOLERANCE), and every adapter
  tensor the reference gives a gradient must get one. Where they do not and recurrent layers run fast kernels, the
  run's path is probed once more with the torch kernels: agreeing then, the kernels are the cause (a kernel that
  passed its small self-test at load and fails on the run's own shapes);
- the update: an applied optimizer step with a learning rate and a gradient must move the adapter.

A disagreement stops the run (exit 4, never retried) with its cause named: the compiler dropped the adapter's
gradients, the forward kept an old adapter (a stale cast), the optimizer did not update, a kernel computes wrong
values, or a recurrent layer's fast kernel does. The step's accumulated gradients are set aside while the probe runs
and put back after it, and the probe forks the RNG, so a run with the tripwire trains exactly as one without it: the
same losses, adapters, resume.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rocktune.kernels import recurrent
from rocktune.lora import check as lora_check
from rocktune.train.distributed import no_sync
from rocktune.train.guards import DOCTOR_HINT, FatalNumerics
from rocktune.train.oom import is_out_of_memory


class TrainingPathWrong(FatalNumerics):
    """The run's own training path disagrees with the reference: its updates cannot be trusted."""


_FIX = {
    "no-gradient": "{what} computes no gradient for adapter tensors that PEFT's reference forward gives one{hint}",
    "stale": "the run's forward matched PEFT's reference before the first update and not after it: it keeps an old "
             "adapter (a cast or cache that the optimizer's update did not reach){hint}",
    "no-update": "the optimizer step left the adapter unchanged although the learning rate and the gradient are not "
                 "zero (training.optimizer={optimizer}: try adamw_torch)",
    "mismatch": "{what} computes other values than PEFT's reference forward on the same adapter: a wrong kernel or "
                "cast on this device{hint}",
    "recurrent": "the recurrent layers' fast kernels ({kernels}) compute other values than transformers' torch "
                 "functions on this run's batch (the same path with the torch functions in their place agrees with "
                 "PEFT's reference): uninstall {packages} to train on transformers' torch path, and report it with "
                 "the output of `rocktune doctor`",
}


def probe_piece(feed, batch: dict) -> dict:
    """The probe's rows: the feed's own choice where it has one (``probe_piece``: e.g. GRPO's two completions of one
    prompt, which run its shared-prompt forward where one row would share nothing), else the first piece of its
    smallest split (split_by_rows cuts only the piece it is asked for)."""
    own = getattr(feed, "probe_piece", None)
    return own(batch) if own is not None else feed.split(batch, feed.max_pieces(batch))[0]


@dataclass
class Tripwire:
    """What the checks need from the run, grouped: built once by the loop."""

    model: torch.nn.Module  # the PEFT model (the reference mode switches its layers)
    loss_of: torch.nn.Module  # the task's loss module: batch -> summed loss
    device: str
    autocast: Callable[[], Any]  # () -> context manager
    precision: str
    optimizer_kind: str
    feed: Callable[[], Any]  # () -> the run's feed: its probe_piece(batch), else its split and max_pieces
    every: int = 0
    compiled: Callable[[], bool] = lambda: False  # () -> bool: the decoder is compiled now (a fallback turns it off)
    first: int = 1  # this process's first step (a resumed run checks its own first two steps too)
    passed: list[int] = field(default_factory=list)  # steps whose probe agreed with the reference
    snapshot: list | None = None  # (adapter tensor, its value before the update) of a due step
    kernels: list = field(default_factory=list)  # the recurrent layers' fast kernels a failed probe blames

    def due(self, step: int) -> bool:
        return step < self.first + 2 or bool(self.every and step % self.every == 0)

    def check_path(self, step: int, batch: dict, log) -> None:
        """Between the step's backward and its update: probe the path against the reference, then keep the adapter's
        values to judge the update by (``check_update``)."""
        if not self.due(step):
            return
        adapter = lora_check.adapter_params(self.model)  # once per check: a walk of every module
        params = list(adapter.values())
        self.snapshot = [(p, p.detach().clone()) for p in params]
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            problems = self._probe(batch, adapter)
        except Exception as exc:  # noqa: BLE001 -- a check that does not fit must not end a run that does
            if not is_out_of_memory(exc):
                raise
            log(f"[yellow]step {step}: the training-path check was skipped: its probe ran out of memory[/]")
            problems = []
        finally:
            for p, g in zip(params, held):
                p.grad = g
        if problems:
            raise TrainingPathWrong(self._message(step, problems))
        self.passed.append(step)

    def check_update(self, step: int, applied: bool, lr: float, grad_norm: float) -> None:
        """After the update of a due step: an applied step with a learning rate and a gradient moved the adapter."""
        before, self.snapshot = self.snapshot, None
        if before is None or not applied or lr == 0.0 or not grad_norm:
            return
        if all(torch.equal(p.detach(), b) for p, b in before):
            raise TrainingPathWrong(self._message(step, [lora_check.Problem("no-update", "")]))

    def _probe(self, batch: dict, adapter: dict) -> list[lora_check.Problem]:
        piece = probe_piece(self.feed(), batch)
        on_device = {k: v.to(self.device) for k, v in piece.items()}

        def loss_fn(_model):
            return self.loss_of(on_device)

        inner = getattr(self.loss_of, "module", self.loss_of)  # DDP's wrapped module
        apart = getattr(inner, "separate_stats", contextlib.nullcontext)  # train/task.KeepsStats
        with no_sync(self.loss_of, last=False), apart():  # the probe's gradients and statistics are not the step's
            got = lora_check.probe(self.model, loss_fn, self.autocast, params=adapter)
            plain = getattr(inner, "plain_path", contextlib.nullcontext)  # a task's own faster forward off too
            with lora_check.reference_mode(self.model), recurrent.reference(), plain():
                ref = lora_check.probe(self.model, loss_fn, self.autocast, params=adapter)
            problems = lora_check.compare_probe(got, ref, self.precision)
            if problems:
                self.kernels = self._wrong_kernels(lambda: lora_check.probe(self.model, loss_fn, self.autocast,
                                                                            params=adapter), ref)
        return problems

    def _wrong_kernels(self, probe: Callable[[], lora_check.Probe], ref: lora_check.Probe) -> list:
        """After a failed probe of a model whose recurrent layers run fast kernels: those to blame, found by probing
        the run's path again with transformers' torch kernels, all of them and then one at a time (none: the side
        path or compiled graph is wrong, or the kernels and it both are)."""
        fast = recurrent.fast_kernels(self.model)
        if not fast:
            return []
        with recurrent.reference():
            if lora_check.compare_probe(probe(), ref, self.precision):
                return []
        alone = []
        for kernel in fast:
            with recurrent.reference([kernel]):
                if not lora_check.compare_probe(probe(), ref, self.precision):
                    alone.append(kernel)
        return alone or fast

    def _message(self, step: int, problems: list[lora_check.Problem]) -> str:
        compiled = self.compiled()
        what = "the compiled graph (torch.compile)" if compiled else "the LoRA side path"
        hint = (": set training.compile=false to train eagerly, and report the torch version" if compiled
                else f"; {DOCTOR_HINT}")
        # A path that agreed before an update and not after it keeps an old adapter: that is the cause, and the
        # missing gradients it may bring (an old lora_B of zeros gives lora_A none) follow from it.
        stale = bool(self.passed) and any(p.cause == "mismatch" for p in problems)
        named = sorted(((("stale" if stale and p.cause == "mismatch" else p.cause), p) for p in problems),
                       key=lambda cp: list(_FIX).index(cp[0]) if cp[0] != "stale" else -1)
        if self.kernels:  # the path agrees with the torch kernels: the fast ones are the cause, whatever it looked like
            named = [("recurrent", lora_check.Problem("recurrent", "; ".join(str(p) for _, p in named)))]
        packages = sorted({recurrent.DISTRIBUTION.get(k.package, k.package) for k in self.kernels})
        causes = [_FIX[cause].format(what=what, hint=hint, optimizer=self.optimizer_kind,
                                     kernels=", ".join(f"{k.name} ({k.package})" for k in self.kernels),
                                     packages=" and ".join(packages))
                  + (f" ({p.detail})" if p.detail else "") for cause, p in named]
        return (f"step {step}: the training path check failed, so this run's updates cannot be trusted and it stops "
                f"before wasting more time. " + " Also: ".join(causes) + ". `rocktune doctor --model PATH` runs "
                "the same comparison for a few steps.")
