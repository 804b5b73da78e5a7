"""Batches under data parallelism: each dp rank feeds the step its rows of the same global batch.

Internals: docs/internals.md "functrain.parallel.data".

Example:
    >>> x, y = data.get_batch(ds.train, data.Batching(B, T), s, **parallel.data_parallel_kwargs(ctx))
    >>> state, metrics = step(state, (x, y))
"""

from __future__ import annotations

from typing import Any

import torch

from functrain import tree as tree_lib

__all__ = ["data_parallel_kwargs", "split_batch"]

PyTree = Any


def data_parallel_kwargs(ctx) -> dict:
    """`rank`, `world` and `device` for `functrain.data.get_batch` / `eval_batches`.

    Args:
      ctx: the `ParallelContext` from `parallel.setup`.

    Returns:
      {"rank": ctx.dp_rank, "world": ctx.dp_world, "device": ctx.device}.

    Example:
      >>> x, y = get_batch(tokens, Batching(32, 256), s, **data_parallel_kwargs(ctx))
    """
    return {"rank": ctx.dp_rank, "world": ctx.dp_world, "device": ctx.device}


def split_batch(batch: PyTree, dp_rank: int, dp_world: int, device: torch.device | str | None = None) -> PyTree:
    """This dp rank's contiguous rows of a global batch (the same split as `get_batch`).

    Args:
      batch: a pytree of tensors whose leading dim is the global batch size.
      dp_rank: this rank's data-parallel index (`ctx.dp_rank`).
      dp_world: the number of data-parallel ranks (`ctx.dp_world`).
      device: optional device to move the rows to.

    Returns:
      The same pytree with rows [dp_rank * B / dp_world, (dp_rank + 1) * B / dp_world).

    Raises:
      ValueError: the batch size is not divisible by `dp_world`.

    Example:
      >>> local = split_batch((x, y), ctx.dp_rank, ctx.dp_world)
    """

    def rows(x):
        if x.shape[0] % dp_world:
            raise ValueError(f"batch size {x.shape[0]} is not divisible by the data-parallel world size {dp_world}")
        b = x.shape[0] // dp_world
        out = x[dp_rank * b : (dp_rank + 1) * b].contiguous()
        return out if device is None else out.to(device)

    return tree_lib.map(rows, batch)
