"""Per-example gradients, their norms, clipping and DP-SGD's noisy mean: pure and compilable.

Internals: docs/internals.md "functrain.per_example".

Example:
    >>> g, losses, _ = per_example.grads(loss_fn, state.params, (x, y))      # {name: (B, ...)}
    >>> mean, norms = per_example.privatize(g, max_norm=1.0, noise_multiplier=1.1, key=k)
    >>> state, metrics = functrain.apply_gradients(state, mean, opt)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from functrain import rng
from functrain import tree as tree_lib

__all__ = ["grads", "norms", "clipped_sum", "privatize"]

PyTree = Any


def grads(
    loss_fn: Callable, params: PyTree, batch: PyTree, key: torch.Tensor | None = None, *, model_state: PyTree = None
):
    """The gradient of each example's loss, stacked on a leading batch dim.

    Args:
      loss_fn: `loss_fn(params, batch, key) -> (loss, aux)`, the train step's loss; it is called
        with each example as a batch of one (every batch leaf indexed `[i:i+1]`).
      params: a pytree of plain (local) tensors.
      batch: a pytree of tensors whose leading dim B is the example index.
      key: a dropout key or None; example i gets `rng.split(key, B)[i]`.
      model_state: must be empty: per-example gradients run each example as a batch of one, where
        batch statistics (BatchNorm) mean nothing; a model state is refused in one line.

    Returns:
      `(grads, losses, aux)`: grads like `params` with a leading (B,) on every leaf, losses (B,),
      aux the loss function's aux with a leading (B,).

    Example:
      >>> g, losses, _ = per_example.grads(loss_fn, params, (x, y))   # g["wte.weight"]: (B, V, C)
    """
    if model_state is not None and optree.tree_leaves(model_state):
        raise ValueError(
            "per-example gradients run every example as a batch of one, where a model's batch "
            f"statistics ({next(iter(model_state))!r}, ...) mean nothing: use a model without "
            "BatchNorm (GroupNorm or LayerNorm normalize per example)"
        )
    b = optree.tree_leaves(batch)[0].shape[0]

    def one(p, example, k):
        example = optree.tree_map(lambda t: t.unsqueeze(0), example)  # a batch of one
        loss, aux = loss_fn(p, example, k)
        return loss, aux

    keys = None if key is None else rng.split(key, b)  # (B, 2)
    per = torch.func.vmap(torch.func.grad_and_value(one, has_aux=True), in_dims=(None, 0, None if key is None else 0))
    with sdpa_kernel(SDPBackend.MATH):
        g, (losses, aux) = per(params, batch, keys)
    return g, losses, aux


def norms(grads: PyTree) -> torch.Tensor:
    """The L2 norm of each example's gradient over all leaves, (B,) float32.

    Args:
      grads: per-example gradients (every leaf (B, ...)), e.g. from `grads`.

    Returns:
      A (B,) float32 tensor.

    Example:
      >>> per_example.norms(g).max()
    """
    squares = [g.flatten(1).float().square().sum(1) for g in optree.tree_leaves(grads)]  # (B,) each
    return torch.stack(squares).sum(0).sqrt()


def clipped_sum(grads: PyTree, max_norm: float | torch.Tensor):
    """The sum over examples of each gradient scaled to norm <= `max_norm`.

    Args:
      grads: per-example gradients (every leaf (B, ...)).
      max_norm: the clipping bound C (a float or a 0-d tensor).

    Returns:
      `(summed, norms)`: summed like one example's gradient, norms (B,) before clipping.

    Example:
      >>> total, n = per_example.clipped_sum(g, 1.0)    # ||total|| <= B * 1.0
    """
    n = norms(grads)
    factor = (max_norm / (n + 1e-6)).clamp(max=1.0)  # (B,)
    summed = optree.tree_map(lambda g: torch.tensordot(factor.to(g.dtype), g, dims=1), grads)
    return summed, n


def privatize(grads: PyTree, max_norm: float | torch.Tensor, noise_multiplier: float | torch.Tensor, key: torch.Tensor):
    """DP-SGD's gradient: clip each example to `max_norm`, sum, add N(0, (noise_multiplier *
    max_norm)^2) noise, divide by the batch size (Abadi et al., 2016).

    Args:
      grads: per-example gradients (every leaf (B, ...)).
      max_norm: the clipping bound C.
      noise_multiplier: sigma; the noise std is sigma * C.
      key: where the noise comes from (`rng.gaussian`, one split key per leaf): the same key gives
        the same noise, e.g. `rng.fold_in(state.rng, state.step)`.

    Returns:
      `(mean, norms)`: the noisy clipped mean, shaped like one example's gradient, and the (B,)
      norms before clipping.

    Example:
      >>> mean, n = per_example.privatize(g, 1.0, 1.1, rng.fold_in(state.rng, state.step))
    """
    summed, n = clipped_sum(grads, max_norm)
    leaves, spec = tree_lib.flatten(summed)
    keys = rng.split(key, len(leaves))  # (L, 2): one noise stream per leaf
    b = n.shape[0]
    noisy = [
        (s + noise_multiplier * max_norm * rng.gaussian(keys[i], s.shape, s.dtype)) / b for i, s in enumerate(leaves)
    ]
    return spec.unflatten(noisy), n
