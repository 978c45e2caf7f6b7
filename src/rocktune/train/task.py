"""What the engine needs from a task: every task in task_registry.py provides one (the object its builder names).

The engine (train/loop.py) owns everything a run does the same way whatever it trains: the run directory, resume,
the step with OOM recovery, the numeric guard, checkpoints, Ctrl-C, metrics and the final writes. A task owns its
data, its model and loss, its evaluation and what it writes besides the adapter. The hooks are called in this order:
``refuse`` (config only) -> ``check`` (inputs, nothing written) -> the engine's run-directory checks -> ``prepare``
(data, model: may write caches) -> ``start`` -> per step ``new_feed``/``record``/``after_eval`` -> ``final_files``.

``Task`` below is the protocol mypy checks every task against (tests/test_types.py): a task missing a hook fails
the type check, not a run. ``tasks/base.py``'s ``TaskBase`` gives the hooks most tasks share (the configured
attention, nothing of its own to resume or checkpoint, no extra files) so a task writes only what is its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch

from rocktune.train.context import RunContext
from rocktune.train.request import RunOptions


class KeepsStats(torch.nn.Module):
    """A loss module that sums statistics of what it sees (on the device, no synchronisation) until the task takes
    them. Calls that are not the step's own (an eval pass, the training-path tripwire's probe) run inside
    ``separate_stats`` so that the step's figures stay the step's: a resumed run logs what an uninterrupted one does."""

    def __init__(self) -> None:
        super().__init__()
        self._stats: dict[str, torch.Tensor] = {}

    def add_stats(self, stats: dict) -> None:
        for k, v in stats.items():
            self._stats[k] = self._stats.get(k, 0) + v

    @contextlib.contextmanager
    def separate_stats(self):
        outer, self._stats = self._stats, {}
        try:
            yield
        finally:
            self._stats = outer


@dataclass(frozen=True)
class Prepared:
    """The task's model and data, ready for the engine: what ``prepare`` returns, never changed afterwards."""

    model: torch.nn.Module  # the PEFT model whose adapter trains
    loss: torch.nn.Module  # batch -> summed loss of its loss-bearing units (DDP/FSDP-wrapped where several ranks)
    fingerprint: str  # of the training data: a resume refuses other data
    intro: str  # one console line: data and model
    data_info: dict  # run_info.json's "data" section
    predicted_peak: int | None = None  # the planner's figure, printed beside the measured one
    compiled: bool = False  # the decoder is compiled: a compile failure falls back to eager once
    lockstep: bool = False  # FSDP: every rank runs every eval forward and generation (weights are gathered)
    after_backward: Callable[[], None] | None = None  # after the step's last backward (FSDP: the adapter all-reduce)
    idle: dict | None = None  # FSDP: a batch without loss that pads a rank's forwards to rank 0's count
    tokenizer: object = None


class Feed(Protocol):
    """One optimizer step at a time; ``position()`` is where a resumed run continues."""

    @property
    def steps_per_epoch(self) -> int: ...  # read-only: feeds answer it from their stream (StreamPosition)

    @property
    def epoch(self) -> int: ...

    # -> an object with .forwards (host batches), .loss_tokens (the step's normaliser) and, optionally,
    # .zero_expected: what may be exactly zero by construction, which the silent-zeros guard then does not count
    # ("loss": GRPO's on-policy loss value; "grad" too when every reward of every group is equal)
    def next(self): ...

    def position(self) -> dict: ...

    def close(self) -> None: ...

    # The OOM split asks the feed: it alone knows the batch's layout and what must stay in one forward.
    def split(self, batch: dict, pieces: int) -> Sequence[dict]: ...  # -> up to ``pieces`` smaller forwards

    def max_pieces(self, batch: dict) -> int: ...  # how finely ``split`` can cut this batch


class Task(Protocol):
    kind: str  # the task_registry name (lm, dpo, orpo, video-lora, image-lora): names it in messages
    samples_what: str  # the final writes' words for what comes with the final metrics ("" when nothing)

    def attn_setting(self) -> str: ...  # the attention setting the context resolves

    def refuse(self, options: RunOptions) -> None: ...  # config-only refusals, before the device or any file is touched

    def check(self, ctx: RunContext) -> None: ...  # may set ctx.cfg (--auto); raises UserError; writes nothing

    def prepare(self, ctx: RunContext) -> Prepared: ...

    def new_feed(self, **position) -> Feed: ...

    def evaluate(self) -> float | None: ...

    def check_resume(self, restored, force: bool) -> None: ...  # before anything of the checkpoint is applied

    def resumed(self, restored) -> None: ...  # the task's own state from the checkpoint (e.g. each rank's RNG)

    def checkpoint_extra(self) -> dict: ...  # task state a checkpoint keeps (the engine adds its own)

    # metrics are open: e.g. the sample writer; ``redo_from``: the first step this attempt logs at (sinks.redo_from),
    # so what an earlier attempt logged from there on is dropped
    def start(self, redo_from: int, metrics, log) -> None: ...

    def record(self, fed) -> dict: ...  # a logged step's task metrics; "tokens" is the throughput's unit

    def progress(self, record: dict) -> str: ...  # the task's figures on the progress line ("": loss alone)

    def after_eval(self, step: int, metrics, log) -> None: ...  # e.g. sample generations

    def final_files(self, run_dir: Path) -> list[tuple[str, Callable[[], None]]]: ...  # written before adapter/

    def outputs(self, run_dir: Path) -> list[str] | None: ...  # the summary's lines (None: the LM default)

    def oom_message(self, step: int, exc: BaseException) -> str: ...

    def uncompile(self) -> None: ...
