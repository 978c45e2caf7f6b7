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
        return _inner_counts(self.flat, self.offsets, lambda x: x != IGNORE)[self.index]

    def rows_with(self, values: list[int]) -> int:
        """Rows holding any of ``values`` after their first position (a trained end token)."""
        return int((_inner_counts(self.flat, self.offsets, lambda x: np.isin(x, values))[self.index] > 0).sum())


BLOCK = 1 << 20  # tokens per pass: the temporary arrays stay near 10 MB however large the set


def _inner_counts(flat: np.ndarray, offsets: np.ndarray, test) -> np.ndarray:
    """Per stored row: positions 1.. where ``test`` holds; the flat array is read in blocks of whole rows."""
    out = np.zeros(len(offsets) - 1, dtype=np.int64)
    row = 0
    while row < len(out):
        end = int(np.searchsorted(offsets, offsets[row] + BLOCK, side="right")) - 1
        end = min(max(end, row + 1), len(out))  # at least one row, however long
        base = int(offsets[row])
        cum = np.concatenate([[0], np.cumsum(test(flat[base:int(offsets[end])]), dtype=np.int64)])
        starts, ends = offsets[row:end] - base, offsets[row + 1:end + 1] - base
        out[row:end] = cum[ends] - cum[np.minimum(starts + 1, ends)]
        row = end
    return out


def from_lists(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Flat int32 array and int64 offsets of ``rows``."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    flat = np.fromiter((t for r in rows for t in r), dtype=np.int32, count=int(offsets[-1]))
    return flat, offsets
