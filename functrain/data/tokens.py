"""Many flat token files read as one: `ConcatTokens`, a 1-D view over memory-mapped shards.

Example:
    >>> toks = ConcatTokens([np.memmap("a.bin", np.uint16), np.memmap("b.bin", np.uint16)])
    >>> window = toks[len(a) - 2:len(a) + 3]   # crosses the boundary: 5 tokens
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["ConcatTokens"]


class ConcatTokens:
    """The concatenation of 1-D token arrays without copying them; supports `len` and slices.

    Args:
      arrays: the pieces in order (e.g. read-only `np.memmap`s).
      dtype: their dtype (used when there is no piece).

    Example:
      >>> toks = ConcatTokens([np.arange(3), np.arange(3, 7)])
      >>> toks[2:5]
      array([2, 3, 4])
    """

    def __init__(self, arrays: Sequence[np.ndarray], dtype=None):
        self.arrays = [a for a in arrays if len(a)]
        self.dtype = np.dtype(dtype if dtype is not None else (self.arrays[0].dtype if self.arrays else np.uint16))
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays])  # piece i holds [offsets[i], offsets[i+1])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index) -> np.ndarray:
        if not isinstance(index, slice):
            i = int(index) + (len(self) if int(index) < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(index)
            piece = int(np.searchsorted(self.offsets, i, side="right")) - 1
            return self.arrays[piece][i - self.offsets[piece]]
        start, stop, step = index.indices(len(self))
        if step != 1:
            return self[start:stop][::step]
        if stop <= start:
            return np.zeros(0, self.dtype)
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        last = int(np.searchsorted(self.offsets, stop, side="left")) - 1
        parts = [
            self.arrays[p][max(start - self.offsets[p], 0) : min(stop, self.offsets[p + 1]) - self.offsets[p]]
            for p in range(first, last + 1)
        ]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """All the tokens as one array (a copy; `np.asarray(toks)`, `np.max(toks)`)."""
        return self[:] if dtype is None else self[:].astype(dtype)

    def __repr__(self) -> str:
        return f"ConcatTokens({len(self):,} tokens in {len(self.arrays)} pieces, {self.dtype})"
