"""How the OOM split cuts an LM forward (the engine asks the feed, train/step.py): by rows, or, for one packed row
(flash-attention), at example starts, so that no example is cut. Host-side loss indices and varlen document bounds
are recomputed per piece."""

from __future__ import annotations

import torch

from rocktune.data.batching import LOSS_KEYS, with_loss_index
from rocktune.data.packing import cut_segments


def split_rows(batch: dict[str, torch.Tensor], pieces: int) -> list[dict[str, torch.Tensor]]:
    if pieces == 1:
        return [batch]
    indexed = "loss_index" in batch
    cu = batch.get("cu_seq_lens")  # document bounds of the flat tokens (varlen attention): cut, not sliced by row
    batch = {k: v for k, v in batch.items() if k not in (*LOSS_KEYS, "cu_seq_lens")}
    rows = _rows(batch)
    if rows == 1 and "position_ids" in batch:
        starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
        cuts = sorted({starts[i * len(starts) // pieces] for i in range(pieces)}) + [batch["input_ids"].shape[1]]
        parts = [{k: v[:, a:b] for k, v in batch.items()} for a, b in zip(cuts, cuts[1:])]
        spans = list(zip(cuts, cuts[1:]))
    else:
        size = -(-rows // pieces)
        parts = [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, rows, size)]
        width = batch["input_ids"].shape[1] if cu is not None else 0
        spans = [(i * width, min(i + size, rows) * width) for i in range(0, rows, size)]
    if cu is not None:
        parts = [{**p, "cu_seq_lens": cut_segments(cu, a, b)} for p, (a, b) in zip(parts, spans)]
    return [with_loss_index(p) for p in parts] if indexed else parts


def max_pieces(batch: dict[str, torch.Tensor]) -> int:
    """How finely ``split_rows`` can cut this micro-batch: rows, or the examples of a single packed row."""
    if _rows(batch) == 1 and "position_ids" in batch:
        return int((batch["position_ids"][0] == 0).sum())
    return _rows(batch)


def _rows(batch: dict[str, torch.Tensor]) -> int:
    return next(iter(batch.values())).shape[0]
