"""Python's cyclic garbage collector during a run's steps: what is alive after the first step is kept out of its scans.

A run holds millions of long-lived Python objects: transformers' modules and configs, torch's and the compiler's
graphs, guards and caches. A full collection walks them all, 85-270 ms each on the GRPO bench's tiny model on the
CPU here (measured with ``gc.callbacks``), and one lands in a step now and then: a rollout that took 57-92 ms took
366 ms with one in it. After the first step (model, optimizer and any compiled graph in place) the engine collects
once and freezes what is alive (``gc.freeze``: moved to a generation the collector never scans; reference counting
still frees whatever is not in a cycle), so later collections walk only what the steps create.

The run thaws it on its way out (``gc.unfreeze``), however it ends: a ``train()`` called inside someone else's
program (a notebook, a test session) leaves their collector as it found it. A process that had already frozen
objects of its own is left alone.
"""

from __future__ import annotations

import gc


class Collector:
    def __init__(self) -> None:
        self.frozen = False

    def settle(self) -> None:
        """After the first step: collect once, then keep everything alive out of later scans."""
        if self.frozen or gc.get_freeze_count():
            return
        gc.collect()
        gc.freeze()
        self.frozen = True

    def close(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
