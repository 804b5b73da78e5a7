"""Optimizers (nouns): ready-made chains of transforms."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from functrain.optim import fused as fused_lib
from functrain.optim.base import Transform, chain
from functrain.optim.transforms import (
    ScalarOrSchedule,
    add_decayed_weights,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)

__all__ = ["adamw", "adam", "sgd"]

PyTree = Any


def adamw(  # noqa: PLR0913
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    mask: PyTree | Callable[[PyTree], PyTree] | None = None,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    fused: bool | None = None,
) -> Transform:
    """AdamW (decoupled weight decay), the same update as `torch.optim.AdamW`.

    `chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate))`.

    Args:
      learning_rate: float, tensor or schedule.
      b1, b2, eps: Adam coefficients.
      weight_decay: decoupled decay (multiplied by the learning rate, as torch and optax do).
      mask: which params get weight decay (tree of bools or callable); default all.
      mu_dtype, nu_dtype: storage dtypes of Adam's moments (see `scale_by_adam`).
      fused: True: a train step that donates its state runs the update in place through torch's fused
        AdamW kernel (one pass over the params, as `torch.optim.AdamW(fused=True)`; also after
        `clip_by_global_norm` in a chain): an eager step, and on one process a compiled one after its
        compiled loss (the update then has no graph to compile). Its metrics then have no
        `update_norm` (the kernel does not expose the update). Steps that do not donate or hold
        sharded params run the same math unfused, compiled with the step (see `functrain.optim.fused`).
        None (default): the kernel in eager steps only (where it takes the tensors: float32 moments, one
        process), the same math to float32 rounding at a fraction of the unfused passes' time; compiled
        steps compile the update. False: never the kernel.

    Returns:
      A `Transform`.

    Raises:
      ValueError: `fused=True` with moments stored in another dtype than the params' (the kernel
        keeps one dtype).

    Example:
      >>> opt = optim.adamw(optim.warmup_cosine(3e-4, 100, 5000), weight_decay=0.1)
    """
    if fused and (mu_dtype is not None or nu_dtype is not None):
        raise ValueError(
            "adamw(fused=True) keeps Adam's moments in the params' dtype (torch's kernel takes one "
            "dtype): drop mu_dtype/nu_dtype or fused"
        )
    opt = chain(
        scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
    if fused is False:
        return opt
    route = fused_lib.adamw_route(learning_rate, mask)
    return opt._replace(traits=opt.traits._replace(fused=route, fused_compiled=bool(fused)))


def adam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
) -> Transform:
    """Adam without weight decay (see `adamw`): `chain(scale_by_adam, scale_by_learning_rate)`.

    Args:
      learning_rate: a float or a schedule (step -> lr).
      b1, b2: decay rates of the first and second moment estimates.
      eps: added to the root of the second moment.
      mu_dtype, nu_dtype: storage dtypes of the moments (default: the params').

    Returns:
      A `Transform`.

    Example:
      >>> opt = optim.adam(1e-3)
    """
    return chain(
        scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype), scale_by_learning_rate(learning_rate)
    )


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    *,
    mask: PyTree | Callable[[PyTree], PyTree] | None = None,
) -> Transform:
    """SGD with optional (Nesterov) momentum and L2 weight decay, the update of `torch.optim.SGD`.

    Weight decay is added to the gradient before momentum, as torch does (coupled L2).

    Args:
      learning_rate: float, tensor or schedule.
      momentum: momentum coefficient (0 = plain SGD).
      nesterov: Nesterov momentum.
      weight_decay: L2 coefficient added to the gradient.
      mask: which params get weight decay.

    Returns:
      A `Transform`.

    Example:
      >>> opt = optim.sgd(0.1, momentum=0.9, nesterov=True)
    """
    if nesterov and not momentum:
        raise ValueError("sgd(nesterov=True) needs momentum > 0 (as torch.optim.SGD); set momentum")
    parts = [add_decayed_weights(weight_decay, mask)]
    if momentum:
        parts.append(trace(momentum, nesterov))
    parts.append(scale_by_learning_rate(learning_rate))
    return chain(*parts)
