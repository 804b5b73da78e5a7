"""The loss contract: what a loss function returns, checked in one place.

A loss function is `(params, batch, key) -> loss` or `-> (loss, aux)`, with `aux` a dict (or None)
of scalar tensors to report.
"""

from __future__ import annotations

import torch

__all__ = ["loss_and_aux"]


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
