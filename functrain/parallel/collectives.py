"""The functional collectives the parallel modules share, under one set of public names.

Internals: docs/internals.md "functrain.parallel.collectives".

Example:
    >>> full = wait(all_gather(shard, 0, (mesh, dim)))     # (N * rows, ...)
    >>> mine = wait(reduce_scatter(full, "sum", 0, group))  # (rows, ...)
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

__all__ = ["all_gather", "reduce_scatter", "wait"]

all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
"""`all_gather(x, gather_dim, group)`: the ranks' `x` concatenated along `gather_dim`."""

reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
"""`reduce_scatter(x, op, scatter_dim, group)`: `x` reduced over the ranks, this rank's block kept."""


def wait(x: torch.Tensor) -> torch.Tensor:
    """The value of a functional collective's result (waits in eager mode; traced code passes through).

    Args:
      x: a collective's result.

    Returns:
      A plain tensor.

    Example:
      >>> total = wait(funcol.all_reduce(x, "sum", group))
    """
    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x
