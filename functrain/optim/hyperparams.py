"""Hyper-parameters as state: read and change them in an optimizer state (or a whole TrainState).

Internals: docs/internals.md "functrain.optim.hyperparams".

Example:
    >>> state = optim.set_hyperparams(state, lr=1e-3, weight_decay=0.0)
    >>> optim.get_hyperparams(state)["lr"]
    0.001
"""

from __future__ import annotations

from typing import Any

import optree
import torch

__all__ = ["get_hyperparams", "set_hyperparams"]

PyTree = Any


def _holds_hyper(node: Any) -> bool:
    """Whether `node` is a transform state with a `hyper` field (a NamedTuple)."""
    return isinstance(node, tuple) and "hyper" in getattr(node, "_fields", ())


def _states(tree: PyTree) -> list:
    """Every transform state with a `hyper` field in `tree`, in flattening order."""
    return [x for x in optree.tree_leaves(tree, is_leaf=_holds_hyper, none_is_leaf=False) if _holds_hyper(x)]


def get_hyperparams(tree: PyTree) -> dict[str, float]:
    """The hyper-parameters stored in `tree` (an optimizer state, or a TrainState), as Python floats.

    Args:
      tree: any pytree holding transform states.

    Returns:
      {name: value}; a name stored in several transforms appears once (its first value).

    Example:
      >>> optim.get_hyperparams(state)   # {'clip': 1.0, 'b1': 0.9, ..., 'lr': 0.003, ...}
    """
    out: dict[str, float] = {}
    for state in _states(tree):
        for name, value in state.hyper.items():
            out.setdefault(name, float(value))
    return out


def set_hyperparams(tree: PyTree, **values: float) -> PyTree:
    """`tree` with the named hyper-parameters replaced (new 0-d tensors, same dtype and device).

    Args:
      tree: an optimizer state or a TrainState.
      **values: name=value for each hyper-parameter to change (every occurrence of the name).

    Returns:
      A new tree; `tree` itself is not modified.

    Raises:
      KeyError: a name no transform in `tree` has (the message lists the names it has).

    Example:
      >>> for lr in (1e-3, 3e-3):
      ...     state = optim.set_hyperparams(fresh, lr=lr)   # same compiled step, no recompile
    """
    known = {name for state in _states(tree) for name in state.hyper}
    unknown = sorted(set(values) - known)
    if unknown:
        raise KeyError(f"no hyper-parameter {', '.join(map(repr, unknown))} in this state; it has {sorted(known)}")

    def replace(node: Any) -> Any:
        if not _holds_hyper(node):
            return node
        hyper = {k: torch.full_like(v, float(values[k])) if k in values else v for k, v in node.hyper.items()}
        return node._replace(hyper=hyper)

    return optree.tree_map(replace, tree, is_leaf=_holds_hyper, none_is_leaf=False)
