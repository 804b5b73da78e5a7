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

import importlib
from typing import Any, Iterator, NamedTuple

import optree
import torch

from functrain import foreach

__all__ = [
    "map",
    "leaves",
    "flatten",
    "named_leaves",
    "path_name",
    "zeros_like",
    "ones_like",
    "full_like",
    "global_norm",
    "squared_norms",
    "register_global_norm",
    "size",
    "structure",
    "unflatten",
    "cast",
    "clone",
    "incremental_update",
]

PyTree = Any

map = optree.tree_map  # noqa: A001 - mirrors jax.tree.map
structure = optree.tree_structure
unflatten = optree.tree_unflatten


# Flattening that is cheap to trace. Inside torch.compile, Dynamo runs optree's flatten as a Python
# polyfill that builds a spec object per node: flattening a 4-layer GPT's params cost it ~12k bytecode
# instructions, and the default train step flattened params, grads and optimizer state ~20 times
# (~250k of its 364k traced instructions). `leaves` and `flatten` walk the dicts, lists, tuples and
# NamedTuples a state is made of in plain Python, in optree's order (dict keys sorted, `None` an empty
# node), and hand anything else (an OrderedDict, a registered node type) to optree.
_LEAF, _NODE, _OTHER = 0, 1, 2


def _kind(x) -> int:
    """_LEAF, _NODE (None, dict with str keys, list, tuple, NamedTuple) or _OTHER (left to optree)."""
    if isinstance(x, torch.Tensor):  # the common case first: every test costs Dynamo per node
        return _LEAF
    t = type(x)
    if t is dict:
        for k in x:
            if type(k) is not str:  # optree orders mixed keys its own way
                return _OTHER
        return _NODE
    if t is list or t is tuple or x is None:
        return _NODE
    if t in (int, float, bool, complex, str):
        return _LEAF
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # (of the instance: Dynamo 2.11 cannot ask a class)
        return _NODE
    return _OTHER


def _children(x) -> list:
    """A node's children in optree's order."""
    if type(x) is dict:
        return [x[k] for k in sorted(x)]
    return [] if x is None else x


def _gather_leaves(x, out: list, stop=None) -> bool:
    """Appends `x`'s leaves to `out` (and whole each subtree `stop` accepts); False at a node `_kind` does not know."""
    if isinstance(x, torch.Tensor) or (stop is not None and stop(x)):
        out.append(x)
        return True
    kind = _kind(x)
    if kind == _LEAF:
        out.append(x)
        return True
    if kind == _OTHER:
        return False
    for child in _children(x):
        if not _gather_leaves(child, out, stop):
            return False
    return True


def _gather_up_to(x, other, out: list) -> bool:
    """Appends `other`'s subtrees at `x`'s leaf positions; False on a mismatch or an unknown node."""
    kind = _kind(x)
    if kind == _LEAF:
        out.append(other)
        return True
    if kind == _OTHER or type(other) is not type(x):
        return False
    if x is None:
        return True
    if len(x) != len(other) or (type(x) is dict and any(k not in other for k in x)):
        return False
    for child, theirs in zip(_children(x), _children(other)):
        if not _gather_up_to(child, theirs, out):
            return False
    return True


def _rebuild(x, leaves: list, at: int, stop=None):
    """(`x`'s structure filled with leaves[at:], the index after the last one used); a subtree `stop`
    accepts is one leaf, as in `_gather_leaves`."""
    if (stop is not None and stop(x)) or _kind(x) == _LEAF:
        return leaves[at], at + 1
    if x is None:
        return None, at
    if type(x) is dict:
        new = {}
        for k in sorted(x):
            new[k], at = _rebuild(x[k], leaves, at, stop)
        return {k: new[k] for k in x}, at  # the template's key order, as optree's unflatten keeps it
    items = []
    for child in x:
        item, at = _rebuild(child, leaves, at, stop)
        items.append(item)
    if type(x) is list:
        return items, at
    return (tuple(items) if type(x) is tuple else type(x)(*items)), at


class _PlainSpec(NamedTuple):
    """The two `optree.PyTreeSpec` methods functrain uses, for a tree of plain nodes (see `flatten`).
    (A NamedTuple: Dynamo makes one of these per flatten, and a tuple costs it far less than an object.)"""

    template: Any
    num_leaves: int

    def flatten_up_to(self, other) -> list:
        """`other`'s subtrees at the template's leaf positions."""
        out = []
        if _gather_up_to(self.template, other, out):
            return out
        return optree.tree_structure(self.template).flatten_up_to(other)  # raises optree's error

    def unflatten(self, leaves) -> PyTree:
        """The template's structure with `leaves` as its leaves."""
        leaves = list(leaves)
        if len(leaves) != self.num_leaves:
            raise ValueError(f"expected {self.num_leaves} leaves, got {len(leaves)}")
        return _rebuild(self.template, leaves, 0)[0]


