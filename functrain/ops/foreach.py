"""List ops over tensor leaves: fused `torch._foreach_*` kernels, or one op per tensor under
`torch.func.vmap`.

Internals: docs/internals.md "functrain.ops.foreach".

Example:
    >>> ys = foreach.mul(xs, 0.5)                 # torch._foreach_mul(xs, 0.5)
    >>> with foreach.per_tensor():
    ...     ys = foreach.mul(xs, 0.5)             # [x * 0.5 for x in xs]
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["add", "addcmul", "copy_", "device_scalars", "div", "lerp", "mul", "norms", "per_tensor", "sqrt", "sub"]

_PER_TENSOR = False
_DEVICE_SCALARS = False

Tensors = list[torch.Tensor] | tuple[torch.Tensor, ...]  # as torch._foreach_* take them
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # (anything else is a subclass such as DTensor)


@contextlib.contextmanager
def _switched_on(flag: str):
    """The module flag named `flag` is True within the block (restored after)."""
    before = globals()[flag]
    globals()[flag] = True
    try:
        yield
    finally:
        globals()[flag] = before


def per_tensor():
    """Within it, every op here runs one torch op per tensor (vmap-able) instead of a fused kernel."""
    return _switched_on("_PER_TENSOR")


def device_scalars():
    """Within it, 0-d tensor scalars take the broadcast-list route on every device (the CPU too)."""
    return _switched_on("_DEVICE_SCALARS")


def _broadcast_for(xs: Tensors, scalar) -> list[torch.Tensor] | None:
    """`scalar` as views shaped like each of `xs` off the CPU (or in `device_scalars()`), else None."""
    if not (isinstance(scalar, torch.Tensor) and len(xs) > 0):
        return None
    if not _DEVICE_SCALARS and xs[0].device.type == "cpu":
        return None
    return [scalar.to(x.dtype).expand_as(x) for x in xs]


def _per_tensor_for(xs: Tensors, scalar) -> bool:
    """Per-tensor ops for this call: inside `per_tensor()`, or a tensor subclass (DTensor) with a 0-d
    tensor scalar. The foreach Scalar overloads turn that tensor into an unbacked float under
    torch.compile, which plain tensors take but DTensor's sharding propagation cannot ("Could not
    guard on data-dependent expression"); per-tensor ops keep it a (replicated) tensor."""
    return _listwise(xs) or (isinstance(scalar, torch.Tensor) and type(xs[0]) not in _PLAIN)


def _listwise(xs: Tensors) -> bool:
    """One op per tensor: inside `per_tensor()`, or for an empty list (the fused kernels reject one)."""
    return _PER_TENSOR or len(xs) == 0


def _at(y, i):
    """y[i] for a list, y itself for a scalar or tensor."""
    return y[i] if isinstance(y, (list, tuple)) else y


def add(xs: Tensors, ys) -> list[torch.Tensor]:
    """xs + ys (ys: a list, a scalar or a 0-d tensor)."""
    if _per_tensor_for(xs, ys):
        return [x + _at(ys, i) for i, x in enumerate(xs)]
    return list(torch._foreach_add(xs, _broadcast_for(xs, ys) or ys))


def mul(xs: Tensors, ys) -> list[torch.Tensor]:
    """xs * ys (ys: a list, a scalar or a 0-d tensor)."""
    if _per_tensor_for(xs, ys):
        return [x * _at(ys, i) for i, x in enumerate(xs)]
    return list(torch._foreach_mul(xs, _broadcast_for(xs, ys) or ys))


def sub(xs: Tensors, ys: Tensors) -> list[torch.Tensor]:
    """xs - ys."""
    return [x - y for x, y in zip(xs, ys)] if _listwise(xs) else list(torch._foreach_sub(xs, ys))


def div(xs: Tensors, ys: Tensors) -> list[torch.Tensor]:
    """xs / ys."""
    return [x / y for x, y in zip(xs, ys)] if _listwise(xs) else list(torch._foreach_div(xs, ys))


def sqrt(xs: Tensors) -> list[torch.Tensor]:
    """sqrt(xs)."""
    return [x.sqrt() for x in xs] if _listwise(xs) else list(torch._foreach_sqrt(xs))


def lerp(xs: Tensors, ys: Tensors, weight) -> list[torch.Tensor]:
    """xs + weight (ys - xs) (weight: a scalar or a 0-d tensor).

    Compiled, a tensor weight is written out as `xs + weight * (ys - xs)` (three foreach ops that
    inductor fuses into the kernels `_foreach_lerp` gave): torch 2.14's decomposition of
    `_foreach_lerp.Scalar` branches on the weight (`weight >= 0.5`), an unbacked float once compiled
    ("GuardOnDataDependentSymNode"). For a weight below 0.5 (Adam's 1 - b1) that is lerp's own
    formula; on torch 2.13 the compiled result is bit-identical to the compiled `_foreach_lerp`."""
    if _per_tensor_for(xs, weight):
        return [
            torch.lerp(x, y, weight.to(x.dtype) if isinstance(weight, torch.Tensor) else float(weight))
            for x, y in zip(xs, ys)
        ]
    views = _broadcast_for(xs, weight)
    if views is None and isinstance(weight, torch.Tensor) and torch.compiler.is_compiling():
        return list(torch._foreach_add(xs, torch._foreach_mul(torch._foreach_sub(ys, xs), weight)))
    return list(torch._foreach_lerp(xs, ys, views or weight))


def addcmul(xs: Tensors, ys: Tensors, zs: Tensors) -> list[torch.Tensor]:
    """xs + ys * zs."""
    return [x + y * z for x, y, z in zip(xs, ys, zs)] if _listwise(xs) else list(torch._foreach_addcmul(xs, ys, zs))


def norms(xs: Tensors, dtype: torch.dtype) -> list[torch.Tensor]:
    """The L2 norm of each tensor, accumulated in `dtype`."""
    if _listwise(xs):
        return [torch.linalg.vector_norm(x, 2, dtype=dtype) for x in xs]
    return list(torch._foreach_norm(xs, 2.0, dtype=dtype))


def copy_(dst: Tensors, src: Tensors) -> None:
    """dst[i].copy_(src[i]) for each i."""
    if _listwise(dst):
        for d, s in zip(dst, src):
            d.copy_(s)
    else:
        torch._foreach_copy_(list(dst), list(src))
