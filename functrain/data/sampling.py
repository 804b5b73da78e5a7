"""Which windows make the batch of a step: random windows, epochs without replacement, mixtures.

Internals: docs/internals.md "functrain.data.sampling".

Example:
    >>> sampler = Sampler([("web", web.train, 0.7), ("code", code.train, 0.3)], batch_size=32,
    ...                   block_size=256, seed=0, sampling="epochs")
    >>> x, y = sampler.batch(step=100, rank=0, world=2)   # (16, 256) each
    >>> sampler.position(100)                          # {"epoch/web": 0, "epoch_fraction/web": 0.41, ...}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from functrain.data.batches import TRAIN_STREAM, inputs_targets, window_rows, window_starts
from functrain.data.errors import DataError

__all__ = ["SAMPLINGS", "Sampler", "mixture_rows", "permute", "stream_hash"]

SAMPLINGS = ("windows", "epochs")
_U64 = (1 << 64) - 1
_EPOCH_STREAM, _MIX_STREAM, _WINDOW_STREAM = 2, 3, 4


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def stream_hash(*values: int) -> int:
    """A 64-bit hash of a tuple of ints (e.g. a stream number, the seed and an epoch: a `permute` key)."""
    h = np.zeros(1, np.uint64)
    for v in values:
        h = _mix(h ^ np.uint64(int(v) & _U64))
    return int(h[0])


def permute(index: np.ndarray, n: int, key: int, rounds: int = 6) -> np.ndarray:
    """A keyed bijection of [0, n) applied to `index` (vectorized; no table of n entries).

    Args:
      index: int array of values in [0, n).
      n: the domain size (>= 1).
      key: a 64-bit key: each key gives another permutation.
      rounds: Feistel rounds.

    Returns:
      int64 array: the images of `index`.

    Example:
      >>> sorted(permute(np.arange(10), 10, key=7)) == list(range(10))
      True
    """
    half = max(1, math.ceil(math.log2(max(n, 2)) / 2))  # 4 ** half >= n
    mask = np.uint64((1 << half) - 1)
    keys = [np.uint64(stream_hash(key, r)) for r in range(rounds)]

    def feistel(x):
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    out = feistel(np.asarray(index, dtype=np.uint64))
    todo = out >= np.uint64(n)
    while todo.any():  # cycle-walk: stays a bijection of [0, n)
        out[todo] = feistel(out[todo])
        todo = out >= np.uint64(n)
    return out.astype(np.int64)


def _split(w: np.ndarray, k: int, seed: int) -> tuple[float, float]:
    """Split k of the cascade: source k's share p of the weight left, and the seeded offset t in [0, 1)."""
    return min(w[k] / w[k:].sum(), 1.0 - 1e-12), (stream_hash(_MIX_STREAM, seed, k) >> 11) / float(1 << 53)


