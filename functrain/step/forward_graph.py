"""compile="step" on one process: the loss's forward one compiled graph, its backward AOTAutograd's.

The gradients are taken by plain autograd between the compiled forward and the update, as
`torch.compile(model)` trains; microbatches are a loop over that one graph.
Internals: docs/internals.md "functrain.step.forward_graph".

Example:
    >>> forward = compiler.maybe_compile(functools.partial(forward_graph.forward, loss_fn, prec, LOCAL), True, None)
    >>> aux, grads, model_state = forward_graph.loss_and_grads(forward, plan, LOCAL, state, batch)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

import functrain.step.metric_names as M
import functrain.step.precision as precision_lib
from functrain import tree as tree_lib
from functrain.nn.model_state import has_model_state, restore_dtypes
from functrain.parallel.layout import Layout
from functrain.state import TrainState
from functrain.step.grads import scaled_loss, with_frozen
from functrain.step.microbatches import Microbatches, step_key

__all__ = ["Forward", "Plan", "compute_model_state", "forward", "loss_and_grads"]

PyTree = Any


class Plan(NamedTuple):
    """What `loss_and_grads` needs of the train step's arguments.

    Attributes:
      prec: the `functrain.step.precision.Precision`.
      accum_steps: microbatches per step.
      count_targets: `batch -> target count` for a token-weighted loss, or None.
      model_state_sync: `Layout.sync_model_state`'s rule ("broadcast" or "mean").
    """

    prec: precision_lib.Precision
    accum_steps: int
    count_targets: Callable[[PyTree], torch.Tensor] | None
    model_state_sync: str


def compute_model_state(model_state: PyTree, lay: Layout, prec: precision_lib.Precision) -> PyTree:
    """The model state the forward runs with: this rank's tensors, floating buffers in the compute dtype.

    Args:
      model_state: `TrainState.model_state` (an empty dict or None when the model has none).
      lay: the params' layout.
      prec: the step's precision.

    Returns:
      The model state to pass to the loss.

    Example:
      >>> ms = compute_model_state(state.model_state, LOCAL, precision_lib.get("bf16"))
    """
    if not has_model_state(model_state):
        return model_state
    local = lay.local_model_state(model_state)
    return precision_lib.cast_floating(local, prec.compute_dtype) if prec.casts else local


def forward(  # noqa: PLR0913
    loss_fn: Callable,
    prec: precision_lib.Precision,
    lay: Layout,
    params: PyTree,
    frozen: PyTree,
    batch: PyTree,
    key: torch.Tensor,
    factor: torch.Tensor | None,
    model_state: PyTree,
) -> tuple[torch.Tensor, Any, PyTree]:
    """One (micro)batch's loss, what `torch.compile` compiles (AOTAutograd adds its backward graph).

    Args:
      loss_fn: the step's loss function.
      prec: the step's precision: params, frozen params and batch are cast to its compute dtype here, so
        the gradients flow back through the cast to the master params.
      lay: the params' layout (`parallel.LOCAL`).
      params: the master params (leaves that require grad).
      frozen: `TrainState.frozen` (no gradient).
      batch: the (micro)batch.
      key: its RNG key: every dropout of the loss draws from it.
      factor: what the loss is multiplied by before the backward (the loss scale times the microbatch's
        token weight), or None.
      model_state: the model state the forward starts from.

    Returns:
      `(scaled loss, {"loss": loss, **aux} detached, new model state detached)`.

    Example:
      >>> scaled, aux, _ = forward(loss_fn, prec, LOCAL, params, {}, batch, key, None, {})
    """
    params, batch = precision_lib.to_compute(prec, params, batch)
    frozen, _ = precision_lib.to_compute(prec, frozen, None)
    model_state = compute_model_state(model_state, lay, prec)
    scaled, loss, aux, new_state = scaled_loss(with_frozen(loss_fn, frozen), params, batch, key, model_state, factor)
    metrics: Any = {M.LOSS: loss, **aux}
    detached: Any = tree_lib.map(lambda a: a.detach() if torch.is_tensor(a) else a, metrics)
    return scaled, detached, tree_lib.map(torch.Tensor.detach, new_state)


class Forward:
    """`forward` compiled, its first call preceded by one eager call without gradients.

    A forward that writes into a template's buffer which the model state does not carry is refused by
    `functrain.apply`'s eager check (its trace cannot see the write, and would apply it to the template
    at every step): the eager call raises that one line before anything is compiled.

    Args:
      fn: `forward` with its first three arguments bound.
      compiled: `fn` compiled (e.g. `compiler.maybe_compile(fn, True, options)`).

    Example:
      >>> fwd = Forward(fn, compiler.maybe_compile(fn, True, None))
      >>> scaled, aux, model_state = fwd(params, frozen, batch, key, None, {})
    """

    def __init__(self, fn: Callable, compiled: Callable):
        self.fn, self.compiled, self.checked = fn, compiled, False

    def __call__(self, *args):
        if not self.checked:
            with torch.no_grad():
                self.fn(*args)
            self.checked = True
        return self.compiled(*args)


def loss_and_grads(forward_fn: Callable, plan: Plan, lay: Layout, state: TrainState, batch: PyTree):
    """`(aux, grads, model state)` of the step's batch: each microbatch through `forward_fn`, its gradients by
    autograd, summed in float32 over the microbatches (their mean, or weighted by their target counts).

    Args:
      forward_fn: `forward` with its first three arguments bound, compiled.
      plan: the step's `Plan`.
      lay: the params' layout (`parallel.LOCAL`).
      state: the `TrainState` (its params are not modified).
      batch: the step's batch (dim 0 divides into `plan.accum_steps` microbatches).

    Returns:
      `(aux, grads, model_state)` as the one-graph step's loss half gives them: the aux averaged (or
      weighted) over microbatches, grads shaped like the params (in the compute dtype's float32 sum when
      accumulating), the model state after the last microbatch made one over the ranks.

    Example:
      >>> aux, grads, model_state = loss_and_grads(forward_fn, plan, LOCAL, state, batch)
    """
    leaves, spec = tree_lib.flatten(state.params)
    leaves = [x.detach().requires_grad_() for x in leaves]
    params = spec.unflatten(leaves)
    scale = plan.prec.scale_of(state.guard)
    mbs = Microbatches(
        batch, step_key(state, lay), plan.accum_steps, lay, count_targets=plan.count_targets, loss_scale=scale
    )
    model_state = state.model_state
    for i, (mb, mb_key) in enumerate(mbs):
        with torch.enable_grad():
            scaled, aux, model_state = forward_fn(params, state.frozen, mb, mb_key, mbs.factor(i), model_state)
            found = torch.autograd.grad(scaled, leaves, allow_unused=True)
        mbs.add(i, aux, {j: torch.zeros_like(x) if g is None else g for j, (x, g) in enumerate(zip(leaves, found))})
    if has_model_state(model_state):
        model_state = lay.sync_model_state(restore_dtypes(model_state, state.model_state), plan.model_state_sync)
    return (*mbs.result(state.params), model_state)
