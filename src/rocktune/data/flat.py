"""A flat token stream for variable-length attention: each forward is one packed row of at most T tokens.

Varlen attention reads document bounds, not rows, so rows of ``max_length`` buy nothing there: they cost the padding
at the end of every row (9% on the first H200 run) and a row count and a ``cu_seq_lens`` length that change every
step, so no compiled graph or captured CUDA graph is ever reused. Here a step's examples are packed (best fit,
longest first) into forwards of ``T`` tokens, ``T`` a multiple of ``ALIGN`` chosen once per run, and:

- a forward's width is ``T`` when its tokens reach within ``ALIGN`` of it (every forward of a step but the last,
  in practice), else its tokens rounded up to ``ALIGN``: a step's last forward is not padded to a whole ``T``. The
  loss marks a flat row's length dynamic (``tasks/causal/loss.varlen_inputs``), so a compiled decoder makes one graph
  with a symbolic length for every width of the run (without the mark, Dynamo's automatic dynamic shapes would
  compile the first width statically and the second symbolically: 2 graphs).
- ``cu_seq_lens`` always has ``slots`` entries: the real bounds, then the padding's own trailing segment, then the
  last bound repeated (empty documents, which the kernel skips). ``slots`` is the most documents a forward of ``T``
  can hold in this data set, known before the first step.
- ``T`` is at least ``max_length`` (rounded up), so no example is longer than a forward and none is ever cut.
"""

from __future__ import annotations

import torch

from rocktune.data.packing import collate_packed, pack_rows

ALIGN = 128  # the width grain: matmul tiles and the attention kernel's blocks


def round_up(n: int, grain: int = ALIGN) -> int:
    return -(-n // grain) * grain


def max_segment(max_length: int) -> int:
    """The longest segment of a flat forward's bounds: an example (at most ``max_length``) or the padding (under
    ``ALIGN``: a forward is within ``ALIGN`` of full or rounded up to it). varlen attention's ``max_length``."""
    return max(max_length, ALIGN - 1)


def flat_width(token_budget: int, max_length: int) -> int:
    """``T`` for a token budget per forward (the planner's, or ``training.micro_batch_tokens``): the budget rounded
    down to ``ALIGN``, but never below the longest possible example."""
    return max(token_budget // ALIGN * ALIGN, round_up(max_length))


def cu_slots(lengths: list[int], width: int) -> int:
    """The fixed length of ``cu_seq_lens`` for forwards of ``width`` tokens: 0, one bound per document of the most
    documents that fit (the shortest ones), and the padding segment's end."""
    total, docs = 0, 0
    for n in sorted(lengths):
        if total + n > width:
            break
        total, docs = total + n, docs + 1
    return docs + 2


def step_forwards(indices: list[int], lengths: list[int], width: int) -> list[list[int]]:
    """One step's examples packed into forwards of at most ``width`` tokens, fullest first (so the short one is the
    step's last)."""
    forwards = pack_rows(lengths, width, sorted(indices, key=lambda i: -lengths[i]))
    return sorted(forwards, key=lambda f: -sum(lengths[i] for i in f))


def forward_width(tokens: int, width: int) -> int:
    """A forward's row width: ``width`` when within ``ALIGN`` of full, else its tokens rounded up to ``ALIGN``."""
    return width if tokens > width - ALIGN else round_up(tokens)


def collate_flat(docs: list[tuple[list[int], list[int]]], pad_id: int, width: int,
                 slots: int) -> dict[str, torch.Tensor]:
    """One forward of (input_ids, labels) documents as a ``(1, forward_width)`` row with ``cu_seq_lens`` of
    ``slots`` entries. The padding continues the last document's positions and carries no label (the packed
    collate's rules)."""
    tokens = sum(len(x) for x, _ in docs)
    if tokens > width:
        raise ValueError(f"a forward of {tokens} tokens does not fit the flat width {width}")
    out = collate_packed([docs], pad_id, forward_width(tokens, width), segments=True)
    cu = out["cu_seq_lens"]
    if cu.numel() > slots:
        raise ValueError(f"{cu.numel() - 2} documents in one forward, more than the {slots - 2} planned")
    out["cu_seq_lens"] = torch.cat([cu, cu[-1:].expand(slots - cu.numel())])
    return out


def padding_share(steps: list[list[int]], lengths: list[int], width: int) -> float:
    """Padding tokens over all tokens fed, for these steps (lists of example indices) cut into flat forwards."""
    fed = real = 0
    for step in steps:
        for f in step_forwards(step, lengths, width):
            tokens = sum(lengths[i] for i in f)
            fed, real = fed + forward_width(tokens, width), real + tokens
    return (fed - real) / max(fed, 1)