def leaves(tree: PyTree) -> list:
    """The tree's leaves in optree's order (`optree.tree_leaves`, cheaper to trace).

    Args:
      tree: a pytree.

    Returns:
      A list of leaves.

    Example:
      >>> tree.leaves({"b": 2, "a": (1, None)})
      [1, 2]
    """
    out = []
    return out if _gather_leaves(tree, out) else optree.tree_leaves(tree)


def flatten(tree: PyTree) -> tuple[list, Any]:
    """(leaves, spec) as `optree.tree_flatten`, cheaper to trace; `spec` has `flatten_up_to(other)` and
    `unflatten(leaves)`.

    Args:
      tree: a pytree.

    Returns:
      (list of leaves, spec).

    Example:
      >>> xs, spec = tree.flatten(params)
      >>> params = spec.unflatten([x * 2 for x in xs])
    """
    out = []
    if _gather_leaves(tree, out):
        return out, _PlainSpec(tree, len(out))
    flat, spec = optree.tree_flatten(tree)
    return list(flat), spec


def _copy_pairs(old: PyTree, new: PyTree) -> list:
    """(old leaf, new leaf) at every leaf position where the two are not one tensor: what a donation copies."""
    olds, spec = flatten(old)
    return [(o, n) for o, n in zip(olds, spec.flatten_up_to(new)) if o is not n]


def path_name(path: tuple) -> str:
    """The dotted name of a tree path (as `named_leaves` and checkpoints name leaves).

    Args:
      path: a path from `optree.tree_flatten_with_path`, a tuple of keys and indices.

    Returns:
      The entries joined with '.'.

    Example:
      >>> tree.path_name(("params", "wte.weight"))
      'params.wte.weight'
    """
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
    """A tree of ones shaped like `tree` (see `zeros_like`).

    Args:
      tree: a pytree of tensors.
      dtype: optional dtype for every leaf (default: keep each leaf's dtype).

    Returns:
      A new pytree of tensors of ones.

    Example:
      >>> scale = tree.ones_like(params)
    """
    return map(lambda x: torch.ones_like(x, dtype=dtype), tree)


def full_like(tree: PyTree, value: float, dtype: torch.dtype | None = None) -> PyTree:
    """A tree filled with `value`, shaped like `tree` (see `zeros_like`).

    Args:
      tree: a pytree of tensors.
      value: the fill value.
      dtype: optional dtype for every leaf (default: keep each leaf's dtype).

    Returns:
      A new pytree of tensors.

    Example:
      >>> nu = tree.full_like(params, 1e-8)
    """
    return map(lambda x: torch.full_like(x, value, dtype=dtype), tree)


def cast(tree: PyTree, dtype: torch.dtype) -> PyTree:
    """Casts the floating-point leaves of `tree` to `dtype`; integer and bool leaves are kept.

    Args:
      tree: a pytree of tensors.
      dtype: a floating dtype.

    Returns:
      A new pytree (a leaf already of `dtype` is returned as it is, not copied).

    Example:
      >>> half = tree.cast(params, torch.bfloat16)
    """
    return map(lambda x: x.to(dtype) if x.is_floating_point() else x, tree)


def clone(tree: PyTree) -> PyTree:
    """A deep copy of every tensor leaf (new storage; DTensors keep their placements).

    Args:
      tree: a pytree of tensors.

    Returns:
      A new pytree that shares no storage with `tree`.

    Example:
      >>> before = tree.clone(state.params)   # keep them: a step donates its input state
    """
    return map(lambda x: x.clone(), tree)


def incremental_update(new: PyTree, old: PyTree, step_size: "float | torch.Tensor") -> PyTree:
    """`old + step_size * (new - old)` leafwise (optax's name): a moving average of weights.

    One fused `_foreach_lerp` over all leaves (per tensor under `foreach.per_tensor()`); pure: new
    tensors, `old` is left as it was. Traceable: compiles into the step that calls it.

    Args:
      new: the latest values (e.g. the params after a step).
      old: the running average, the same structure as `new`.
      step_size: weight of `new`, a Python float or a 0-d tensor (an EMA with decay d: 1 - d).

    Returns:
      A tree like `old`.

    Example:
      >>> ema = tree.incremental_update(state.params, ema, 1 - 0.999)   # EMA, decay 0.999
    """
    olds, spec = optree.tree_flatten(old)
    return optree.tree_unflatten(spec, foreach.lerp(olds, spec.flatten_up_to(new), step_size))


