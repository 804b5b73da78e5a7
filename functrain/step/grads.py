"""The loss's gradients: value and grad of one batch, accumulated over microbatches, with frozen params.

Internals: docs/internals.md "functrain.step.grads".

Example:
    >>> loss, aux, grads = value_and_grad(loss_fn, params, batch, key)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

import functrain.step.metric_names as M
from functrain import compiler
from functrain import tree as tree_lib
from functrain.nn import randomness
from functrain.nn.model_state import call_loss, has_model_state
from functrain.step.microbatches import Microbatches, by_position
from functrain.step.staged import StagedLoss

__all__ = [
    "accumulated_value_and_grad",
    "scaled_loss",
    "value_and_grad",
    "with_frozen",
]

PyTree = Any
LossFn = Callable[[PyTree, PyTree, "torch.Tensor | None"], "tuple[torch.Tensor, dict]"]


def value_and_grad(  # noqa: PLR0913
    loss_fn: LossFn,
    params: PyTree,
    batch: PyTree,
    key,
    *,
    loss_scale=None,
    layout=None,
    model_state=None,
    fullgraph: bool = True,
    keyed: bool = True,
):
    """Loss, aux and gradients of `loss_fn(params, batch, key)` with respect to `params`.

    Args:
      loss_fn: `(params, batch, key) -> (scalar loss, aux dict)` (or just the loss); with
        `model_state`, `(params, batch, key, model_state) -> (loss, aux, new_model_state)`.
      params: the parameter tree (plain tensors).
      batch: the batch pytree.
      key: the RNG key passed to `loss_fn` (or None). While the loss runs, every dropout inside any
        module draws from it (`functrain.nn.randomness`).
      loss_scale: optional 0-d tensor; the gradients are those of `loss * loss_scale` (fp16 loss
        scaling) while the returned loss is unscaled.
      layout: for sharded (DTensor) params and a `functrain.step.staged.StagedLoss`: its
        `value_and_grad_sharded` gathers each stage's params itself and returns grads in the
        params' placements.
      model_state: the model's buffers (`TrainState.model_state`), passed to the loss and returned
        updated (no gradient flows into them).
      fullgraph: False when the step compiles around graph breaks: the gradients are then taken
        by plain autograd (Dynamo compiles the forward's pieces with their backwards).
      keyed: draw the modules' dropout from `key` (False inside torch's scan, whose body cannot
        enter a torch function mode).

    Returns:
      `(loss, aux, grads)`: detached loss, the aux dict, grads shaped like params; with
      `model_state`, `(loss, aux, grads, new_model_state)`.

    A `functrain.step.staged.StagedLoss` brings its own gradient route (`value_and_grad`, which recomputes
    blocks in the backward); any other loss function is differentiated by `torch.func.grad_and_value`
    (compiled, or in a transform), or eagerly by plain autograd (the same gradients, faster).

    Example:
      >>> loss, aux, grads = value_and_grad(loss_fn, params, batch, key)
    """
    if isinstance(loss_fn, StagedLoss):
        if has_model_state(model_state):
            raise ValueError(
                "a staged loss (functrain.step.staged) runs the model's own stages and takes no model "
                "state: use a plain loss function for a model with buffers"
            )
        if layout is not None:
            loss, aux, grads = loss_fn.value_and_grad_sharded(params, batch, key, layout=layout, loss_scale=loss_scale)
        else:
            loss, aux, grads = loss_fn.value_and_grad(params, batch, key, loss_scale=loss_scale)
        out = (loss.detach(), dict(aux or {}), grads)
        return out if model_state is None else (*out, model_state)

    def f(p):
        scaled, loss, aux, new_state = scaled_loss(loss_fn, p, batch, key, model_state, loss_scale, keyed=keyed)
        return scaled, (loss, (aux, {} if new_state is None else new_state))  # (torch.func's aux: no None)

    if compiler.eager_autograd_ok() or not fullgraph:  # the same gradients, without torch.func's per-op wrapping
        loss, (aux, new_state), grads = _autograd_value_and_grad(f, params)
    else:
        grads, (_, (loss, (aux, new_state))) = torch.func.grad_and_value(f, has_aux=True)(params)
    if model_state is None:
        return loss, aux, grads
    return loss, aux, grads, tree_lib.map(torch.Tensor.detach, new_state)


def scaled_loss(loss_fn: LossFn, params: PyTree, batch: PyTree, key, model_state, loss_scale, *, keyed: bool = True):
    """One call of the loss, every dropout drawing from `key`: what `value_and_grad` differentiates.

    Args:
      loss_fn: the loss function (with `model_state`, the four-argument form; see `value_and_grad`).
      params: the params to compute with.
      batch: the (micro)batch.
      key: the RNG key (or None).
      model_state: the model state (an empty dict or None when there is none).
      loss_scale: a 0-d tensor the loss is multiplied by for the backward, or None.
      keyed: draw the modules' dropout from `key` (see `value_and_grad`).

    Returns:
      `(scaled loss, loss detached, aux, new model state)`.

    Example:
      >>> scaled, loss, aux, _ = scaled_loss(loss_fn, params, batch, key, {}, None)
    """
    with randomness.keyed(key if keyed else None):
        loss, aux, new_state = call_loss(loss_fn, params, batch, key, model_state)
    scaled = loss if loss_scale is None else loss * loss_scale.to(loss.dtype)
    return scaled, loss.detach(), aux, new_state


def _autograd_value_and_grad(f, params: PyTree):
    """`torch.func.grad_and_value(f, has_aux=True)(params)`'s (loss, aux, grads) by plain autograd (eager only)."""
    leaves, spec = tree_lib.flatten(params)
    leaves = [x.detach().requires_grad_() for x in leaves]
    with torch.enable_grad():
        scaled, (loss, aux) = f(spec.unflatten(leaves))
        found = torch.autograd.grad(scaled, leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, found)]  # unused: zeros, as torch.func
    return loss, tree_lib.map(lambda a: a.detach() if torch.is_tensor(a) else a, aux), spec.unflatten(grads)


