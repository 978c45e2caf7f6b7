"""Packing for vision-language data (``data.packing`` with ``task: vlm``): several conversations share one row, each
with its images, and attend only to themselves.

A packed row is collated as one long conversation (its examples' ids, labels, images and grids concatenated, so
the pixels stay in token order, as the model scatters image features), then given ``text_position_ids``: positions
that restart at 0 at every conversation and at the row's padding. transformers' Qwen-VL models read positions given
as ``[text; temporal; height; width]`` as packed sequences and build a block-diagonal causal mask from the text row,
so no token sees another conversation; the 3-D rotary positions of each conversation are made from it alone
(tasks/vlm/positions.py). The first token of every conversation is unlabelled: nothing asks one conversation to
predict the next.
"""

from __future__ import annotations

import torch

from rocktune.data.encode import IGNORE
from rocktune.tasks.vlm.data.images import ImageRef
from rocktune.tasks.vlm.data.vision import VisionExample, VisionTokens
from rocktune.tasks.vlm.data.vision_batch import collate


def join(row: list[VisionExample]) -> VisionExample:
    """One row's conversations as one example (the OOM split and the image bookkeeping then work per row)."""
    ids: list[int] = []
    labels: list[int] = []
    images: list[ImageRef] = []
    grids: list[tuple[int, ...]] = []
    for e in row:
        ids += e.input_ids
        labels += [IGNORE] + e.labels[1:]
        images += e.images
        grids += e.grids
    return VisionExample(ids, labels, tuple(images), tuple(grids), any(e.truncated for e in row),
                         sum(e.image_tokens for e in row))


def text_positions(row: list[VisionExample], width: int) -> list[int]:
    """0, 1, ... within each conversation, and again from 0 over the padding after the last (its own block)."""
    out: list[int] = []
    for e in row:
        out += range(len(e.input_ids))
    return out + list(range(width - len(out)))


def collate_packed(rows: list[list[VisionExample]], pad_id: int, vision: VisionTokens) -> dict[str, torch.Tensor]:
    """Rows of conversations -> the batch ``collate`` makes of the joined rows, without its attention mask (the
    packed positions stand in for it: with a mask, transformers would not read them as packed) and with
    ``text_position_ids``."""
    batch = collate([join(row) for row in rows], pad_id, vision)
    del batch["attention_mask"]
    width = batch["input_ids"].shape[1]
    batch["text_position_ids"] = torch.tensor([text_positions(row, width) for row in rows])
    return batch
