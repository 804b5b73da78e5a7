"""Formulations the compiled step relies on: a deterministic embedding, and per-step scalars.

Internals: docs/internals.md "functrain.ops".

Example:
    >>> x = ops.embedding(params["wte.weight"], idx)      # (B, T) ids -> (B, T, C)
    >>> lr, bc1 = ops.hoist(lr, bc1)                        # computed once, read by every loop
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["embedding", "hoist"]


def embedding(weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows of `weight` at `idx`, with a gradient that compiles to a deterministic kernel on CPU.

    Same values and gradients as `F.embedding(idx, weight)` (no padding index, no max norm).

    Args:
      weight: the table, (V, C).
      idx: integer ids of any shape (...), each in [0, V).

    Returns:
      (..., C): `weight[idx]`.

    Example:
      >>> h = embedding(params["wte.weight"], x)   # (B, T, C)
    """
    if weight.device.type != "cpu":
        return F.embedding(idx, weight)
    flat = idx.reshape(-1, 1).expand(-1, weight.shape[1])  # (N, C): row idx[n] in every column
    return torch.gather(weight, 0, flat).reshape(*idx.shape, weight.shape[1])  # (..., C)


@torch.library.custom_op("functrain::hoist", mutates_args=())
def _hoist_op(packed: torch.Tensor) -> torch.Tensor:
    """A copy of `packed` that the compiler cannot inline into its consumers."""
    return packed.clone()


@_hoist_op.register_fake
def _(packed):
    return torch.empty_like(packed)


def _hoist_vmap(info, in_dims, packed):
    """Batched input, batched output (the op is an identity)."""
    return _hoist_op(packed), in_dims[0]


_hoist_op.register_vmap(_hoist_vmap)
_hoist_op.register_autograd(lambda ctx, grad: grad)


def hoist(*scalars: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same 0-d values, computed once per call of the compiled function instead of per element.

    Args:
      *scalars: 0-d tensors (floats, ints or bools; flags come back as 0.0 / 1.0).

    Returns:
      0-d tensors with the same values, in the same order: float64 when any input is float64
      (a float32 loop multiplying by one converts it once, scalar), else float32.

    Example:
      >>> inv_bc1, inv_bc2 = ops.hoist(1 / bc1, 1 / bc2_sqrt)   # bc1, bc2_sqrt in float64
    """
    if not scalars:
        return ()
    wide = any(s.dtype == torch.float64 for s in scalars)
    dtype = torch.float64 if wide else torch.float32
    packed = _hoist_op(torch.stack([s.to(dtype).reshape(()) for s in scalars]))  # (k,)
    return tuple(packed.unbind(-1))