def _metrics_and_grads(  # noqa: PLR0913
    loss_fn, params, batch, key, loss_scale=None, layout=None, model_state=None, fullgraph=True, keyed=True
):
    """({"loss": loss, **aux}, grads, new model state) for one (micro)batch (per-stage gathers with a `layout`)."""
    loss, aux, grads, model_state = value_and_grad(
        loss_fn,
        params,
        batch,
        key,
        loss_scale=loss_scale,
        layout=layout,
        model_state={} if model_state is None else model_state,
        fullgraph=fullgraph,
        keyed=keyed,
    )
    return {M.LOSS: loss, **aux}, grads, model_state


def accumulated_value_and_grad(
    loss_fn, params, mbs: Microbatches, impl: str, layout=None, model_state=None, fullgraph=True
):
    """`(aux, grads, model_state)` over the step's microbatches, inside one graph: their sum in `mbs` (a traced
    Python loop, or torch's scan with `impl="scan"`), and the model state after the last one (each microbatch
    updates it, as torch's loop would). With `layout`, params are sharded and the loss gathers them stage by
    stage."""
    if impl == "scan" and mbs.k > 1:
        return _scanned(loss_fn, params, mbs, model_state)
    for i, (mb, key) in enumerate(mbs):
        aux, grads, model_state = _metrics_and_grads(
            loss_fn, params, mb, key, mbs.factor(i), layout, model_state, fullgraph
        )
        mbs.add(i, aux, by_position(grads))
    return (*mbs.result(params), model_state)


def _scanned(loss_fn, params, mbs: Microbatches, model_state):
    """`accumulated_value_and_grad` as torch's scan over the stacked microbatches (one body graph)."""

    def body(carry, xs):
        mb, k, w = xs
        sums, ms = carry
        aux, grads, ms = _metrics_and_grads(loss_fn, params, mb, k, mbs.scaled(w), model_state=ms, keyed=False)
        aux = tree_lib.map(lambda a: a * w, aux)
        step: Any = (grads, aux)
        return (tree_lib.map(torch.add, sums, step), ms), torch.zeros(())

    probe_aux = _zeros_aux(loss_fn, params, mbs.stacked, mbs.keys, model_state)
    init = ((tree_lib.map(lambda p: torch.zeros_like(p, dtype=torch.float32), params), probe_aux), model_state)
    ones = torch.ones(mbs.k, device=mbs.keys.device)  # (the mean's 1/K comes after the sum)
    xs = (mbs.stacked, mbs.keys, ones if mbs.weights is None else mbs.weights)
    ((gsum, asum), model_state), _ = compiler.scan(body, init, xs)
    mbs.add_sums(asum, by_position(gsum))
    return (*mbs.result(params), model_state)


def _zeros_aux(loss_fn, params, micro, keys, model_state):
    """Zeros shaped like the (loss, aux) of one microbatch, to start the scan's carry."""
    mb = tree_lib.map(lambda x: x[0], micro)
    with torch.no_grad(), randomness.KeyedRandomness(keys[0]) as drawn:
        loss, aux, _ = call_loss(loss_fn, params, mb, keys[0], model_state)
    if drawn.calls:  # the scan body runs without the mode: its modules' draws would be torch's global ones
        raise ValueError(
            "accum_impl='scan' cannot key the random draws of the loss's modules (dropout and the "
            "like; torch's scan body cannot enter a torch function mode): use accum_impl='unroll'"
        )
    metrics: Any = {M.LOSS: loss, **aux}
    return tree_lib.map(lambda a: torch.zeros_like(a, dtype=torch.float32), metrics)


def with_frozen(loss_fn: LossFn, frozen: PyTree) -> LossFn:
    """`loss_fn` reading `{**frozen, **params}` (`TrainState.frozen`: a LoRA run's base), or itself when none.

    Args:
      loss_fn: `(params, batch, key[, model_state]) -> ...` over the whole model's params.
      frozen: {name: tensor} of the params the step does not train (compute copies, gathered).

    Returns:
      A loss over the trained params only: the gradient is taken for them alone.

    Example:
      >>> loss, aux = with_frozen(loss_fn, state.frozen)(state.params, batch, key)
    """
    if not frozen:
        return loss_fn
    if isinstance(loss_fn, StagedLoss):  # its stages read the frozen params themselves (gathered per stage)
        return loss_fn.with_frozen(frozen)
    return functools.partial(_frozen_loss, loss_fn, frozen)


def _frozen_loss(loss_fn, frozen, params, *args):
    """`loss_fn` called on the frozen and the trained params together."""
    return loss_fn({**frozen, **params}, *args)
