"""Packing: several examples share one row of up to ``max_length`` tokens, so no compute goes to padding.

Each example keeps its own position ids (restarting at 0) and the attention mask is left out, from which
transformers builds a block-diagonal causal mask: tokens never attend across example boundaries. The first token
of every example is unlabelled, so no loss asks an example to predict the next one.
"""

from __future__ import annotations

import bisect
import random

import torch

from rocktune.data.encode import IGNORE


def pack_rows(lengths: list[int], capacity: int, order: list[int]) -> list[list[int]]:
    """Best fit in the given order: each example goes to the open row it fills most tightly."""
    free: list[tuple[int, int]] = []  # (free tokens, row id), kept sorted
    rows: list[list[int]] = []
    for i in order:
        pos = bisect.bisect_left(free, (lengths[i], -1))
        if pos == len(free):
            rows.append([i])
            bisect.insort(free, (capacity - lengths[i], len(rows) - 1))
        else:
            room, row = free.pop(pos)
            rows[row].append(i)
            bisect.insort(free, (room - lengths[i], row))
    return rows


def epoch_packed_batches(lengths: list[int], rows_per_batch: int, capacity: int, seed: int,
                         epoch: int) -> list[list[list[int]]]:
    """Batches of rows of example indices for one epoch; a pure function of (seed, epoch)."""
    rng = random.Random(f"pack:{seed}:{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    rows = pack_rows(lengths, capacity, order)
    rng.shuffle(rows)
    return [rows[i : i + rows_per_batch] for i in range(0, len(rows), rows_per_batch)]


def epoch_steps(lengths: list[int], examples_per_step: int, seed: int, epoch: int) -> list[list[int]]:
    """The example indices of each optimizer step of one epoch (token batching); a pure function of (seed, epoch).
    No length sorting: packing removes the padding that bucketing exists to avoid, and random steps train better."""
    rng = random.Random(f"steps:{seed}:{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    return [order[i : i + examples_per_step] for i in range(0, len(order), examples_per_step)]


def step_rows(indices: list[int], lengths: list[int], capacity: int) -> list[list[int]]:
    """One step's examples packed into rows of ``capacity`` tokens, longest first (tighter rows)."""
    return pack_rows(lengths, capacity, sorted(indices, key=lambda i: -lengths[i]))


def cut_forwards(rows: list[list[int]], rows_per_forward: int) -> list[list[list[int]]]:
    """As few forwards of at most ``rows_per_forward`` rows as possible, of near-equal size (a steadier peak)."""
    if not rows:
        return []
    n = -(-len(rows) // rows_per_forward)
    cuts = [len(rows) * k // n for k in range(n + 1)]  # sizes differ by at most one row
    return [rows[a:b] for a, b in zip(cuts, cuts[1:])]


def collate_packed(rows: list[list[tuple[list[int], list[int]]]], pad_id: int, width: int = 0,
                   segments: bool = False) -> dict[str, torch.Tensor]:
    """``rows`` holds (input_ids, labels) per example; rows are right-padded to the longest row, or to ``width``
    when that is larger (static shapes for torch.compile and a steadier allocator). ``segments`` adds
    ``cu_seq_lens`` (see ``cu_seq_lens``) for variable-length attention."""
    flat = []
    for row in rows:
        ids, labels, pos = [], [], []
        for x, y in row:
            ids += x
            labels += [IGNORE] + y[1:]
            pos += range(len(x))
        flat.append((ids, labels, pos))
    width = max(width, *(len(ids) for ids, _, _ in flat))
    out_ids = torch.full((len(flat), width), pad_id, dtype=torch.long)
    out_labels = torch.full((len(flat), width), IGNORE, dtype=torch.long)
    # Padding continues the last example's positions so a pad never looks like the start of a new sequence.
    out_pos = torch.arange(width, dtype=torch.long).repeat(len(flat), 1)
    for r, (ids, labels, pos) in enumerate(flat):
        out_ids[r, : len(ids)] = torch.tensor(ids)
        out_labels[r, : len(labels)] = torch.tensor(labels)
        out_pos[r, : len(pos)] = torch.tensor(pos)
        if len(pos) < width:
            out_pos[r, len(pos):] = torch.arange(pos[-1] + 1, pos[-1] + 1 + width - len(pos))
    out = {"input_ids": out_ids, "labels": out_labels, "position_ids": out_pos}
    if segments:
        out["cu_seq_lens"] = cu_seq_lens([[len(x) for x, _ in row] for row in rows], width)
    return out


def cu_seq_lens(rows: list[list[int]], width: int) -> torch.Tensor:
    """Document bounds of packed rows for variable-length attention: int32 offsets into the flattened
    ``rows x width`` tokens, starting at 0, one per document end; a row's padding is one trailing segment of its
    own (it attends only to itself, and no loss is read there). Built on the host, so the device never searches the
    position ids for document starts."""
    bounds = [0]
    for r, lengths in enumerate(rows):
        for n in lengths:
            bounds.append(bounds[-1] + n)
        if bounds[-1] < (r + 1) * width:
            bounds.append((r + 1) * width)
    return torch.tensor(bounds, dtype=torch.int32)


def cut_segments(cu: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The bounds of the flat tokens ``start:end`` (both document bounds: a row's start, or an example's) as a piece
    of their own: what an out-of-memory split of a forward hands to each smaller forward."""
    return (cu[(cu >= start) & (cu <= end)] - start).to(torch.int32)
