"""Mixed precision: compute in bf16 or fp16 while the state keeps fp32 master params.

Internals: docs/internals.md "functrain.step.precision".

Example:
    >>> step = make_train_step(loss_fn, optim.adamw(3e-4), precision="bf16")
    >>> precision.get("fp16").loss_scaling
    True
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from functrain import tree as tree_lib

__all__ = ["Precision", "get", "cast_floating", "parse_dtype", "to_compute"]

PyTree = Any

_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


@dataclasses.dataclass(frozen=True)
class Precision:
    """How a train step computes.

    Args:
      compute_dtype: dtype of the forward and backward (params and floating inputs are cast to it).
      loss_scaling: dynamic loss scaling (needed for float16; see the module docstring).
      growth_interval: good steps in a row before the loss scale doubles.
      growth_factor: multiplies the scale after `growth_interval` good steps.
      backoff_factor: multiplies the scale after a step with non-finite gradients.

    Example:
      >>> Precision(torch.bfloat16)
    """

    compute_dtype: torch.dtype = torch.float32
    loss_scaling: bool = False
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5

    @property
    def casts(self) -> bool:
        """Whether params/inputs are cast (compute dtype other than float32)."""
        return self.compute_dtype != torch.float32

    def scale_of(self, guard) -> torch.Tensor | None:
        """The loss scale a step multiplies its loss by: the guard's dynamic scale, None without loss scaling."""
        return guard.loss_scale if self.loss_scaling else None


def get(spec: str | torch.dtype | Precision | None) -> Precision:
    """The `Precision` named by `spec`.

    Args:
      spec: "fp32" / "float32" (default), "bf16" / "bfloat16", "fp16" / "float16" (with dynamic
        loss scaling), a torch dtype, a `Precision`, or None (fp32).

    Returns:
      A `Precision`.

    Raises:
      ValueError: an unknown name.

    Example:
      >>> get("bf16").compute_dtype
      torch.bfloat16
    """
    if spec is None:
        return Precision()
    if isinstance(spec, Precision):
        return spec
    dtype = spec if isinstance(spec, torch.dtype) else _NAMES.get(str(spec).lower())
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"precision {spec!r} is not known; use 'fp32', 'bf16' or 'fp16'")
    return Precision(dtype, loss_scaling=dtype == torch.float16)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """The floating dtype called `name` ("fp32"/"float32", "bf16"/"bfloat16", "fp16"/"float16").

    Args:
      name: a dtype name or a torch dtype.

    Returns:
      The torch dtype.

    Raises:
      ValueError: an unknown name.

    Example:
      >>> parse_dtype("bf16")
      torch.bfloat16
    """
    if isinstance(name, torch.dtype):
        return name
    dtype = _NAMES.get(str(name).lower())
    if dtype is None:
        raise ValueError(f"dtype {name!r} is not known; use 'float32', 'bfloat16' or 'float16'")
    return dtype


def cast_floating(tree: PyTree, dtype: torch.dtype) -> PyTree:
    """`tree` with every floating-point tensor leaf cast to `dtype` (others unchanged).

    Args:
      tree: a pytree (params, a batch, ...); DTensor leaves keep their placements.
      dtype: the target floating dtype.

    Returns:
      The cast tree (leaves already in `dtype` are returned as they are).

    Example:
      >>> half = cast_floating(state.params, torch.bfloat16)
    """

    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_lib.map(cast, tree)


def to_compute(prec: Precision, params: PyTree, batch: PyTree) -> tuple[PyTree, PyTree]:
    """`(params, batch)` with their floating leaves in `prec.compute_dtype` (as they are for fp32).

    Args:
      prec: the `Precision`.
      params: the master params (plain tensors or DTensors).
      batch: the batch pytree.

    Returns:
      The compute copies `(params, batch)`.

    Example:
      >>> p16, batch16 = to_compute(get("bf16"), state.params, batch)
    """
    if not prec.casts:
        return params, batch
    return cast_floating(params, prec.compute_dtype), cast_floating(batch, prec.compute_dtype)
