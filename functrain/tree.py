"""Small helpers over pytrees of tensors (optree, default namespace).

A functrain state is made of dicts, tuples, lists and NamedTuples whose leaves are tensors (or
DTensors); `None` is an empty subtree. These helpers are what the optimizer, the step and the
checkpointer use to walk such trees.

Example:
    >>> norm = tree.global_norm(grads)
    >>> zeros = tree.zeros_like(params)
    >>> for name, leaf in tree.named_leaves(state): print(name, leaf.shape)
"""

from __future__ import annotations

import sys
from typing import Any, Iterator

import optree
import torch

__all__ = [
    "map",
    "leaves",
    "named_leaves",
    "path_name",
    "zeros_like",
    "ones_like",
    "full_like",
    "global_norm",
    "size",
    "structure",
    "unflatten",
    "cast",
    "clone",
]

PyTree = Any

map = optree.tree_map  # noqa: A001 - mirrors jax.tree.map
leaves = optree.tree_leaves
structure = optree.tree_structure
unflatten = optree.tree_unflatten


def path_name(path: tuple) -> str:
    """Dotted name of a tree path, e.g. ('params', 'wte.weight') -> 'params.wte.weight'."""
    return ".".join(str(p) for p in path)


def named_leaves(tree: PyTree) -> Iterator[tuple[str, Any]]:
    """Yields (dotted path, leaf) pairs in flattening order.

    Args:
      tree: any pytree.

    Returns:
      An iterator of `(name, leaf)`; names join the path entries with '.'.

    Example:
      >>> dict(tree.named_leaves({"a": {"b": x}}))
      {'a.b': x}
    """
    paths, values, _ = optree.tree_flatten_with_path(tree)
    for path, value in zip(paths, values):
        yield path_name(path), value


def zeros_like(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    """A tree of zeros with the same structure, shapes, devices (and placements) as `tree`.

    Args:
      tree: a pytree of tensors.
      dtype: optional dtype for every leaf (default: keep each leaf's dtype).

    Returns:
      A new pytree of zero tensors.

    Example:
      >>> mu = tree.zeros_like(params)
    """
    return map(lambda x: torch.zeros_like(x, dtype=dtype), tree)


def ones_like(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    """A tree of ones shaped like `tree` (see `zeros_like`)."""
    return map(lambda x: torch.ones_like(x, dtype=dtype), tree)


def full_like(tree: PyTree, value: float, dtype: torch.dtype | None = None) -> PyTree:
    """A tree filled with `value` shaped like `tree` (see `zeros_like`)."""
    return map(lambda x: torch.full_like(x, value, dtype=dtype), tree)


def cast(tree: PyTree, dtype: torch.dtype) -> PyTree:
    """Casts the floating-point leaves of `tree` to `dtype` (integer leaves are kept)."""
    return map(lambda x: x.to(dtype) if x.is_floating_point() else x, tree)


def clone(tree: PyTree) -> PyTree:
    """Deep copy of every tensor leaf (new storage)."""
    return map(lambda x: x.clone(), tree)


def size(tree: PyTree) -> int:
    """Total number of elements over all tensor leaves (global sizes for DTensors)."""
    return sum(x.numel() for x in leaves(tree))


def global_norm(tree: PyTree) -> torch.Tensor:
    """L2 norm of all leaves taken together, as a float32 0-d tensor.

    Uses one fused `torch._foreach_norm` over the leaves. For DTensor leaves the norm is the
    global norm over the whole mesh (`functrain.parallel.spmd.global_norm`: the local squared
    norms are summed over the mesh dims that shard each leaf, a few all-reduces in all).

    Args:
      tree: a pytree of floating-point tensors.

    Returns:
      A 0-d float32 tensor `sqrt(sum_i ||x_i||^2)`.

    Example:
      >>> gnorm = tree.global_norm(grads)
    """
    xs = leaves(tree)
    if not xs:
        return torch.zeros((), dtype=torch.float32)
    if _is_dtensor(xs[0]):  # a few bucketed all-reduces instead of one per leaf
        from functrain.parallel.spmd import global_norm as sharded_global_norm

        return sharded_global_norm(xs)
    # float32 accumulation; float64 leaves cannot be reduced "narrowing" into float32 (error).
    acc = torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32
    norms = torch._foreach_norm(xs, 2.0, dtype=acc)
    return torch.linalg.vector_norm(torch.stack([_full(n) for n in norms]), 2.0).to(torch.float32)


def _is_dtensor(x) -> bool:
    """Whether `x` is a DTensor (without importing DTensor: none can exist unless it was)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(x, dtensor.DTensor)


def _full(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor for `x`: DTensors are reduced/gathered with `full_tensor()`."""
    return x.full_tensor() if _is_dtensor(x) else x
