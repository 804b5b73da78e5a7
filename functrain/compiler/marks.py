"""The two marks the staged loss places in a step and functrain's graph passes read.

Internals: docs/internals.md "functrain.compiler.marks".
"""

from __future__ import annotations

import torch

__all__ = ["mark_forward_done", "remat_barrier"]


@torch.library.custom_op("functrain::remat_barrier", mutates_args=())
def remat_barrier(x: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """A copy of `x` that the compiler cannot compute before `after` exists nor merge with `x`'s producer.

    Args:
      x: the tensor to pass through (a saved block input).
      after: any tensor the result must wait for (the cotangent arriving at that block); unused.

    Returns:
      `x.clone()`.

    Example:
      >>> h = remat_barrier(saved_input, cotangent)   # then recompute the block from h
    """
    return x.clone()


@remat_barrier.register_fake
def _remat_barrier_fake(x, after):
    """Shape/dtype propagation for tracing."""
    return torch.empty_like(x)


@torch.library.custom_op("functrain::forward_done", mutates_args=())
def mark_forward_done(h: torch.Tensor) -> torch.Tensor:
    """A copy of `h` that marks, in a traced step, the end of the blocks' forward.

    Args:
      h: the last block's output (the head's input).

    Returns:
      `h.clone()`; `RegatherPass` regathers, for their readers after this point, the parameters
      gathered before it.

    Example:
      >>> h = mark_forward_done(h)
    """
    return h.clone()


@mark_forward_done.register_fake
def _forward_done_fake(h):
    """Shape/dtype propagation for tracing."""
    return torch.empty_like(h)
