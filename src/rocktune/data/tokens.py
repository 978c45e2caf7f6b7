"""Examples as rows of flat token arrays: ``ids[offsets[i]:offsets[i + 1]]`` is example i.

The arrays are memory-mapped from the token cache, so every rank on a host maps the same pages instead of holding
its own copy, and nothing is turned into Python lists until a batch asks for its rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rocktune.data.encode import IGNORE


class TokenRows(Sequence):
    """A read-only sequence of ``list[int]`` rows over one flat array; ``index`` selects (and orders) rows."""

    def __init__(self, flat: np.ndarray, offsets: np.ndarray, index: np.ndarray | None = None):
        self.flat, self.offsets = flat, offsets
        self.index = np.arange(len(offsets) - 1) if index is None else np.asarray(index, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return TokenRows(self.flat, self.offsets, self.index[i])
        row = self.index[i]
        return self.flat[self.offsets[row]:self.offsets[row + 1]].tolist()

    def __eq__(self, other) -> bool:
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def lengths(self) -> np.ndarray:
        return (self.offsets[self.index + 1] - self.offsets[self.index]).astype(np.int64)

    def take(self, idx) -> TokenRows:
        return TokenRows(self.flat, self.offsets, self.index[np.asarray(idx, dtype=np.int64)])

    def loss_counts(self) -> np.ndarray:
        """Loss-bearing labels per row after the causal shift (position 0 never counts), without a Python loop."""
        trained = np.asarray(self.flat != IGNORE, dtype=np.int64)
        cum = np.concatenate([[0], np.cumsum(trained)])
        starts, ends = self.offsets[self.index], self.offsets[self.index + 1]
        first = np.where(ends > starts, trained[np.minimum(starts, max(len(trained) - 1, 0))], 0)
        return cum[ends] - cum[starts] - first


def from_lists(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Flat int32 array and int64 offsets of ``rows``."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    flat = np.fromiter((t for r in rows for t in r), dtype=np.int32, count=int(offsets[-1]))
    return flat, offsets
