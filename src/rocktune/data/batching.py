"""Micro-batches of whole examples, and the order an epoch walks them in.

``data.batch_order`` chooses how an epoch's examples are cut into micro-batches:

- ``mixed`` (the default): each length is blurred upward by a random amount, up to ``MIX_TOKENS`` plus
  ``MIX_SHARE`` of itself and drawn anew each epoch, before each window is sorted. Examples whose lengths differ by
  a few tokens (a label, a class, a short reply) then meet in micro-batches at random, as a shuffled loop mixes
  them, so a micro-batch does not hold one answer; lengths far apart stay apart (a 900-token chat never waits on a
  60-token one), so the padding stays near the sorted order's. Hard bins were tried first: their edges split
  near-equal lengths about half the epochs and learned worse than shuffled (docs/speed.md).
- ``length``: each window of examples sorted by length before it is cut (the least padding). Where the answer
  decides the length, most micro-batches hold a single answer and each step pushes toward it: docs/speed.md
  measures what that costs. Runs started before ``batch_order`` existed keep it on resume (train/resume.py).
- ``shuffled``: what ``DataLoader(shuffle=True)`` does; the most padding.

The batch order of an epoch is a pure function of (seed, epoch), which is what makes exact resume possible:
a run restarted at (epoch, batch index) sees the very batches an uninterrupted run would.
"""

from __future__ import annotations

import random
from typing import Literal, get_args

import torch

from rocktune.data.encode import IGNORE

BatchOrder = Literal["mixed", "length", "shuffled"]
BATCH_ORDERS: tuple[str, ...] = get_args(BatchOrder)
BUCKET_FACTOR = 64  # batches per sorting window: large enough to group lengths, small enough to stay random
# mixed: a length is blurred by up to MIX_TOKENS + MIX_SHARE of itself before the sort, so examples whose lengths
# differ by much less than that meet in micro-batches at random, and a micro-batch spans about that much padding
MIX_TOKENS = 64
MIX_SHARE = 0.25


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int,
                  order: BatchOrder = "mixed") -> list[list[int]]:
    """Index lists for one epoch: shuffle; unless ``shuffled``, sort each window by length (``length``) or by the
    blurred length (``mixed``); cut into batches; shuffle the batches."""
    rng = random.Random(f"{seed}:{epoch}")
    shuffled = list(range(len(lengths)))
    rng.shuffle(shuffled)
    if order == "shuffled":
        return [shuffled[i : i + batch_size] for i in range(0, len(shuffled), batch_size)]
    if order == "length":
        def key(i):
            return lengths[i]
    else:  # mixed: each length blurred upward by up to its own spread, drawn for this epoch
        blurred = [n + rng.random() * (MIX_TOKENS + MIX_SHARE * n) for n in lengths]

        def key(i):
            return blurred[i]
    window = batch_size * BUCKET_FACTOR
    batches: list[list[int]] = []
    for start in range(0, len(shuffled), window):
        # sorted() is stable: examples of equal key keep their shuffled order
        chunk = sorted(shuffled[start : start + window], key=key, reverse=True)
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def padding_share(lengths: list[int], batches: list[list[int]]) -> float:
    """Padded positions over all positions when each batch is padded to its longest example."""
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1 - sum(lengths[i] for b in batches for i in b) / padded


def collate(input_ids: list[list[int]], labels: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example of the batch (not to max_length)."""
    width = max(len(x) for x in input_ids)
    ids = torch.full((len(input_ids), width), pad_id, dtype=torch.long)
    lab = torch.full((len(input_ids), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(input_ids), width), dtype=torch.long)
    for row, (x, y) in enumerate(zip(input_ids, labels)):
        ids[row, : len(x)] = torch.tensor(x)
        lab[row, : len(y)] = torch.tensor(y)
        mask[row, : len(x)] = 1
    return {"input_ids": ids, "labels": lab, "attention_mask": mask}


def count_loss_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry loss after the causal shift: label positions 1.. that are not ignored."""
    return int((labels[:, 1:] != IGNORE).sum())


LOSS_KEYS = ("loss_index", "loss_targets")


def loss_token_counts(labels: list[list[int]]) -> list[int]:
    """Loss-bearing tokens of each example after the causal shift: what ``count_loss_tokens`` counts for it in a
    padded batch or in a packed row (whose first label is masked anyway), so a step's count needs no collation."""
    if hasattr(labels, "loss_counts"):  # rows of the mapped cache: counted on the flat array
        return labels.loss_counts().tolist()
    return [sum(1 for y in row[1:] if y != IGNORE) for row in labels]


def with_loss_index(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add the loss positions (flat indices into the shifted ``(rows, width - 1)`` grid) and their targets, computed
    on the host. The device then gathers a known number of rows: a boolean mask on the device would make the host
    wait for the GPU to learn the output size, once per forward."""
    shifted = batch["labels"][:, 1:]
    index = (shifted != IGNORE).flatten().nonzero().flatten()
    return {**batch, "loss_index": index, "loss_targets": shifted.flatten()[index]}


class BatchStream:
    """Endless stream of micro-batches over epochs; its position is two integers (epoch, index).

    ``make_epoch(epoch)`` returns that epoch's batches and must be a pure function of the epoch number.
    """

    def __init__(self, make_epoch, epoch: int = 0, index: int = 0):
        self.make_epoch = make_epoch
        self.epoch, self.index = epoch, index
        self._batches = make_epoch(epoch)

    def __len__(self) -> int:
        """Micro-batches per epoch."""
        return len(self._batches)

    def next(self):
        if self.index >= len(self._batches):
            self.epoch, self.index = self.epoch + 1, 0
            self._batches = self.make_epoch(self.epoch)
        batch = self._batches[self.index]
        self.index += 1
        return batch

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}