def mixture_rows(rows: np.ndarray, weights: Sequence[float], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The source of each global row and its number among that source's rows.

    Args:
      rows: global row indices (step * batch_size + i), int64.
      weights: one positive weight per source.
      seed: the data seed (moves the cascade's offsets).

    Returns:
      (source, index): int64 arrays like `rows`; `index` counts the source's rows before this one.

    Example:
      >>> src, j = mixture_rows(np.arange(10), [0.7, 0.3], seed=0)
      >>> (src == 0).sum()   # 7 (to within one)
    """
    w = np.asarray(weights, np.float64)
    source = np.full(len(rows), len(w) - 1, np.int64)
    index = np.asarray(rows, np.int64).copy()
    left = np.ones(len(rows), bool)  # rows that reach split k
    for k in range(len(w) - 1):
        p, t = _split(w, k, seed)
        i = index[left].astype(np.float64)
        before = np.floor(i * p + t)  # rows before i that went to source k (floor(t) = 0)
        here = np.floor((i + 1) * p + t) > before
        picked = np.flatnonzero(left)[here]
        source[picked] = k
        index[picked] = before[here].astype(np.int64)
        rest = np.flatnonzero(left)[~here]
        index[rest] = (i[~here] - before[~here]).astype(np.int64)
        left[picked] = False
    return source, index


def mixture_counts(n_rows: int, weights: Sequence[float], seed: int) -> list[int]:
    """How many of the first `n_rows` global rows each source got (the closed form of `mixture_rows`)."""
    counts = []
    left = n_rows
    w = np.asarray(weights, np.float64)
    for k in range(len(w) - 1):
        p, t = _split(w, k, seed)
        mine = int(np.floor(np.float64(left) * p + t))
        counts.append(mine)
        left -= mine
    return counts + [left]


class Sampler:
    """The training batches of one source or a weighted mixture, by `windows` or `epochs`.

    Args:
      sources: (name, 1-D token array, weight) per source; one source for a plain run.
      batch_size: the GLOBAL batch size (rows), divisible by the data-parallel world.
      block_size: window length T.
      seed: the data seed.
      sampling: "windows" (random windows, with replacement) or "epochs" (each window once per epoch).

    Raises:
      DataError: a source too short for one window, a bad sampling name or weight (one line).

    Example:
      >>> sampler = Sampler([("data", ds.train, 1.0)], batch_size=32, block_size=128, seed=0, sampling="epochs")
      >>> x, y = sampler.batch(7)
    """

    def __init__(
        self,
        sources: Sequence[tuple[str, Any, float]],
        *,
        batch_size: int,
        block_size: int,
        seed: int,
        sampling: str = "windows",
    ):
        if sampling not in SAMPLINGS:
            raise DataError(f"data.sampling={sampling!r}: use one of {', '.join(SAMPLINGS)}")
        if not sources:
            raise DataError("no data source; set data.path or data.sources")
        for name, tokens, weight in sources:
            if not (isinstance(weight, (int, float)) and weight > 0 and math.isfinite(weight)):
                raise DataError(f"data.mixture[{name!r}]={weight!r}: weights must be positive numbers")
            if len(tokens) < block_size + 1:
                raise DataError(
                    f"data source {name!r} has {len(tokens)} train tokens, fewer than block_size + 1 = "
                    f"{block_size + 1}; use more data or a smaller block_size"
                )
        self.names = [s[0] for s in sources]
        self.tokens = [s[1] for s in sources]
        self.weights = [float(s[2]) for s in sources]
        self.batch_size, self.block_size, self.seed, self.sampling = batch_size, block_size, int(seed), sampling
        self.windows = [(len(t) - 1) // block_size for t in self.tokens]  # windows per epoch

    def _starts(self, k: int, index: np.ndarray) -> np.ndarray:
        """Start offsets of source k's windows number `index` (its own row count)."""
        n, T = len(self.tokens[k]), self.block_size
        if self.sampling == "epochs":
            W = self.windows[k]
            epochs, pos = np.divmod(index, W)
            out = np.empty(len(index), np.int64)
            for e in np.unique(epochs):
                sel = epochs == e
                out[sel] = permute(pos[sel], W, stream_hash(_EPOCH_STREAM, self.seed, k, int(e))) * T
            return out
        keys = _mix(np.uint64(stream_hash(_WINDOW_STREAM, self.seed, k)) ^ index.astype(np.uint64))
        return (keys % np.uint64(n - T)).astype(np.int64)

    def batch(
        self, step: int, rank: int = 0, world: int = 1, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of step `step`'s global batch.

        Args:
          step: the training step (an int or a 0-d tensor).
          rank: this data-parallel rank.
          world: the number of data-parallel ranks (divides the batch size).
          device: where to put the tensors (default CPU).

        Returns:
          (x, y) int64 tensors of shape (batch_size // world, block_size), y = x shifted by one token.

        Example:
          >>> x, y = sampler.batch(10, rank=1, world=2)
        """
        step = int(step)
        if len(self.tokens) == 1 and self.sampling == "windows":  # today's random windows, bit for bit
            starts = window_starts(len(self.tokens[0]), self.batch_size, self.block_size, TRAIN_STREAM, self.seed, step)
            return window_rows(self.tokens[0], starts, self.block_size, rank, world, device)
        if world < 1 or not 0 <= rank < world or self.batch_size % world:
            raise ValueError(
                f"need 0 <= rank < world dividing batch_size {self.batch_size}, got rank={rank}, world={world}"
            )
        b = self.batch_size // world
        rows = step * self.batch_size + rank * b + np.arange(b, dtype=np.int64)
        source, index = self.rows(rows)
        windows = np.empty((b, self.block_size + 1), np.int64)  # (B_local, T + 1)
        for k in np.unique(source):
            sel = np.flatnonzero(source == k)
            for row, s in zip(sel, self._starts(int(k), index[sel])):
                windows[row] = self.tokens[k][s : s + self.block_size + 1]
        return inputs_targets(windows, device)

    def rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, that source's row number) of global rows (all source 0 with one source)."""
        if len(self.tokens) == 1:
            return np.zeros(len(rows), np.int64), np.asarray(rows, np.int64)
        return mixture_rows(rows, self.weights, self.seed)

    def position(self, step: int) -> dict[str, float]:
        """Where the run is in its data after `step` steps: epoch and fraction consumed (epochs only).

        Args:
          step: steps done.

        Returns:
          {"epoch": e, "epoch_fraction": f} for one source ("/<name>" after each key for a
          mixture); {} for `windows` sampling.

        Example:
          >>> sampler.position(1000)
          {'epoch': 2, 'epoch_fraction': 0.375}
        """
        if self.sampling != "epochs":
            return {}
        n = int(step) * self.batch_size
        counts = [n] if len(self.tokens) == 1 else mixture_counts(n, self.weights, self.seed)
        out: dict[str, float] = {}
        for name, count, W in zip(self.names, counts, self.windows):
            suffix = "" if len(self.tokens) == 1 else f"/{name}"
            out[f"epoch{suffix}"] = count // W
            out[f"epoch_fraction{suffix}"] = (count % W) / W
        return out
