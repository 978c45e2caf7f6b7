"""What one optimizer step of a Wan LoRA run trains on: cached latents, their noise and noise levels, batched.

A step takes the next ``per_step`` items of the epoch's shuffled order; items of one resolution/frame bucket share a
forward (up to ``per_forward`` of them), since latents of different shapes cannot be stacked. The position (epoch,
index) is all a checkpoint needs: the order, the noise and the sigmas follow from the seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rocktune.tasks.wan.diffusion.cache import LatentItem, load_item
from rocktune.tasks.wan.diffusion.objective import draw_sigma, eval_sigma, item_generator


@dataclass(frozen=True)
class Noise:
    """How noise levels are drawn: the config's sampling and shift, and the expert's share of levels."""

    sampling: str  # diffusion.timestep_sampling
    shift: float
    span: tuple[float, float] = (0.0, 1.0)


@dataclass
class Fed:
    forwards: list[dict[str, torch.Tensor]]
    loss_tokens: int  # latent values in the step: the loss is their mean squared error
    names: list[str]  # the media files, in order (the metrics' sample digest)


class LatentFeed:
    def __init__(self, items: list[LatentItem], per_forward: int, per_step: int, seed: int, noise: Noise,
                 text_tokens: int, epoch: int = 0, index: int = 0):
        self.items, self.per_forward, self.per_step = items, per_forward, min(per_step, len(items))
        self.seed, self.noise, self.text_tokens = seed, noise, text_tokens
        self.epoch, self.index = epoch, index
        self.steps_per_epoch = math.ceil(len(items) / self.per_step)
        self._order_of: int | None = None
        self._epoch_order: list[int] = []  # the epoch whose shuffled order is held, and that order

    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def close(self) -> None:
        """Nothing to release: items load in the step that uses them (the LM feed has a collate thread)."""

    def split(self, batch: dict, pieces: int) -> list[dict]:
        """Every tensor of a latent batch has one entry per item: the OOM split cuts by rows."""
        if pieces == 1:
            return [batch]
        size = -(-self.max_pieces(batch) // pieces)
        return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, self.max_pieces(batch), size)]

    def max_pieces(self, batch: dict) -> int:
        return next(iter(batch.values())).shape[0]

    def next(self) -> Fed:
        if self.index >= len(self.items):
            self.epoch, self.index = self.epoch + 1, 0
        chosen = self._order()[self.index: self.index + self.per_step]
        self.index += len(chosen)
        rows = [(self.items[i], item_generator(self.seed, self.epoch, i), None) for i in chosen]
        return _fed(rows, self.per_forward, self.noise, self.text_tokens)

    def _order(self) -> list[int]:
        """The epoch's shuffled order, drawn once per epoch from the seed."""
        if self._order_of != self.epoch:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            self._order_of, self._epoch_order = self.epoch, torch.randperm(len(self.items), generator=gen).tolist()
        return self._epoch_order


def eval_forwards(items: list[LatentItem], per_forward: int, seed: int, noise: Noise, text_tokens: int) -> Fed:
    """The eval set as one fixed batch list: its own noise per item and noise levels at evenly spaced quantiles of
    the training distribution."""
    rows = [(item, item_generator(seed, -1, i), eval_sigma(i, len(items), noise.sampling, noise.shift, noise.span))
            for i, item in enumerate(items)]
    return _fed(rows, per_forward, noise, text_tokens)


def _fed(rows, per_forward: int, noise: Noise, text_tokens: int) -> Fed:
    """Rows (item, generator, fixed sigma or None) -> forwards grouped by bucket, in first-seen order."""
    by_bucket: dict = {}
    for row in rows:
        by_bucket.setdefault(row[0].bucket, []).append(row)
    forwards = []
    for group in by_bucket.values():
        for start in range(0, len(group), per_forward):
            forwards.append(_batch(group[start: start + per_forward], noise, text_tokens))
    return Fed(forwards, sum(item.elements for item, _, _ in rows), [item.name for item, _, _ in rows])


def _batch(rows, noise: Noise, text_tokens: int) -> dict[str, torch.Tensor]:
    latents, draws, sigma, text = [], [], [], []
    for item, gen, fixed in rows:
        data = load_item(item)
        z = data["latents"]
        latents.append(z)
        draws.append(torch.randn(z.shape, generator=gen))
        sigma.append(fixed if fixed is not None else draw_sigma(gen, noise.sampling, noise.shift, noise.span))
        emb = data["text"][:text_tokens]
        # zero rows past the caption, as WanPipeline pads its prompt embeddings at inference
        text.append(torch.cat([emb, emb.new_zeros(text_tokens - emb.shape[0], emb.shape[1])]))
    return {"latents": torch.stack(latents), "noise": torch.stack(draws),
            "sigma": torch.tensor(sigma, dtype=torch.float32), "text": torch.stack(text)}
