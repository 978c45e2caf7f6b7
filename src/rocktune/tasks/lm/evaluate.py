"""Eval loss: token-weighted mean over a fixed, length-sorted pass of the eval examples."""

from __future__ import annotations

import torch

from rocktune.data.batching import collate, with_loss_index
from rocktune.data.dataset import Examples
from rocktune.tasks.causal.loss import LossModule


@torch.no_grad()
def eval_sums(loss: LossModule, examples: Examples, batch_size: int, pad_id: int, device: str,
              autocast) -> tuple[float, int]:
    """(summed token loss, loss-bearing tokens) over ``examples``: several ranks add theirs before dividing. ``loss``
    is the training's loss module (its chunk size, path and compiled or not), called outside any DDP wrapper."""
    if len(examples) == 0:
        return 0.0, 0
    model = loss.model
    was_training = model.training
    model.eval()
    lengths = examples.lengths()  # from the cache's offsets: no row is read to sort them
    order = sorted(range(len(examples)), key=lengths.__getitem__)
    total: float | torch.Tensor
    total, tokens = 0.0, 0
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = with_loss_index(collate([examples.input_ids[i] for i in idx], [examples.labels[i] for i in idx],
                                        pad_id))  # loss positions from the host, as in training: no size syncs
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast():
            loss_sum, n = loss.sum_and_count(batch)
        total += loss_sum.detach().float()  # on the device: one synchronisation at the end, not one per batch
        tokens += n
    model.train(was_training)
    return float(total), tokens
