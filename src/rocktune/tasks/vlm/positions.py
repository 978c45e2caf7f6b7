"""The positions of a packed vision-language batch (tasks/vlm/data/vision_pack.py), as the model's forward reads packed
input: ``[text; temporal; height; width]`` of shape (4, rows, tokens).

Each conversation's 3-D rotary positions come from the model's own ``get_rope_index`` on that conversation alone,
so they are exactly those of an unpacked forward; text-only stretches (and the padding) keep 1-D positions on all
three axes, which is what ``get_rope_index`` gives text. The text row restarts at every conversation: transformers
builds the block-diagonal mask from it (SDPA), or the conversations' bounds for varlen attention are read from it
(``document_bounds``).
"""

from __future__ import annotations

import inspect
from typing import cast

import torch


def packed_positions(backbone, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    text = batch["text_position_ids"]
    ids, kinds = batch["input_ids"], batch["mm_token_type_ids"]
    grids = batch.get("image_grid_thw")
    out = text.unsqueeze(0).repeat(4, 1, 1)
    merge = backbone.config.vision_config.spatial_merge_size
    per_image = [] if grids is None else (grids.prod(-1) // merge**2).tolist()
    taken = 0  # images of the batch placed so far (they are in token order)
    for r in range(ids.shape[0]):
        starts = (text[r] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        for s, e in zip(starts, starts[1:]):
            tokens = int(kinds[r, s:e].sum())
            if not tokens:
                continue
            first = taken
            while tokens > 0:
                tokens -= per_image[taken]
                taken += 1
            out[1:, r, s:e] = _rope_index(backbone, ids[r : r + 1, s:e], kinds[r : r + 1, s:e],
                                          cast(torch.Tensor, grids)[first:taken])[:, 0]  # images: grids given
    return out


def _rope_index(backbone, ids: torch.Tensor, kinds: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
    """``get_rope_index`` of one conversation: transformers 5 takes the token types, 4.x finds images by their ids."""
    accepts = inspect.signature(backbone.get_rope_index).parameters
    given = {"input_ids": ids, "image_grid_thw": grids, "attention_mask": torch.ones_like(ids),
             "mm_token_type_ids": kinds}
    return backbone.get_rope_index(**{k: v for k, v in given.items() if k in accepts})[0]


def document_bounds(text: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(``cu_seq_lens``, the longest segment) of packed rows for varlen attention (rocktune/kernels/attention.py): int32
    offsets into the flattened ``rows x tokens``, a bound wherever the text position restarts at 0 (a conversation,
    or a row's padding: one trailing segment of its own) and at the end. Read on the host: the positions above are
    too, and the kernel takes the longest segment as a number."""
    starts = (text.flatten() == 0).nonzero().flatten().tolist() + [text.numel()]
    longest = max(b - a for a, b in zip(starts, starts[1:]))
    return torch.tensor(starts, dtype=torch.int32, device=text.device), longest
