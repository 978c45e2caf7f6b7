"""What each optimizer step of a GRPO run feeds the model: a rollout, scored, cut into micro-batches of completions.

A step takes ``micro_batch_size x grad_accum / num_generations`` prompts from the stream (shuffled per epoch from
the seed), samples ``num_generations`` completions of each with the adapter on (rollout.py), scores them (rewards.py)
and turns the rewards into group-relative advantages. Every tensor of a forward has one entry per completion, so
whatever cuts the work — micro-batches, the OOM split — cuts between completions and leaves the step's loss as it is.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from rocktune.data.batching import BatchStream
from rocktune.tasks.lm.feed import StreamPosition
from rocktune.train.step import split_by_rows


def advantages(rewards: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """Each reward minus its group's mean, divided by the std (unbiased, as torch.std) of its group (``group``),
    of the whole step (``batch``), or not (``none``); 1e-4 keeps a group of equal rewards finite (TRL's choice)."""
    grouped = rewards.view(-1, group)
    centred = (grouped - grouped.mean(1, keepdim=True)).reshape(-1)
    if scale == "none":
        return centred
    std = grouped.std(1).repeat_interleave(group) if scale == "group" else rewards.std().expand_as(rewards)
    return centred / (std + 1e-4)


def row_weights(lengths: list[int], loss_type: str, max_completion_length: int) -> tuple[list[float], int]:
    """Each completion's weight in the loss sum and the step's normaliser (loss.py's table)."""
    if loss_type == "grpo":
        return [1.0 / max(n, 1) for n in lengths], len(lengths)
    if loss_type == "dr_grpo":
        return [1.0 / max_completion_length] * len(lengths), len(lengths)
    return [1.0] * len(lengths), sum(lengths)


def collate(prompts: list[tuple[int, ...]], completions: list[list[int]], adv: list[float], weights: list[float],
            pad_id: int) -> dict:
    """Host tensors of prompt + completion rows, right-padded."""
    rows = [list(p) + c for p, c in zip(prompts, completions)]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    completion = torch.zeros_like(ids)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        ids[r, : len(p) + len(c)] = torch.tensor(list(p) + c, dtype=torch.long)
        attention[r, : len(p) + len(c)] = 1
        completion[r, len(p) : len(p) + len(c)] = 1
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion,
            "advantage": torch.tensor(adv, dtype=torch.float32), "weight": torch.tensor(weights, dtype=torch.float32)}


@dataclass
class Rollout:
    """One step's completions, scored (what ``rollout(idx)`` returns): per completion in prompt-group order."""

    prompts: list[tuple[int, ...]]
    completions: list[list[int]]
    rewards: torch.Tensor  # the weighted sum
    stats: dict = field(default_factory=dict)  # TRL's metric names: reward, reward_std, rewards/<name>/mean, ...


@dataclass
class RolloutStep:
    """One optimizer step as the engine sees it (train/task.py's Feed.next)."""

    picked: list
    forwards: list[dict]
    loss_tokens: int  # the step's normaliser: completions (grpo, dr_grpo) or completion tokens (dapo)
    real_tokens: int
    completion_tokens: int
    stats: dict
    # the loss value may be exactly zero on-policy (advantages cancel); the gradient too when every advantage is zero
    zero_expected: tuple[str, ...] = ("loss",)


@dataclass(frozen=True)
class StepShape:
    prompts_per_step: int
    generations: int
    rows_per_forward: int
    loss_type: str
    max_completion_length: int
    scale_rewards: str
    pad_id: int
    seed: int


class RolloutFeed(StreamPosition):
    """One rollout per optimizer step; ``rollout(prompt indices)`` samples and scores (the task's, with the model)."""

    split = staticmethod(split_by_rows)

    def __init__(self, n_prompts: int, shape: StepShape, rollout, epoch: int = 0, index: int = 0):
        self.shape, self.rollout = shape, rollout

        def make(e: int) -> list[list[int]]:
            order = torch.randperm(n_prompts, generator=torch.Generator().manual_seed(shape.seed * 1000 + e)).tolist()
            return [order[i : i + shape.prompts_per_step] for i in range(0, n_prompts, shape.prompts_per_step)]
        self.stream = BatchStream(make, epoch, index)
        self._items_per_step = 1
        self._position, self._epoch = self.stream.position(), self.stream.epoch

    def next(self) -> RolloutStep:
        idx = self.stream.next()
        self._position, self._epoch = self.stream.position(), self.stream.epoch
        s = self.shape
        out = self.rollout(idx)
        adv = advantages(out.rewards, s.generations, s.scale_rewards)
        lengths = [len(c) for c in out.completions]
        weights, normaliser = row_weights(lengths, s.loss_type, s.max_completion_length)
        n, size = len(out.completions), s.rows_per_forward
        forwards = [collate(out.prompts[i : i + size], out.completions[i : i + size], adv[i : i + size].tolist(),
                            weights[i : i + size], s.pad_id) for i in range(0, n, size)]
        real = sum(len(p) + c for p, c in zip(out.prompts, lengths))
        return RolloutStep(idx, forwards, normaliser, real, sum(lengths), out.stats,
                           ("loss", "grad") if bool((adv == 0).all()) else ("loss",))

    def max_pieces(self, batch: dict) -> int:
        return batch["input_ids"].shape[0]

    def close(self) -> None:
        """Nothing to release: a rollout is made in the step that uses it."""


def digest(forwards: list[dict]) -> str:
    """Short hash of the step's token ids (completions included): equal runs sampled the same completions."""
    h = hashlib.blake2b(digest_size=6)
    for batch in forwards:
        h.update(batch["input_ids"].numpy().tobytes())
    return h.hexdigest()
