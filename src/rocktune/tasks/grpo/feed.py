"""What each optimizer step of a GRPO run feeds the model: a rollout, scored, cut into micro-batches of completions.

A step takes ``micro_batch_size x grad_accum / num_generations`` prompts from the stream (shuffled per epoch from
the seed), samples ``num_generations`` completions of each with the adapter on (rollout.py), scores them (rewards.py)
and turns the rewards into group-relative advantages. Every tensor of a forward has one entry per completion, so
whatever cuts the work — micro-batches, the OOM split — cuts between completions and leaves the step's loss as it is.

With several ranks (``--nproc``) each rank samples and scores a contiguous share of the step's prompts, all G
completions of a prompt on one rank; the scored shares are gathered (``Share.gather``) so that every rank computes
the whole step's advantages, normaliser and statistics exactly as one process would, and keeps its own rows for the
update. Each row samples from uniforms keyed by (seed, step, prompt, generation) (``row_keys``), so the completions
are one process's whatever the split.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable, cast

import torch

from rocktune.data.batching import BatchStream
from rocktune.tasks.causal.feed import StreamPosition
from rocktune.train.step import split_by_rows


def advantages(rewards: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """Each reward minus its group's mean, divided by the std (unbiased, as torch.std) of its group (``group``),
    of the whole step (``batch``), or not (``none``); 1e-4 keeps a group of equal rewards finite (TRL's choice).
    A NaN reward (no reward function applied: every one returned None) is left out of the means and stds and gets
    advantage 0, as TRL does."""
    if bool(rewards.isnan().any()):
        return _nan_advantages(rewards, group, scale)
    grouped = rewards.view(-1, group)
    centred = (grouped - grouped.mean(1, keepdim=True)).reshape(-1)
    if scale == "none":
        return centred
    std = grouped.std(1).repeat_interleave(group) if scale == "group" else rewards.std().expand_as(rewards)
    return centred / (std + 1e-4)


def nan_std(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """torch.std (unbiased) over the values that are not NaN (TRL's nanstd)."""
    kept = (~x.isnan()).sum() if dim is None else (~x.isnan()).sum(dim)
    mean = x.nanmean() if dim is None else x.nanmean(dim, keepdim=True)
    var = ((x - mean) ** 2).nanmean() if dim is None else ((x - mean) ** 2).nanmean(dim)
    return (var * kept / (kept - 1)).sqrt()


def _nan_advantages(rewards: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    grouped = rewards.view(-1, group)
    centred = (grouped - grouped.nanmean(1, keepdim=True)).reshape(-1)
    if scale != "none":
        std = nan_std(grouped, 1).repeat_interleave(group) if scale == "group" else nan_std(rewards)
        centred = centred / (std + 1e-4)
    return torch.nan_to_num(centred, nan=0.0)


def row_weights(lengths: list[int], loss_type: str, max_completion_length: int) -> tuple[list[float], int]:
    """Each completion's weight in the loss sum and the step's normaliser (loss.py's table)."""
    if loss_type == "grpo":
        return [1.0 / max(n, 1) for n in lengths], len(lengths)
    if loss_type == "dr_grpo":
        return [1.0 / max_completion_length] * len(lengths), len(lengths)
    return [1.0] * len(lengths), sum(lengths)


def collate(prompts: list[tuple[int, ...]], completions: list[list[int]], adv: list[float], weights: list[float],
            pad_id: int) -> dict:
    """Host tensors of prompt + completion rows, right-padded; ``prompt_length`` and ``prompt_group`` (the index of
    the first row with the same prompt) for the update's shared-prompt forward (prefix.py)."""
    rows = [list(p) + c for p, c in zip(prompts, completions)]
    first: dict[tuple[int, ...], int] = {}
    group = [first.setdefault(tuple(p), r) for r, p in enumerate(prompts)]
    width = max(map(len, rows))
    ids = torch.tensor([row + [pad_id] * (width - len(row)) for row in rows], dtype=torch.long)
    at, ends = torch.arange(width)[None], torch.tensor([len(row) for row in rows])[:, None]
    starts = torch.tensor([len(p) for p in prompts])
    return {"input_ids": ids, "attention_mask": (at < ends).long(),
            "completion_mask": ((at >= starts[:, None]) & (at < ends)).long(),
            "advantage": torch.tensor(adv, dtype=torch.float32), "weight": torch.tensor(weights, dtype=torch.float32),
            "prompt_length": starts, "prompt_group": torch.tensor(group)}


def _kept(rows: range, adv: list[float], skip_zero: bool) -> list[int]:
    """The rows of one forward that are computed: with ``skip_zero``, those whose advantage is not exactly 0, and at
    least the first (a forward with every parameter in it keeps DDP's all-reduce and the engine's step as they
    are; a kept zero-advantage row adds exactly 0)."""
    if not skip_zero:
        return list(rows)
    return [i for i in rows if adv[i] != 0.0] or [rows[0]]


def idle(pad_id: int) -> dict:
    """One pad token scoring nothing: a rank whose share of a short step is empty still runs a forward and a
    backward (DDP's all-reduce), adding exactly zero."""
    batch = collate([(pad_id,)], [[pad_id]], [0.0], [0.0], pad_id)
    batch["completion_mask"].zero_()
    return batch


@dataclass
class Rollout:
    """Completions, scored (what ``rollout(idx, keys)`` returns for a share of a step): per completion in prompt-group
    order, plain lists so that a share travels between ranks as it is."""

    prompts: list[tuple[int, ...]]
    completions: list[list[int]]
    rewards: list[float]  # the weighted sum
    columns: dict[str, list[float]]  # each reward function's values
    ended: list[bool]  # stopped at a stop token (else clipped at max_completion_length or a stop string)
    seconds: float = 0.0  # the sampling's wall time


def merged(shares: list[Rollout]) -> Rollout:
    """The whole step from every rank's share, in rank order (which is the step's prompt order)."""
    first = shares[0]
    return Rollout([p for s in shares for p in s.prompts], [c for s in shares for c in s.completions],
                   [x for s in shares for x in s.rewards],
                   {k: [x for s in shares for x in s.columns[k]] for k in first.columns},
                   [e for s in shares for e in s.ended], max(s.seconds for s in shares))


def rollout_stats(out: Rollout, group: int) -> dict[str, float]:
    """TRL's metric names, over the whole step (NaN rewards, which no function applied to, left out; a figure with
    no value at all left out of the line)."""
    total = torch.tensor(out.rewards, dtype=torch.float32)
    lengths = torch.tensor([len(c) for c in out.completions], dtype=torch.float32)
    stats = {}
    for name, col in out.columns.items():
        values = torch.tensor(col, dtype=torch.float32)
        stats[f"rewards/{name}/mean"] = float(values.nanmean())
        stats[f"rewards/{name}/std"] = float(nan_std(values)) if len(col) > 1 else 0.0
    stats.update({"reward": float(total.nanmean()), "reward_std": float(nan_std(total)),
                  "frac_reward_zero_std": float((nan_std(total.view(-1, group), 1).nan_to_num(0.0) < 1e-6)
                                                .float().mean()),
                  "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                  "completions/max_length": float(lengths.max()),
                  "completions/clipped_ratio": 1.0 - sum(out.ended) / len(out.ended), "rollout_s": out.seconds,
                  "rollout_tokens_per_s": float(lengths.sum()) / max(out.seconds, 1e-9)})
    return {k: v for k, v in stats.items() if math.isfinite(v)}


def row_keys(seed: int, step: tuple[int, int], idx: list[int], group: int) -> list[int]:
    """The sampler's seed of each completion: a hash of (seed, the step's stream position, prompt, generation)."""
    def key(i: int, g: int) -> int:
        text = f"{seed}:{step[0]}:{step[1]}:{i}:{g}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1
    return [key(i, g) for i in idx for g in range(group)]


@dataclass(frozen=True)
class Share:
    """This rank's part of every step: ``gather(share) -> every rank's, in rank order`` (one process: itself)."""

    rank: int = 0
    world: int = 1
    gather: Callable | None = None

    def mine(self, idx: list) -> list:
        """A contiguous share, the sizes differing by one at most (an epoch's last step may hold fewer prompts)."""
        n = len(idx)
        return idx[self.rank * n // self.world : (self.rank + 1) * n // self.world]

    def all(self, share: Rollout) -> list[Rollout]:
        return cast(Callable, self.gather)(share) if self.world > 1 else [share]  # gather is given with world > 1


@dataclass
class RolloutStep:
    """One optimizer step as the engine sees it (train/task.py's Feed.next)."""

    picked: list
    forwards: list[dict]
    loss_tokens: int  # the step's normaliser: completions (grpo, dr_grpo) or completion tokens (dapo)
    real_tokens: int  # the whole step's (every rank's), as the figures below
    completion_tokens: int
    completions: int
    samples: str  # digest of the step's prompts and completions
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
    # beta 0: a completion whose advantage is exactly 0 adds exactly 0 to the loss and its gradient, so no forward
    # computes it (its tokens still count in the normaliser and the statistics)
    skip_zero_advantage: bool = False


class RolloutFeed(StreamPosition):
    """One rollout per optimizer step; ``rollout(prompt indices)`` samples and scores (the task's, with the model)."""

    split = staticmethod(split_by_rows)

    def __init__(self, n_prompts: int, shape: StepShape, rollout, share: Share = Share(), epoch: int = 0,
                 index: int = 0):
        self.shape, self.rollout, self.share = shape, rollout, share

        def make(e: int) -> list[list[int]]:
            order = torch.randperm(n_prompts, generator=torch.Generator().manual_seed(shape.seed * 1000 + e)).tolist()
            return [order[i : i + shape.prompts_per_step] for i in range(0, n_prompts, shape.prompts_per_step)]
        self.stream = BatchStream(make, epoch, index)
        self._items_per_step = 1
        self._position, self._epoch = self.stream.position(), self.stream.epoch

    def next(self) -> RolloutStep:
        idx = self.stream.next()
        self._position, self._epoch = self.stream.position(), self.stream.epoch
        s, share = self.shape, self.share
        mine = share.mine(idx)
        shares = share.all(self.rollout(mine, row_keys(s.seed, (self._epoch, self._position["index"]), mine,
                                                       s.generations)))
        out = merged(shares)
        adv = advantages(torch.tensor(out.rewards, dtype=torch.float32), s.generations, s.scale_rewards)
        lengths = [len(c) for c in out.completions]
        weights, normaliser = row_weights(lengths, s.loss_type, s.max_completion_length)
        values, bounds = adv.tolist(), [0]
        for x in shares:
            bounds.append(bounds[-1] + len(x.completions))
        every = [self._cuts(range(a, b), values) for a, b in zip(bounds, bounds[1:])]  # each rank's forwards' rows
        forwards = [collate([out.prompts[i] for i in rows], [out.completions[i] for i in rows],
                            [values[i] for i in rows], [weights[i] for i in rows], s.pad_id)
                    for rows in every[share.rank]] or [idle(s.pad_id)]
        real = sum(len(p) + c for p, c in zip(out.prompts, lengths))
        stats = rollout_stats(out, s.generations)
        stats["zero_advantage_skipped"] = len(values) - sum(len(rows) for cuts in every for rows in cuts)
        return RolloutStep(idx, forwards, normaliser, real, sum(lengths), len(lengths),
                           digest(out.prompts, out.completions), stats,
                           ("loss", "grad") if bool((adv == 0).all()) else ("loss",))

    def _cuts(self, rows: range, adv: list[float]) -> list[list[int]]:
        """One rank's rows in forwards of ``rows_per_forward``, each keeping what ``_kept`` computes."""
        size = self.shape.rows_per_forward
        return [_kept(rows[i : i + size], adv, self.shape.skip_zero_advantage) for i in range(0, len(rows), size)]

    def max_pieces(self, batch: dict) -> int:
        return batch["input_ids"].shape[0]

    def probe_piece(self, batch: dict) -> dict:
        """The training-path tripwire's rows: two completions of the forward's first prompt where it has two, so
        that the probe runs the shared-prompt forward (prefix.py) against the reference over full rows; else one."""
        group = batch["prompt_group"]
        rows = (group == group[0]).nonzero().flatten()[:2]
        return {k: v.index_select(0, rows) for k, v in batch.items()}

    def close(self) -> None:
        """Nothing to release: a rollout is made in the step that uses it."""


def digest(prompts: list, completions: list[list[int]]) -> str:
    """Short hash of the step's prompts and completions, row by row: equal runs sampled the same completions,
    however their rows were cut into forwards or dealt to ranks."""
    h = hashlib.blake2b(digest_size=6)
    for p, c in zip(prompts, completions):
        h.update(repr((tuple(p), tuple(c))).encode())
    return h.hexdigest()
