"""Vision-language examples -> host tensors: token rows padded to the longest (an attention mask, labels -100 on
padding) and the pixels of their images, made now by the image processor from the image files (images are not held
in memory between steps), concatenated in row order as the model expects. ``pixel_rows`` and ``image_counts`` say
which pixels and grids belong to which row, so a batch can be cut between examples (tasks/vlm/feed.py)."""

from __future__ import annotations

import torch

from rocktune.data.encode import IGNORE
from rocktune.tasks.vlm.data.images import load
from rocktune.tasks.vlm.data.vision import VisionExample, VisionTokens
from rocktune.errors import UserError


def loss_count(example: VisionExample) -> int:
    """Loss-bearing positions of one example (a label scores the token before it, so the first never does)."""
    return sum(label != IGNORE for label in example.labels[1:])


def collate(examples: list[VisionExample], pad_id: int, vision: VisionTokens) -> dict[str, torch.Tensor]:
    """The rule's type ids mark the image tokens (1) as transformers' processors do: Qwen3-VL places its 3-D rotary
    positions by ``mm_token_type_ids``, Gemma 3 attends within each image by ``token_type_ids`` (the loss passes
    them to the models whose forward takes them). ``pixel_rows``: each row's share of ``pixel_values``' first
    dimension (one per row where the pixels are batched by conversation)."""
    rule = vision.rule
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE)
    mask = torch.zeros_like(ids)
    for r, e in enumerate(examples):
        n = len(e.input_ids)
        ids[r, :n], labels[r, :n], mask[r, :n] = torch.tensor(e.input_ids), torch.tensor(e.labels), 1
    rows = [1 if rule.per_row else sum(rule.pixel_rows(g) for g in e.grids) for e in examples]
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "pixel_rows": torch.tensor(rows),
             "image_counts": torch.tensor([len(e.images) for e in examples])}
    if rule.type_ids:
        batch[rule.type_ids] = (ids == vision.image_token_id).long()
    if any(e.images for e in examples):
        images = [[load(ref, "an image of the data") for ref in e.images] for e in examples]
        inputs, grids = rule.pixels(vision.image_processor, images)
        if grids != [g for e in examples for g in e.grids]:
            raise UserError("an image of the data changed since it was read (its size differs); restore the files "
                            "or start a new run.")
        batch.update(inputs)
    return batch


def idle_batch(pad_id: int, vision: VisionTokens) -> dict[str, torch.Tensor]:
    """One pad token that scores nothing and shows no image: the forward a rank runs when its share of a small step
    is empty, so that DDP's all-reduce sees every rank (the language model's adapter gets a zero gradient)."""
    ids = torch.tensor([[pad_id]])
    zero = torch.zeros(1, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.full_like(ids, IGNORE),
             "pixel_rows": zero, "image_counts": zero.clone()}
    if vision.rule.type_ids:
        batch[vision.rule.type_ids] = torch.zeros_like(ids)
    return batch
