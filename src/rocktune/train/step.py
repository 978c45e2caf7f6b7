"""Forward and backward of one optimizer step, with out-of-memory recovery.

On an out-of-memory error (a GPU's, or a CPU allocation refused under an address-space or cgroup limit: see
oom.py) the step's gradients are dropped, every micro-batch is split into twice as many pieces (by the
feed, which knows what may not be separated: an LM example, a preference pair) and the step is run again: the
optimizer still sees exactly the same samples, and because the loss is normalised by the step's loss-bearing units
the update is the same up to summation order.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, cast

import torch

from rocktune.train.distributed import no_sync
from rocktune.train.guards import verify_transfer
from rocktune.train.oom import describe, is_out_of_memory

if TYPE_CHECKING:
    from rocktune.train.distributed import Dist
    from rocktune.train.faults import Faults
    from rocktune.train.guards import NumericGuard


class OutOfMemoryInGroup(RuntimeError):
    """Out of memory on one rank of several: a rank cannot split its share alone (the others are already waiting in
    the step's collectives), so the group stops and the supervisor restarts it from the last checkpoint; a repeat
    at the same step splits every forward."""


class OutOfMemoryAtMinimum(RuntimeError):
    """Out of memory with one example (or packed row) per forward: nothing left to split."""


def step_normalised(loss_sum: torch.Tensor, step_tokens: int) -> torch.Tensor:
    """Micro-batch loss for backward: its loss sum over the loss-bearing units (tokens, latent values) of the whole
    step, so that gradient accumulation gives the same update as one big batch however they fall into forwards."""
    return loss_sum / max(step_tokens, 1)


def split_by_rows(batch: dict[str, torch.Tensor], pieces: int) -> Sequence[dict[str, torch.Tensor]]:
    """Cut a micro-batch into ``pieces`` smaller forwards by rows: the split of a feed whose every tensor has one
    entry per independent row (a feed with another layout, e.g. LM packed rows, brings its own ``split``)."""
    if pieces == 1:
        return [batch]
    return RowPieces(batch, -(-batch_rows(batch) // pieces))


class RowPieces(Sequence):
    """``split_by_rows``'s pieces (views), each cut when it is asked for: the tripwire's probe takes only the first,
    and slicing every tensor of all 32 pieces of a GRPO step cost it a fifth of a millisecond."""

    def __init__(self, batch: dict[str, torch.Tensor], size: int):
        self.batch, self.size = batch, size

    def __len__(self) -> int:
        return -(-batch_rows(self.batch) // self.size)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        start = range(0, batch_rows(self.batch), self.size)[index]  # IndexError past the end ends an iteration
        return {k: v[start : start + self.size] for k, v in self.batch.items()}


def batch_rows(batch: dict[str, torch.Tensor]) -> int:
    return next(iter(batch.values())).shape[0]


@dataclass
class StepRunner:
    """What every forward/backward of a step needs, grouped: built once per run by the loop."""

    loss_of: torch.nn.Module  # the task's loss module (batch -> loss sum), or DDP around it
    device: str
    autocast: Callable[[], Any]  # () -> context manager
    scaler: torch.amp.GradScaler
    faults: Faults
    world: int = 1  # DDP averages gradients over ranks; the loss is scaled by world so they sum instead
    after_backward: Callable[[], None] | None = None  # after the step's last backward (FSDP: the adapter's all-reduce)
    lockstep_idle: dict | None = None  # FSDP: every rank runs the same number of forwards, padded with this batch
    # The update at the end of the step (finish_step):
    optimizer: torch.optim.Optimizer = cast("torch.optim.Optimizer", None)  # the loop always passes these
    scheduler: torch.optim.lr_scheduler.LRScheduler = cast("torch.optim.lr_scheduler.LRScheduler", None)
    params: list = field(default_factory=list)  # the trainable parameters: clipped together
    max_grad_norm: float | None = None
    guard: NumericGuard = cast("NumericGuard", None)
    dist: Dist = cast("Dist", None)


def forward_backward(run: StepRunner, micro: list[dict], step_tokens: int, pieces: int, step: int,
                     check_transfer: bool, split=split_by_rows) -> torch.Tensor:
    """Accumulate the step's gradients; returns this rank's summed token loss (not normalised) as a device scalar,
    so that no micro-batch waits for the device: the loop synchronises once per optimizer step. With DDP only the
    step's last backward all-reduces the gradients."""
    total = torch.zeros((), dtype=torch.float32, device=run.device)
    parts = [part for batch in micro for part in split(batch, pieces)]
    if run.lockstep_idle is not None:  # each forward gathers weights from every rank: all ranks run as many
        parts += [run.lockstep_idle] * (len(micro) * pieces - len(parts))
    for i, part in enumerate(parts):
        on_device = {k: run.faults.transfer(step, v.to(run.device, non_blocking=True)) for k, v in part.items()}
        if check_transfer:
            verify_transfer(part, on_device, step)
        run.faults.before_forward(step)  # tests: an injected OOM, possibly after earlier pieces accumulated
        with no_sync(run.loss_of, last=i == len(parts) - 1):
            with run.autocast():
                loss_sum = run.loss_of(on_device)
            loss_sum = run.faults.loss(step, loss_sum)
            run.scaler.scale(step_normalised(loss_sum, step_tokens) * run.world).backward()
        total += loss_sum.detach().float()
    if run.after_backward is not None:
        run.after_backward()
    return total


@dataclass
class Update:
    loss: float  # the step's loss, normalised by its loss-bearing tokens (all ranks)
    grad_norm: float
    stop: bool  # some rank was asked to stop (Ctrl-C, the supervisor's stop file)
    wait_s: float  # the host waiting for the device at the step's one synchronisation
    applied: bool  # False: the guard skipped a non-finite step


def finish_step(run: StepRunner, step_loss: torch.Tensor, step_tokens: int, asked: bool, step: int,
                zero_expected: tuple[str, ...] = ()) -> Update:
    """Clip, synchronise once (loss, stop request and gradient norm of every rank together), let the guard judge
    (``zero_expected``: what the feed says may be zero by construction, guards.NumericGuard.check), then update and
    advance the schedule."""
    from rocktune.train.distributed import reduce_step

    scaler, optimizer = run.scaler, run.optimizer
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(run.params, run.max_grad_norm or float("inf"))
    # Time spent here is the host waiting for the device; the rest of the step is the host's own work.
    t_wait = time.perf_counter()
    reduced = reduce_step(run.dist, step_loss, asked, step)
    loss_sum, stop_any, grad_norm = torch.cat([reduced, norm.float()[None]]).tolist()
    wait_s = time.perf_counter() - t_wait
    loss = loss_sum / max(step_tokens, 1)
    # An fp16 overflow (finite loss, inf gradient) is the GradScaler's business: it skips and rescales.
    overflow = scaler.is_enabled() and math.isfinite(loss) and not math.isfinite(grad_norm)
    applied = overflow or run.guard.check(step, loss, grad_norm, zero_expected)
    if applied:
        scaler.step(optimizer)
    scaler.update()
    run.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return Update(loss, grad_norm, stop_any > 0, wait_s, applied)


def is_compile_error(exc: BaseException) -> bool:
    """A failure of torch.compile itself (Dynamo tracing, Inductor/Triton code generation), not of the model."""
    return type(exc).__module__.startswith(("torch._dynamo", "torch._inductor"))


def run_with_oom_recovery(attempt, optimizer, pieces: int, max_rows: int, log, on_compile_error=None,
                          alone: bool = True) -> tuple[torch.Tensor, int]:
    """Call ``attempt(pieces)`` until it fits; returns (its result, the pieces that worked). A compile failure is
    handed to ``on_compile_error`` (which turns compilation off) and the step is run again, once. ``alone=False``
    (one rank of several): nothing is retried here, since the other ranks cannot follow."""
    while True:
        try:
            return attempt(pieces), pieces
        except Exception as exc:
            if not is_out_of_memory(exc):
                if on_compile_error is None or not is_compile_error(exc):
                    raise
                on_compile_error(exc)
                on_compile_error = None
                optimizer.zero_grad(set_to_none=True)
                continue
            message = describe(exc)
            if not alone:
                raise OutOfMemoryInGroup(f"{message}: the group restarts from its last checkpoint") from None
        # Outside the except block: the traceback no longer pins the failed step's tensors, so they can be freed.
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if pieces >= max_rows:
            raise OutOfMemoryAtMinimum(message)
        pieces *= 2
        log(f"[yellow]out of memory: retrying the step with each micro-batch split in {pieces} "
            f"(same samples per optimizer step)[/]")
