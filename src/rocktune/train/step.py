"""Forward and backward of one optimizer step, with out-of-memory recovery.

On a device OOM the step's gradients are dropped, every micro-batch is split into twice as many pieces and the step
is run again: the optimizer still sees exactly the same samples, and because the loss is normalised by the step's
loss-bearing tokens the update is the same up to summation order.
"""

from __future__ import annotations

import gc

import torch

from rocktune.data.batching import LOSS_KEYS, with_loss_index
from rocktune.train.guards import verify_transfer
from rocktune.train.loss import causal_lm_loss_sum, step_normalised


# torch.OutOfMemoryError appeared in torch 2.5; gfx906 users run 2.4.1, where only the cuda alias exists.
DEVICE_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class OutOfMemoryAtMinimum(RuntimeError):
    """Out of memory with one example (or packed row) per forward: nothing left to split."""


def split_rows(batch: dict[str, torch.Tensor], pieces: int) -> list[dict[str, torch.Tensor]]:
    """Cut a micro-batch into ``pieces`` smaller forwards: by rows, or, for one packed row (flash-attention),
    at example starts (position id 0) so that no example is cut. Host-side loss indices are recomputed per piece."""
    if pieces == 1:
        return [batch]
    indexed = "loss_index" in batch
    batch = {k: v for k, v in batch.items() if k not in LOSS_KEYS}
    rows = batch["input_ids"].shape[0]
    if rows == 1 and "position_ids" in batch:
        starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
        cuts = sorted({starts[i * len(starts) // pieces] for i in range(pieces)}) + [batch["input_ids"].shape[1]]
        parts = [{k: v[:, a:b] for k, v in batch.items()} for a, b in zip(cuts, cuts[1:])]
    else:
        size = -(-rows // pieces)
        parts = [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, rows, size)]
    return [with_loss_index(p) for p in parts] if indexed else parts


def max_pieces(batch: dict[str, torch.Tensor]) -> int:
    """How finely ``split_rows`` can cut this micro-batch: rows, or the examples of a single packed row."""
    if batch["input_ids"].shape[0] == 1 and "position_ids" in batch:
        return int((batch["position_ids"][0] == 0).sum())
    return batch["input_ids"].shape[0]


def forward_backward(model, micro: list[dict], step_tokens: int, pieces: int, device: str, autocast, scaler,
                     chunk_size: int, fast_loss: bool, faults, step: int, check_transfer: bool) -> torch.Tensor:
    """Accumulate the step's gradients; returns the summed token loss (not normalised) as a device scalar, so
    that no micro-batch waits for the device: the loop synchronises once per optimizer step."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for batch in micro:
        for part in split_rows(batch, pieces):
            on_device = {k: faults.transfer(step, v.to(device, non_blocking=True)) for k, v in part.items()}
            if check_transfer:
                verify_transfer(part, on_device, step)
            faults.before_forward(step)  # tests: an injected OOM, possibly after earlier pieces accumulated
            with autocast():
                loss_sum, _ = causal_lm_loss_sum(model, on_device, chunk_size, fast=fast_loss)
            loss_sum = faults.loss(step, loss_sum)
            scaler.scale(step_normalised(loss_sum, step_tokens)).backward()
            total += loss_sum.detach().float()
    return total


def is_compile_error(exc: BaseException) -> bool:
    """A failure of torch.compile itself (Dynamo tracing, Inductor/Triton code generation), not of the model."""
    return type(exc).__module__.startswith(("torch._dynamo", "torch._inductor"))


def run_with_oom_recovery(attempt, optimizer, pieces: int, max_rows: int, log, on_compile_error=None
                          ) -> tuple[torch.Tensor, int]:
    """Call ``attempt(pieces)`` until it fits; returns (its result, the pieces that worked). A compile failure is
    handed to ``on_compile_error`` (which turns compilation off) and the step is run again, once."""
    while True:
        try:
            return attempt(pieces), pieces
        except DEVICE_OOM as exc:
            message = str(exc).splitlines()[0] if str(exc) else "out of memory"
        except Exception as exc:
            if on_compile_error is None or not is_compile_error(exc):
                raise
            on_compile_error(exc)
            on_compile_error = None
            optimizer.zero_grad(set_to_none=True)
            continue
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
