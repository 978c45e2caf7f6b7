"""What each optimizer step of a preference run feeds the model: micro-batches of pairs, one pair per row.

A row is the pair packed: prompt + chosen, then prompt + rejected, each restarting its position ids (and, for varlen
attention, its own document bounds), so the two never attend to each other yet share one forward. Whatever cuts
the work — micro-batches, the OOM split, the shares of several ranks — cuts between rows, never inside one: a
chosen answer is never separated from its rejected twin.
"""

from __future__ import annotations

import torch

from rocktune.data.batching import BatchOrder, BatchStream, epoch_batches
from rocktune.data.packing import collate_packed, cut_segments
from rocktune.tasks.preference.pairs import PairSet
from rocktune.tasks.causal.feed import Step, StreamPosition


def collate_pairs(pairs: PairSet, idx: list[int], pad_id: int, nll_scale: float, segments: bool) -> dict:
    """Host tensors for the pairs ``idx``: the packed rows, ``side`` (1 chosen, 2 rejected, 0 padding) and, per
    row, ORPO's likelihood weight ``nll_scale`` (every tensor has one entry per pair: a split by rows is exact)."""
    picked = [pairs.pairs[i] for i in idx]
    out = collate_packed([[p.chosen, p.rejected] for p in picked], pad_id, 0, segments)
    side = torch.zeros_like(out["input_ids"], dtype=torch.int8)
    for r, p in enumerate(picked):
        c, rj = len(p.chosen[0]), len(p.rejected[0])
        side[r, :c], side[r, c : c + rj] = 1, 2
    out["side"] = side.long()
    out["nll_scale"] = torch.full((len(picked),), nll_scale, dtype=torch.float32)
    return out


def idle_pairs(pad_id: int) -> dict:
    """One pad token scoring nothing: a rank whose share of a small step is empty still runs a forward (DDP)."""
    ids = torch.tensor([[pad_id]])
    return {"input_ids": ids, "labels": torch.full_like(ids, -100), "position_ids": torch.zeros_like(ids),
            "side": torch.zeros_like(ids), "nll_scale": torch.zeros(1)}


def split_pairs(batch: dict, pieces: int) -> list[dict]:
    """The OOM split: by rows, i.e. by whole pairs."""
    rows = batch["input_ids"].shape[0]
    if pieces == 1 or rows == 1:
        return [batch]
    cu = batch.get("cu_seq_lens")
    rest = {k: v for k, v in batch.items() if k != "cu_seq_lens"}
    size, width = -(-rows // pieces), batch["input_ids"].shape[1]
    parts = []
    for i in range(0, rows, size):
        part = {k: v[i : i + size] for k, v in rest.items()}
        if cu is not None:
            part["cu_seq_lens"] = cut_segments(cu, i * width, min(i + size, rows) * width)
        parts.append(part)
    return parts


class PairFeed(StreamPosition):
    """One optimizer step at a time: ``grad_accum`` micro-batches of ``pairs_per_forward`` pairs (in ``order``,
    data.batch_order), dealt round-robin to the ranks; the step's normaliser is its number of pairs (every rank's)."""

    split = staticmethod(split_pairs)

    def __init__(self, pairs: PairSet, pairs_per_forward: int, grad_accum: int, seed: int, collate,
                 share=(0, 1, None), epoch: int = 0, index: int = 0, order: BatchOrder = "mixed"):
        self.pairs, self.grad_accum, self.collate = pairs, grad_accum, collate
        self.rank, self.world, self.idle = share
        lengths = pairs.lengths()
        self.stream = BatchStream(lambda e: epoch_batches(lengths, pairs_per_forward, seed, e, order), epoch, index)
        self._items_per_step = grad_accum
        self._position, self._epoch = self.stream.position(), self.stream.epoch

    def next(self) -> Step:
        items = [self.stream.next() for _ in range(self.grad_accum)]
        self._position, self._epoch = self.stream.position(), self.stream.epoch
        every = [i for item in items for i in item]
        # ORPO's likelihood term is the token mean over the step's chosen sequences (TRL's batch): each row's weight
        chosen_tokens = sum(len(self.pairs.pairs[i].chosen[0]) - 1 for i in every)
        scale = len(every) / max(chosen_tokens, 1)
        mine = items[self.rank :: self.world]
        forwards = [self.collate(item, scale) for item in mine] or [self.idle]
        real = sum(self.pairs.pairs[i].length for item in mine for i in item)
        return Step(mine, forwards, len(every), real)

    def max_pieces(self, batch: dict) -> int:
        return batch["input_ids"].shape[0]

    def close(self) -> None:
        """Nothing to release: batches are collated in the step that uses them."""
