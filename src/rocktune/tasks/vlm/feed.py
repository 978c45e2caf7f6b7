"""What each optimizer step of a vision-language run feeds the model: micro-batches of whole examples, collated by
tasks/vlm/data/vision_batch.py, or with ``data.packing`` micro-batches of packed rows of examples
(tasks/vlm/data/vision_pack.py), or with ``training.batching: tokens`` the step's examples packed into rows and cut into
forwards of rows (``TokenVisionFeed``, the text tasks' token batching, tasks/causal/feed.py); the OOM split cuts between
examples or rows (each with its own pixels and grids), never through one.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from rocktune.data.batching import BatchOrder, BatchStream, epoch_batches
from rocktune.data.packing import cut_forwards, epoch_packed_batches, epoch_steps, step_rows
from rocktune.tasks.vlm.data.vision import VisionExample
from rocktune.tasks.vlm.data.vision_batch import loss_count
from rocktune.tasks.causal.feed import Step, StreamPosition

ROW_KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "token_type_ids", "pixel_rows",
            "image_counts", "text_position_ids")
PIXEL_KEYS = ("pixel_values", "pixel_attention_mask")  # cut by pixel_rows
IMAGE_KEYS = ("image_grid_thw",)  # one entry per image


def split_rows(batch: dict, pieces: int) -> list[dict]:
    """The OOM split: whole examples, each with its own pixels and grids."""
    rows = batch["input_ids"].shape[0]
    if pieces == 1 or rows == 1:
        return [batch]
    size = -(-rows // pieces)
    pix = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), batch["pixel_rows"]]), 0).tolist()
    img = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), batch["image_counts"]]), 0).tolist()
    parts = []
    for i in range(0, rows, size):
        j = min(i + size, rows)
        part = {k: batch[k][i:j] for k in ROW_KEYS if k in batch}
        if img[j] > img[i]:
            part.update({k: batch[k][pix[i] : pix[j]] for k in PIXEL_KEYS if k in batch})
            part.update({k: batch[k][img[i] : img[j]] for k in IMAGE_KEYS if k in batch})
        parts.append(part)
    return parts


class VisionFeed(StreamPosition):
    """``grad_accum`` micro-batches of ``micro_batch_size`` examples (in ``order``, data.batch_order) per optimizer
    step; the step's normaliser is its loss-bearing tokens. ``prefetch`` (a GPU): the next step's images are decoded
    and processed in a background thread while this step computes (about 1-2 s for 8 photos on one CPU thread,
    docs/vision.md); the position a checkpoint saves is still that of the last step handed out, so resume stays
    exact."""

    split = staticmethod(split_rows)

    def __init__(self, examples: list[VisionExample], shape: tuple[int, int, int], make_batch, prefetch: bool = False,
                 share=(0, 1, None), pack_to: int = 0, epoch: int = 0, index: int = 0, order: BatchOrder = "mixed"):
        micro_batch_size, self.grad_accum, seed = shape
        self.examples, self.make_batch = examples, make_batch
        # several ranks (DDP): every rank walks the same stream and takes the step's micro-batches round-robin; a rank
        # whose share of a small step is empty runs ``idle`` (no loss, no image) so that every rank's backward meets
        self.rank, self.world, self.idle = share
        self.lengths = [len(e.input_ids) for e in examples]
        self.counts = [loss_count(e) for e in examples]
        # pack_to (data.packing: data.max_length): a micro-batch is micro_batch_size rows of examples packed best-fit
        self.packed = pack_to > 0
        self.stream = BatchStream(self._epochs(micro_batch_size, seed, pack_to, order), epoch, index)
        self._items_per_step = self.grad_accum
        self._position, self._epoch = self.stream.position(), self.stream.epoch
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rocktune-vision-feed") if prefetch else None
        self._ahead: tuple | None = None  # (items, future of their batches, position, epoch) of the prefetched step

    def _epochs(self, micro_batch_size: int, seed: int, pack_to: int, order: BatchOrder):
        """The stream's ``make_epoch``: one epoch's micro-batches (of examples, or of packed rows)."""
        lengths = self.lengths
        if self.packed:
            return lambda e: epoch_packed_batches(lengths, micro_batch_size, pack_to, seed, e)
        return lambda e: epoch_batches(lengths, micro_batch_size, seed, e, order)

    def next(self) -> Step:
        if self._ahead is None:
            mine, every = self._plan()
            forwards = self._collate(mine)
            self._position, self._epoch = self.stream.position(), self.stream.epoch
        else:
            (mine, every), future, self._position, self._epoch = self._ahead
            self._ahead, forwards = None, future.result()
        if self._pool is not None:
            ahead = self._plan()
            self._ahead = (ahead, self._pool.submit(self._collate, ahead[0]), self.stream.position(),
                           self.stream.epoch)
        real = sum(self.lengths[i] for item in mine for i in self._indices(item))
        return Step(mine, forwards or [self.idle], sum(self.counts[i] for i in every), real)

    def _plan(self) -> tuple[list, list[int]]:
        """(this rank's micro-batches, every example index of the global step: the loss normaliser's)."""
        items = [self.stream.next() for _ in range(self.grad_accum)]
        return items[self.rank :: self.world], [i for item in items for i in self._indices(item)]

    def _indices(self, item: list) -> list[int]:
        return [i for row in item for i in row] if self.packed else item

    def _collate(self, items: list) -> list[dict]:
        if self.packed:
            return [self.make_batch([[self.examples[i] for i in row] for row in item]) for item in items]
        return [self.make_batch([self.examples[i] for i in item]) for item in items]

    def max_pieces(self, batch: dict) -> int:
        return batch["input_ids"].shape[0]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


class TokenVisionFeed(VisionFeed):
    """``training.batching: tokens`` for task=vlm, as tasks/causal/feed.py's token batching: a step's
    ``micro_batch_size x grad_accum`` conversations drawn uniformly (``epoch_steps``: no length sort, packing removes
    the padding that sorting avoids), packed longest-first best-fit into rows of ``max_length`` tokens (each row one
    long conversation to the collate, tasks/vlm/data/vision_pack.py), then cut into as few forwards of at most
    ``rows_per_forward`` rows as possible. With several ranks the rows are dealt round-robin before the cut; a rank
    whose share is empty runs ``idle``. The stream's item is a whole step, so a checkpoint's position counts steps.
    ``rows``: (max_length, rows_per_forward)."""

    def __init__(self, examples: list[VisionExample], shape: tuple[int, int, int], make_batch, prefetch: bool = False,
                 share=(0, 1, None), rows: tuple[int, int] = (0, 1), epoch: int = 0, index: int = 0):
        self.max_length, self.rows_per_forward = rows
        super().__init__(examples, shape, make_batch, prefetch, share, self.max_length, epoch, index)
        self._items_per_step = 1

    def _epochs(self, micro_batch_size: int, seed: int, pack_to: int, order: BatchOrder):
        lengths, per_step = self.lengths, micro_batch_size * self.grad_accum
        return lambda e: epoch_steps(lengths, per_step, seed, e)

    def _plan(self) -> tuple[list, list[int]]:
        every = self.stream.next()
        rows = step_rows(every, self.lengths, self.max_length)
        return cut_forwards(rows[self.rank :: self.world], self.rows_per_forward), every
