"""What each optimizer step feeds the model: the step's examples, cut into forwards, collated on the host.

Two ways to cut a step (``training.batching``), the same samples per optimizer step either way:

- ``examples``: ``grad_accum`` micro-batches of ``micro_batch_size`` examples (in ``data.batch_order``, or packed rows).
  Small forwards are what the CPU runs fastest.
- ``tokens``: the step's ``micro_batch_size x grad_accum`` examples packed without padding into rows of
  ``max_length`` tokens, ``rows_per_forward`` rows per forward. A GPU runs a forward of 2 short examples about as
  fast as one of 64 (launch and host overhead dominate), so it is fed as many tokens per forward as fit. With
  varlen attention (which reads document bounds, not rows) a forward is instead one flat row of at most
  ``flat_width`` tokens (``data/flat.py``): almost no padding, and shapes that repeat.

On a GPU the next step is collated (and pinned) in a background thread while the current one computes, so the
device does not wait for the host between steps. The stream position saved in checkpoints is that of the last step
handed out, never of the one prefetched, so resume stays exact.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

from rocktune.data.batching import BatchStream, epoch_batches
from rocktune.data.flat import step_forwards
from rocktune.data.packing import cut_forwards, epoch_packed_batches, epoch_steps, step_rows
from rocktune.tasks.causal.split import max_pieces, split_rows

CPU_ROWS = 2  # token batching forced on a CPU: small forwards are fastest there


@dataclass(frozen=True)
class Feeding:
    """How steps are cut into forwards; built once per run from the config and the device."""

    mode: str  # "examples" | "tokens"
    micro_batch_size: int
    grad_accum: int
    max_length: int
    packing: bool  # examples mode: packed rows instead of padded examples
    rows_per_forward: int = 1  # tokens mode
    static_width: bool = False  # tokens mode: pad every row to max_length (torch.compile; steady allocator blocks)
    seed: int = 0
    flat_width: int = 0  # tokens mode with varlen attention: one row of this many tokens per forward (0: rows)
    cu_slots: int = 0  # the fixed length of a flat forward's cu_seq_lens
    batch_order: str = "mixed"  # examples mode, not packed: data.batch_order (data/batching.py)

    @property
    def examples_per_step(self) -> int:
        return self.micro_batch_size * self.grad_accum

    @property
    def packed(self) -> bool:
        """Index structures are lists of rows (collate_packed), not lists of examples."""
        return self.mode == "tokens" or self.packing

    def describe(self) -> str:
        if self.mode == "tokens" and self.flat_width:
            return (f"batching: tokens — {self.examples_per_step} examples per optimizer step packed into flat "
                    f"forwards of {self.flat_width:,} tokens (one row each, varlen attention; a step's last forward "
                    f"rounded up to 128 tokens), cu_seq_lens of {self.cu_slots} entries")
        if self.mode == "tokens":
            return (f"batching: tokens — {self.examples_per_step} examples per optimizer step packed into rows of "
                    f"{self.max_length}, up to {self.rows_per_forward} rows "
                    f"({self.rows_per_forward * self.max_length:,}"
                    f" tokens) per forward")
        kind = "packed rows" if self.packing else f"examples (batch_order {self.batch_order})"
        return (f"batching: examples — {self.micro_batch_size} {kind} per forward x {self.grad_accum} = "
                f"{self.examples_per_step} per optimizer step")


def resolve_mode(batching: str, device: str) -> str:
    if batching != "auto":
        return batching
    return "tokens" if device == "cuda" else "examples"


def rows_for_budget(micro_batch_tokens: int, max_length: int) -> int:
    """Whole rows of ``max_length`` within a token budget (at least one: a row must fit any example)."""
    return max(1, micro_batch_tokens // max_length)


def token_rows(micro_batch_tokens, max_length: int, device: str, cap: int, planned) -> tuple[int, int | None, list]:
    """(rows of max_length per forward, the planner's predicted peak or None, notes) of token batching: the
    configured budget, the CPU's CPU_ROWS, or on a GPU what ``planned()`` -> (rows, peak, note) sizes; at most
    ``cap`` (rows_per_step) but for the planner's own choice."""
    if micro_batch_tokens != "auto":
        return min(rows_for_budget(micro_batch_tokens, max_length), cap), None, []
    if device != "cuda":
        return min(CPU_ROWS, cap), None, []
    rows, peak, note = planned()
    return rows, peak, [note]


def rows_per_step(lengths: list[int], examples_per_step: int, max_length: int) -> int:
    """Rows a step of average examples packs into, plus one for packing slack: more rows per forward buy nothing."""
    mean = sum(lengths) / max(len(lengths), 1)
    return max(1, -(-int(examples_per_step * mean) // max_length) + 1)


@dataclass
class Step:
    """One optimizer step as this process sees it."""

    picked: list  # this rank's index structures (micro-batches, or forwards of rows)
    forwards: list[dict]  # this rank's collated host batches, in order
    loss_tokens: int  # loss-bearing tokens of the whole global step (every rank's share): the loss normaliser
    real_tokens: int  # non-pad tokens of this rank's share


@dataclass(frozen=True)
class Share:
    """This rank's part of every step: which of ``world`` round-robin shares it takes, the host batch with no loss
    position it runs when its share of a small step is empty, and (FSDP) whether it runs as many forwards as rank 0."""

    rank: int = 0
    world: int = 1
    idle: dict | None = None
    lockstep: bool = False


class StreamPosition:
    """Where a feed stands in its ``BatchStream`` after the last step it handed out, which is what a checkpoint saves;
    shared by every task's feed. The feed sets ``stream``, ``_items_per_step`` (stream items per optimizer step),
    ``_position`` and ``_epoch``."""

    stream: BatchStream
    _items_per_step: int
    _position: dict[str, int]
    _epoch: int

    @property
    def steps_per_epoch(self) -> int:
        return -(-len(self.stream) // self._items_per_step)

    @property
    def epoch(self) -> int:
        """The epoch of the last step handed out."""
        return self._epoch

    def position(self) -> dict[str, int]:
        """Stream position after the last step handed out: where a resumed run continues."""
        return dict(self._position)


class StepFeed(StreamPosition):
    """Hands out one optimizer step at a time. With several ranks every rank walks the same deterministic stream,
    takes its disjoint share (rows of the step, or micro-batches, dealt round-robin) and derives the
    global loss-token count from per-example counts, so the normaliser needs no communication."""

    def __init__(self, feeding: Feeding, lengths: list[int], loss_counts: list[int], collate, prefetch: bool = False,
                 share: Share = Share(), epoch: int = 0, index: int = 0):
        self.feeding = feeding
        self.lengths, self.loss_counts = lengths, loss_counts
        self.collate = collate
        self.rank, self.world = share.rank, share.world  # shares are dealt round-robin
        self.idle = share.idle  # a host batch with no loss position, for a rank whose share of a small step is empty
        # lockstep (FSDP): every rank runs as many forwards as rank 0 (whose round-robin share is the largest),
        # padding with idle batches, since each forward gathers weights from all ranks
        self.lockstep = share.lockstep
        f = feeding
        if f.mode == "tokens":
            def make(e):
                return epoch_steps(lengths, f.examples_per_step, f.seed, e)
        elif f.packing:
            def make(e):
                return epoch_packed_batches(lengths, f.micro_batch_size, f.max_length, f.seed, e)
        else:
            def make(e):
                return epoch_batches(lengths, f.micro_batch_size, f.seed, e, f.batch_order)
        self.stream = BatchStream(make, epoch, index)
        self._items_per_step = 1 if f.mode == "tokens" else f.grad_accum
        self._position = self.stream.position()
        self._epoch = self.stream.epoch
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rocktune-feed") if prefetch else None
        self._ahead: tuple | None = None  # (plan, future of collated batches, position, epoch) of the prefetched step

    def next(self) -> Step:
        if self._ahead is None:
            plan = self._plan()
            forwards = self._collate_all(plan[0])
            self._position, self._epoch = self.stream.position(), self.stream.epoch
        else:
            plan, future, self._position, self._epoch = self._ahead
            self._ahead, forwards = None, future.result()
        if self._pool is not None:
            ahead = self._plan()
            self._ahead = (ahead, self._pool.submit(self._collate_all, ahead[0]), self.stream.position(),
                           self.stream.epoch)
        mine, loss_tokens, most = plan
        real = sum(self.lengths[i] for i in _examples(mine, self.feeding.packed))
        pad = max(most if self.lockstep else 0, 1) - len(forwards)
        idle = cast(dict, self.idle)  # set wherever a share can be empty (pad > 0)
        return Step(mine, forwards + [idle] * max(pad, 0), loss_tokens, real)

    split = staticmethod(split_rows)  # the OOM split: never inside an example
    max_pieces = staticmethod(max_pieces)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _plan(self) -> tuple[list, int, int]:
        """(this rank's index structures, the global step's loss-bearing tokens, the most forwards any rank runs)."""
        items = [self.stream.next() for _ in range(self._items_per_step)]
        f = self.feeding
        if f.mode == "tokens":
            everything = items[0]
            if f.flat_width:  # one row per forward: forwards are dealt round-robin, not rows
                flat = [[row] for row in step_forwards(everything, self.lengths, f.flat_width)]
                return flat[self.rank :: self.world], sum(self.loss_counts[i] for i in everything), \
                    len(flat[:: self.world])
            rows = step_rows(everything, self.lengths, f.max_length)
            mine = cut_forwards(rows[self.rank :: self.world], f.rows_per_forward)
            most = len(cut_forwards(rows[:: self.world], f.rows_per_forward))  # rank 0's share is the largest
        else:
            everything = _examples(items, f.packing)
            mine = items[self.rank :: self.world]
            most = len(items[:: self.world])
        return mine, sum(self.loss_counts[i] for i in everything), most

    def _collate_all(self, picked: list) -> list[dict]:
        return [self.collate(p) for p in picked]


def _examples(structures: list, packed: bool) -> list[int]:
    """Example indices in micro-batches (lists of indices) or forwards/batches of rows (lists of lists)."""
    return [i for s in structures for row in s for i in row] if packed else [i for s in structures for i in s]