def size(tree: PyTree) -> int:
    """The number of elements over all tensor leaves (a DTensor counts its global size).

    Args:
      tree: a pytree of tensors.

    Returns:
      A Python int.

    Example:
      >>> print(f"{tree.size(params) / 1e6:.1f}M params")
    """
    return sum(x.numel() for x in leaves(tree))


def global_norm(tree: PyTree, *, fused: bool = False) -> torch.Tensor:
    """L2 norm of all leaves taken together, as a float32 0-d tensor.

    For DTensor leaves the norm is the global norm over the whole mesh
    (`functrain.parallel.spmd.global_norm`: the local squared norms are summed over the mesh dims
    that shard each leaf, a few all-reduces in all).

    Args:
      tree: a pytree of floating-point tensors.
      fused: the leaves are computed by the same compiled code (e.g. the new params of an update):
        sum them flat, so the compiler folds the norm into the loop that produces them (see
        `squared_norms`).

    Returns:
      A 0-d float32 tensor `sqrt(sum_i ||x_i||^2)`.

    Example:
      >>> gnorm = tree.global_norm(grads)
    """
    xs = leaves(tree)
    if not xs:
        return torch.zeros((), dtype=torch.float32)
    if not _NORMS and type(xs[0]).__module__.startswith("torch.distributed.tensor"):
        importlib.import_module("functrain.parallel")  # DTensors made without it: it registers their norm
    for leaf_type, norm_of in _NORMS:  # e.g. DTensors: functrain.parallel registers the mesh-wide norm
        if isinstance(xs[0], leaf_type):
            return norm_of(xs, fused=fused)
    return torch.stack(squared_norms(xs, fused=fused)).sum().sqrt().to(torch.float32)


_NORMS: list = []  # (leaf type, fn(leaves, fused=) -> norm), see register_global_norm


def register_global_norm(leaf_type: type, fn) -> None:
    """Makes `global_norm` hand trees whose leaves are `leaf_type` to `fn(leaves, fused=...)`.

    How `functrain.parallel` teaches this module the norm over a DeviceMesh (a few bucketed
    all-reduces) without this module importing it.

    Args:
      leaf_type: e.g. `torch.distributed.tensor.DTensor`.
      fn: `fn(list_of_leaves, fused=bool) -> 0-d float32 tensor`.

    Returns:
      None; registering a type again keeps the first function.

    Example:
      >>> tree.register_global_norm(DTensor, sharded_global_norm)
    """
    if not any(t is leaf_type for t, _ in _NORMS):
        _NORMS.append((leaf_type, fn))


_ROW = 4096  # inductor sums float32 rows longer than this with a slower compensated (cascade) loop


def squared_norms(xs: list, *, fused: bool = False) -> list:
    """`||x||^2` of each tensor (plain, local), accumulated in float32 (float64 if any leaf is).

    Eagerly one fused `torch._foreach_norm`. Compiled, a norm that is a pass of its own (the
    gradients' before clipping) sums each leaf row by row (rows of at most 4096 entries, then the
    row sums): inductor's CPU code for one long float32 sum keeps its compensated accumulator in
    memory and runs at ~23 GB/s here, rows at ~38 GB/s (the machine's read bandwidth: a BLAS dot of
    the same data, 36 GB/s). With `fused=True` (values the same compiled code writes, e.g. the new
    params) each leaf is summed flat: that reduction shares the loop that computes the values (one
    pass, +4-19% on that loop), where a row-shaped one becomes a second pass over them.

    Args:
      xs: a list of floating-point tensors.
      fused: sum flat (see above).

    Returns:
      A list of 0-d tensors in the accumulation dtype.

    Example:
      >>> total = torch.stack(tree.squared_norms(tree.leaves(grads))).sum()
    """
    acc = torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32
    if not torch.compiler.is_compiling():
        return [n.square() for n in foreach.norms(xs, acc)]
    if fused:
        return [x.to(acc).square().sum() for x in xs]
    return [_rows(x.to(acc)).square().sum(-1).sum() for x in xs]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` viewed as rows of at most 4096 entries where its shape allows (else as it is)."""
    if x.ndim >= 2 and x.shape[-1] <= _ROW:
        return x
    n = x.numel()
    if n > _ROW:
        for width in (4096, 2048, 1024, 512, 256):
            if n % width == 0:
                return x.reshape(-1, width)  # (rows, width)
    return x.reshape(1, -1) if x.ndim == 0 else x
