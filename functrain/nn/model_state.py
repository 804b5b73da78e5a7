"""Model state: the buffers a module's forward reads or updates, kept in the training state.

Internals: docs/internals.md "functrain.nn.model_state".

Example:
    >>> state = functrain.init_state(cnn, optim.adamw(1e-3))   # params and buffers_of(cnn)
    >>> sorted(state.model_state)
    ['bn.num_batches_tracked', 'bn.running_mean', 'bn.running_var']
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from functrain import tree as tree_lib

__all__ = ["buffers_of", "call_loss", "check_loss", "has_model_state", "loss_and_aux", "restore_dtypes"]

PyTree = Any


def buffers_of(model: nn.Module, *, persistent: bool = True) -> dict[str, torch.Tensor]:
    """The module's buffers as a {name: detached tensor} dict sharing the module's storage.

    Args:
      model: an `nn.Module`.
      persistent: only the persistent buffers (those in `state_dict`: BatchNorm's running
        statistics and counters), the module's state; False adds the non-persistent ones (constant
        tables such as rotary frequencies, which a meta template cannot compute with).

    Returns:
      A dict in `named_buffers()` order (shared buffers once).

    Example:
      >>> buffers_of(nn.BatchNorm1d(4)).keys()
      dict_keys(['running_mean', 'running_var', 'num_batches_tracked'])
    """
    keep = set(model.state_dict(keep_vars=True)) if persistent else None
    return {name: b.detach() for name, b in model.named_buffers() if b is not None and (keep is None or name in keep)}


def has_model_state(model_state: PyTree) -> bool:
    """Whether a model state holds any tensor (an empty dict or None holds none)."""
    return model_state is not None and bool(tree_lib.leaves(model_state))


def check_loss(loss_fn: Callable, model_state: PyTree) -> None:
    """Raises a one-line TypeError when the state holds model state and `loss_fn` cannot take it."""
    if not has_model_state(model_state):
        return
    try:
        inspect.signature(loss_fn).bind(None, None, None, None)
    except TypeError:
        raise TypeError(
            f"the state holds model state ({len(tree_lib.leaves(model_state))} buffers, e.g. "
            f"{next(iter(model_state))!r}) but the loss function takes (params, batch, key): write "
            "loss_fn(params, batch, key, model_state) -> (loss, aux, new_model_state), with "
            "functrain.apply(model, params, x, model_state=model_state) returning (out, new_model_state)"
        ) from None
    except ValueError:  # no signature to read (a builtin): the call itself will say
        return


def call_loss(loss_fn: Callable, params: PyTree, batch: PyTree, key, model_state: PyTree):
    """`(loss, aux, new model state)` of one loss call: with the model state as a fourth argument when
    there is one (then the loss returns three things), else the plain contract and `model_state` back."""
    if not has_model_state(model_state):
        loss, aux = loss_and_aux(loss_fn(params, batch, key))
        return loss, aux, model_state
    out = loss_fn(params, batch, key, model_state)
    if not (isinstance(out, tuple) and len(out) == 3):
        raise TypeError(
            "a loss function given model state must return (loss, aux, new_model_state), got "
            f"{type(out).__name__}" + (f" of {len(out)}" if isinstance(out, tuple) else "")
        )
    loss, aux = loss_and_aux((out[0], out[1]))
    new = out[2]
    if not isinstance(new, dict) or list(new) != list(model_state):
        raise ValueError(
            "the loss returned a model state with other keys (or in another order) than it was "
            "given; return the dict functrain.apply(..., model_state=...) gave back"
        )
    return loss, aux, new


def restore_dtypes(new: PyTree, like: PyTree) -> PyTree:
    """`new` with each leaf in the dtype of the matching leaf of `like`, detached (each buffer keeps its own dtype)."""
    leaves, spec = tree_lib.flatten(new)
    out = [
        n.detach() if n.dtype == o.dtype else n.detach().to(o.dtype) for n, o in zip(leaves, spec.flatten_up_to(like))
    ]
    return spec.unflatten(out)


def loss_and_aux(out) -> tuple[torch.Tensor, dict]:
    """A loss function's result as `(loss, aux dict)`: the loss contract, in one place.

    A loss function returns a scalar tensor, or `(loss, aux)` with `aux` a dict (or None) of
    scalar tensors to report; anything else (e.g. a tuple of two tensors) is an error.

    Args:
      out: what a loss function returned.

    Returns:
      `(loss, aux dict)`.

    Raises:
      TypeError: `out` has another structure.

    Example:
      >>> loss, aux = loss_and_aux(loss_fn(params, batch, key))
    """
    if isinstance(out, torch.Tensor):
        return out, {}
    if (
        isinstance(out, tuple)
        and len(out) == 2
        and isinstance(out[0], torch.Tensor)
        and (out[1] is None or isinstance(out[1], dict))
    ):
        return out[0], dict(out[1] or {})
    raise TypeError(
        f"a loss function must return a scalar tensor or (loss, aux dict), got {_describe(out)}; "
        "put extra outputs in the aux dict"
    )


def _describe(x) -> str:
    """A short description of a value's structure for error messages."""
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of ({', '.join(type(v).__name__ for v in x)})"
    return f"a {type(x).__name__}"
