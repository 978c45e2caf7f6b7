"""What each optimizer step of a vision-language run feeds the model: micro-batches of whole examples, collated by
data/vision_batch.py, or with ``data.packing`` micro-batches of packed rows of examples (data/vision_pack.py); the
OOM split cuts between examples or rows (each with its own pixels and grids), never through one.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from rocktune.data.batching import BatchStream, epoch_batches
from rocktune.data.packing import epoch_packed_batches
from rocktune.data.vision import VisionExample
from rocktune.data.vision_batch import loss_count
from rocktune.tasks.lm.feed import Step, StreamPosition

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
                 share=(0, 1, None), pack_to: int = 0, epoch: int = 0, index: int = 0, order: str = "mixed"):
        micro_batch_size, self.grad_accum, seed = shape
        self.examples, self.make_batch = examples, make_batch
        # several ranks (DDP): every rank walks the same stream and takes the step's micro-batches round-robin; a rank
        # whose share of a small step is empty runs ``idle`` (no loss, no image) so that every rank's backward meets
        self.rank, self.world, self.idle = share
        lengths = [len(e.input_ids) for e in examples]
        self.counts = [loss_count(e) for e in examples]
        # pack_to (data.packing: data.max_length): a micro-batch is micro_batch_size rows of examples packed best-fit
        self.packed = pack_to > 0
        batches = (lambda e: epoch_packed_batches(lengths, micro_batch_size, pack_to, seed, e)) if self.packed else \
            (lambda e: epoch_batches(lengths, micro_batch_size, seed, e, order))
        self.stream = BatchStream(batches, epoch, index)
        self._items_per_step = self.grad_accum
        self._position, self._epoch = self.stream.position(), self.stream.epoch
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rocktune-vision-feed") if prefetch else None
        self._ahead = None  # (items, future of their batches, position, epoch) of the prefetched step

    def next(self) -> Step:
        if self._ahead is None:
            items = self._take()
            forwards = self._collate(self._mine(items))
            self._position, self._epoch = self.stream.position(), self.stream.epoch
        else:
            items, future, self._position, self._epoch = self._ahead
            self._ahead, forwards = None, future.result()
        if self._pool is not None:
            ahead = self._take()
            self._ahead = (ahead, self._pool.submit(self._collate, self._mine(ahead)), self.stream.position(),
                           self.stream.epoch)
        every = [i for item in items for i in self._indices(item)]
        real = sum(len(self.examples[i].input_ids) for item in self._mine(items) for i in self._indices(item))
        return Step(self._mine(items), forwards or [self.idle], sum(self.counts[i] for i in every), real)

    def _mine(self, items: list) -> list:
        return items[self.rank :: self.world]

    def _take(self) -> list:
        return [self.stream.next() for _ in range(self.grad_accum)]

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
