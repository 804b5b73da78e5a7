"""Rows of examples: one example per row (padded), or whole examples packed by best-fit-decreasing.

Internals: docs/internals.md "functrain.data.packing".

Example:
    >>> rows = best_fit_decreasing(examples.lengths, 512, order=np.arange(len(examples)))
    >>> x, y, pos = assemble(examples, rows[:8], 512, pad_id=0)        # (8, 512) each
"""

from __future__ import annotations

import bisect

import numpy as np

from functrain.data.examples import ExampleSet
from functrain.data.supervised import IGNORE

__all__ = ["assemble", "best_fit_decreasing", "efficiency"]


def best_fit_decreasing(lengths: np.ndarray, capacity: int, order: np.ndarray) -> list[list[int]]:
    """Example ids packed into rows of `capacity`: longest first (ties in `order`), each into the row with
    the least room that still fits it, a new row when none does.

    Args:
      lengths: each example's pairs (<= capacity).
      capacity: the row length (block_size).
      order: a permutation of the examples: breaks ties between equal lengths (and so varies the rows
        from epoch to epoch while their number stays the same).

    Returns:
      The rows, in the order they were opened; each a list of example ids in the order they were placed.

    Example:
      >>> best_fit_decreasing(np.array([3, 5, 2, 4]), 6, np.arange(4))
      [[1], [3, 2], [0]]
    """
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    ids = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), int(rank[i])))
    rooms: list[tuple[int, int]] = []  # (room left, row), sorted
    rows: list[list[int]] = []
    for i in ids:
        n = int(lengths[i])
        at = bisect.bisect_left(rooms, (n, -1))
        if at < len(rooms):
            room, row = rooms.pop(at)
            rows[row].append(i)
            bisect.insort(rooms, (room - n, row))
        else:
            rows.append([i])
            bisect.insort(rooms, (capacity - n, len(rows) - 1))
    return rows


def assemble(examples: ExampleSet, rows: list[list[int]], block_size: int, pad_id: int):
    """The (x, y, positions) int64 arrays (R, block_size) of rows of example ids.

    Args:
      examples: the examples the ids index.
      rows: per row, the examples it holds in order (their pairs fit in `block_size`); [] for an empty row.
      block_size: the row length.
      pad_id: the input id of padding (its targets are IGNORE whatever it is).

    Returns:
      x (inputs), y (targets, IGNORE where not learned) and positions (restarting at 0 at each example
      and at the padding), each (R, block_size).

    Example:
      >>> x, y, pos = assemble(examples, [[0, 3], [1]], 16, pad_id=0)
    """
    r = len(rows)
    x = np.full((r, block_size), pad_id, np.int64)
    y = np.full((r, block_size), IGNORE, np.int64)
    pos = np.zeros((r, block_size), np.int64)
    for j, row in enumerate(rows):
        at = 0
        for i in row:
            xi, yi = examples.pair(i)
            n = len(xi)
            x[j, at : at + n], y[j, at : at + n], pos[j, at : at + n] = xi, yi, np.arange(n)
            at += n
        pos[j, at:] = np.arange(block_size - at)  # the padding: a document of its own
    return x, y, pos


def efficiency(examples: ExampleSet, tokens: int) -> tuple[float, float]:
    """(target tokens, real tokens) over the `tokens` of the rows that hold every example once: how full they are.

    Example:
      >>> efficiency(train, len(rows) * 512)      # e.g. (0.41, 0.93) packed, (0.12, 0.27) padded to the block
    """
    total = max(1, tokens)
    return examples.target_count() / total, int(examples.lengths.sum()) / total
