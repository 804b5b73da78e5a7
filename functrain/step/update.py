"""The optimizer half of a train step: gradients in, a new state and metrics out.

Internals: docs/internals.md "functrain.step.update".

Example:
    >>> state, metrics = apply_gradients(state, grads, optim.adamw(3e-4), aux={"loss": loss})
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import functrain.step.metric_names as M
import functrain.step.precision as precision_lib
from functrain import compiler, ops, optim
from functrain import tree as tree_lib
from functrain.ops import foreach
from functrain.parallel.dispatch import layout_of
from functrain.parallel.layout import LOCAL, Layout
from functrain.state import Guard, TrainState

__all__ = [
    "apply_gradients",
    "apply_to_group",
    "close_update",
    "fused_in_place",
    "make_update",
    "to_master",
    "update_ok",
    "update_step",
]

PyTree = Any


def to_master(grads: PyTree, master: PyTree, loss_scale) -> PyTree:
    """Grads cast to the master params' dtypes, divided by the loss scale when there is one."""
    leaves, spec = tree_lib.flatten(grads)
    dtypes = [p.dtype for p in spec.flatten_up_to(master)]
    if loss_scale is not None:  # unscale in float32 (or wider), then cast
        wide = [g.to(torch.promote_types(d, torch.float32)) for g, d in zip(leaves, dtypes)]
        leaves = foreach.mul(wide, torch.reciprocal(loss_scale))
    leaves = [g if g.dtype == d else g.to(d) for g, d in zip(leaves, dtypes)]
    return spec.unflatten(leaves)


def _next_guard(guard: Guard, ok: torch.Tensor, prec: precision_lib.Precision) -> Guard:
    """The guard after a step: skip counters, and the dynamic loss scale's GradScaler rule."""
    bad = (~ok).to(torch.int64)
    skipped = guard.skipped + bad
    consecutive = (guard.consecutive + 1) * bad  # back to 0 after a good step
    if not prec.loss_scaling:
        return Guard(skipped, consecutive, guard.loss_scale, guard.good_steps)
    good = (guard.good_steps + 1) * (1 - bad)
    grow = good >= prec.growth_interval
    scale = torch.where(
        ok,
        torch.where(grow, guard.loss_scale * prec.growth_factor, guard.loss_scale),
        guard.loss_scale * prec.backoff_factor,
    )
    return Guard(skipped, consecutive, scale, torch.where(grow, torch.zeros_like(good), good))


def update_ok(grad_norm: torch.Tensor, metrics: dict) -> torch.Tensor:
    """Whether an update may be applied: a finite gradient norm and, when reported, a finite loss."""
    ok = torch.isfinite(grad_norm)
    if M.LOSS in metrics:
        ok = ok & torch.isfinite(metrics[M.LOSS])
    return ok


def apply_to_group(optimizer: optim.Transform, lay: Layout, params: PyTree, grads: PyTree, opt_state: PyTree, norm, ok):
    """The update math of one group of params, the whole tree or a block: `(params, opt_state, update norm)`.

    The optimizer on `grads` (its global-norm transforms read `norm`), the updates applied; where `ok` is a tensor
    (skipping on) a non-finite step keeps the old params and optimizer state. The update norm is summed flat inside
    the update's own loop (one reduction there is nearly free; a second one, e.g. a param norm, makes inductor split
    the loop in two passes: 4x the update's time).

    Example:
      >>> params, opt_state, unorm = apply_to_group(opt, LOCAL, state.params, grads, state.opt_state, gnorm, None)
    """
    updates, new_opt = optim.call_update(optimizer, grads, opt_state, params, norm=norm)
    new_params = optim.apply_updates(params, updates)
    unorm = lay.global_norm(updates, fused=True)
    if ok is not None:
        new_params, new_opt = lay.select(ok, new_params, params), lay.select(ok, new_opt, opt_state)
    return new_params, new_opt, unorm


def close_update(state: TrainState, ok, prec: precision_lib.Precision, metrics: dict) -> tuple[torch.Tensor, Guard]:
    """The one epilogue of every update route: `(step + 1, the guard after the step)`; with skipping on (`ok` a
    tensor) the skip counters (and the fp16 scale this step used) go into `metrics`.

    Example:
      >>> step, guard = close_update(state, ok, prec, metrics)
    """
    return state.step + 1, (state.guard if ok is None else _guard_after(state.guard, ok, prec, metrics))


def _guard_after(guard: Guard, ok: torch.Tensor, prec: precision_lib.Precision, metrics: dict) -> Guard:
    """`_next_guard`, with the skip counters (and the fp16 scale this step used) added to `metrics`."""
    new = _next_guard(guard, ok, prec)
    metrics[M.SKIPPED] = (~ok).to(torch.float32)
    # float32, as every metric is logged. An int64 0-d graph output here broke the fp32 step on CUDA
    # (torch 2.11): inductor gave it the buffer of SDPA's efficient-attention philox offset, a CPU
    # tensor, and a Triton kernel then failed on it ("Pointer argument ... cannot be accessed from
    # Triton (cpu tensor?)"). As float32 the new counts are computed into the donated state alone.
    metrics[M.CONSECUTIVE_SKIPS] = new.consecutive.to(torch.float32)
    metrics[M.SKIPPED_TOTAL] = new.skipped.to(torch.float32)
    if prec.loss_scaling:
        metrics[M.LOSS_SCALE] = guard.loss_scale.clone()  # its buffer may be donated
    return new


def apply_gradients(
    state: TrainState,
    grads: PyTree,
    optimizer: optim.Transform,
    *,
    aux: dict | None = None,
    skip_nonfinite: bool = True,
    precision: str | torch.dtype | precision_lib.Precision | None = None,
    layout: Layout | None = None,
    model_state: PyTree = None,
) -> tuple[TrainState, dict]:
    """The optimizer half of a train step: `state` updated by `grads` (pure; compiles in a graph).

    For research steps that make their own gradients (DP-SGD clipping and noise, meta-gradients,
    gradients from `torch.func.vmap`...): the update, the norms, the skip of a non-finite update
    and the step counter exactly as `make_train_step` does them.

    Args:
      state: the current `TrainState` (not modified).
      grads: gradients shaped like `state.params` (already in the params' dtype and placements).
      optimizer: the `Transform` whose state is `state.opt_state`.
      aux: metrics to pass through; a "loss" entry takes part in the non-finite check.
      skip_nonfinite: keep the old params and optimizer state when the loss or the grad norm is
        not finite (counted in `state.guard`).
      precision: only its loss-scaling rule is used (the fp16 scale update in `state.guard`).
      layout: where the params live (default `layout_of(state.params)`); a pipeline stage passes one
        whose norms sum over every stage (`functrain.parallel.pipeline`).
      model_state: the model state the forward produced (BatchNorm statistics); it replaces
        `state.model_state`, except when the update is skipped. None keeps `state.model_state`.

    An eager call with an optimizer that has a fused route (`optim.adamw()`) runs it on a copy of the params
    and optimizer state (`fused_in_place`): what `make_train_step`'s eager step computes.

    Returns:
      `(new_state, metrics)`: metrics hold `aux`, `grad_norm`, `update_norm` (of the optimizer's
      update, before a skip; the kernel's route: of the params' change), `lr`, and the skip counters
      when skipping. The params' norm is not taken here (it would cost a pass of its own every step):
      log `tree.global_norm(state.params)` when you log, as `functrain.trainer.loop` does.

    Example:
      >>> grads = tree.map(lambda g: g + sigma * torch.randn_like(g), clipped_mean_grads)
      >>> state, metrics = apply_gradients(state, grads, opt, aux={"loss": loss})
    """
    prec = precision_lib.get(precision)
    if layout is None and optimizer.fused is not None and compiler.eager_autograd_ok():
        own = state._replace(**tree_lib.clone(_updated_fields(state)))
        done = fused_in_place(
            own, dict(aux or {}), grads, optimizer, skip_nonfinite or prec.loss_scaling, prec, model_state
        )
        if done is not None:
            return done
    lay = layout_of(state.params) if layout is None else layout
    metrics = dict(aux or {})
    metrics[M.GRAD_NORM] = grad_norm = lay.global_norm(grads)
    ok = None
    if skip_nonfinite or prec.loss_scaling:  # decided before the update math, so every per-element loop runs after it
        (flag,) = ops.hoist(update_ok(grad_norm, metrics))
        ok = flag > 0.5
    params, opt_state, metrics[M.UPDATE_NORM] = apply_to_group(
        optimizer, lay, state.params, grads, state.opt_state, grad_norm, ok
    )
    model_state = state.model_state if model_state is None else model_state
    if ok is not None:  # non-finite: the old model state too
        model_state = lay.select(ok, model_state, state.model_state)
    step, guard = close_update(state, ok, prec, metrics)
    metrics.update(optim.report(optimizer, opt_state))  # e.g. the learning rate this update used
    return state._replace(params=params, opt_state=opt_state, step=step, guard=guard, model_state=model_state), metrics


def fused_in_place(
    state: TrainState,
    aux: dict,
    grads: PyTree,
    optimizer: optim.Transform,
    guarded: bool,
    prec: precision_lib.Precision,
    model_state: PyTree = None,
):
    """`apply_gradients` with donation, through the optimizer's fused kernel (`optim.adamw(..., fused=True)`).

    Runs eagerly on one process's params: the params and moments are updated in place by torch's
    precompiled kernel, as `torch.optim.AdamW(fused=True)` does (the metrics have no `update_norm`).

    Args:
      state: the `TrainState`, whose buffers the update writes into (donated).
      aux: metrics to pass through; a "loss" entry takes part in the non-finite check.
      grads: gradients in the master params' dtypes, unscaled.
      optimizer: the `Transform`; only one with a fused route (`optimizer.fused`) runs here.
      guarded: skip a non-finite update (keep params and optimizer state).
      prec: the step's `functrain.step.precision.Precision` (its loss-scaling rule).
      model_state: the model state the forward produced, or None to keep `state.model_state`.

    Returns:
      `(new_state, metrics)`, or None, touching nothing, where the kernel cannot run: no fused route,
      sharded params, inside a trace or a transform, or tensors it does not take.

    Example:
      >>> done = fused_in_place(state, {"loss": loss}, grads, optim.adamw(3e-4, fused=True), True, prec)
    """
    fused = optimizer.fused
    if fused is None or not compiler.eager_autograd_ok() or layout_of(state.params) is not LOCAL:
        return None
    metrics = dict(aux)
    metrics[M.GRAD_NORM] = grad_norm = LOCAL.global_norm(grads)
    ok = update_ok(grad_norm, metrics) if guarded else torch.ones((), dtype=torch.bool, device=grad_norm.device)
    # `adamw()`'s eager kernel reports the update's norm as the compiled update does (a copy of the params);
    # `adamw(fused=True)` skips it, as torch.optim.AdamW(fused=True) has none
    before = None if optimizer.traits.fused_compiled else [p.clone() for p in tree_lib.leaves(state.params)]
    opt_state = fused(state.params, grads, state.opt_state, norm=grad_norm, found_inf=(~ok).float())
    if opt_state is None:  # tensors the kernel does not take: nothing was touched
        return None
    if before is not None:
        metrics[M.UPDATE_NORM] = LOCAL.global_norm(foreach.sub(tree_lib.leaves(state.params), before))
    step, guard = close_update(state, ok if guarded else None, prec, metrics)
    metrics.update(optim.report(optimizer, opt_state))
    model_state = state.model_state if model_state is None else LOCAL.select(ok, model_state, state.model_state)
    new = state._replace(opt_state=opt_state, step=step, guard=guard, model_state=model_state)
    return LOCAL.write_into(state, new), metrics  # (the counters; params and moments changed in place)


def _updated_fields(state: TrainState) -> dict:
    """The fields of `state` the fused update writes in place."""
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step, "guard": state.guard}


def make_update(optimizer, *, donate: bool, skip_nonfinite: bool, precision, layout: Layout | None = None):
    """`update(state, aux, grads, model_state=None) -> (state, metrics)`: `apply_gradients`, then donation; through
    the optimizer's fused kernel when it has one, the step runs eagerly and no `layout` is given (in place, on a
    copy of the params and optimizer state where the step does not donate: the same numbers either way)."""

    def update(state: TrainState, aux: dict, grads: PyTree, model_state: PyTree = None):
        if donate and optimizer.fused is not None and layout is None:  # (not donating: apply_gradients' copy)
            done = fused_in_place(state, aux, grads, optimizer, skip_nonfinite, precision, model_state)
            if done is not None:
                return done
        new_state, metrics = apply_gradients(
            state,
            grads,
            optimizer,
            aux=aux,
            skip_nonfinite=skip_nonfinite,
            precision=precision,
            layout=layout,
            model_state=model_state,
        )
        if donate:
            new_state = (layout_of(state.params) if layout is None else layout).write_into(state, new_state)
        return new_state, metrics

    return update


def update_step(
    optimizer: optim.Transform,
    *,
    donate: bool = True,
    compile: bool = True,
    skip_nonfinite: bool = True,
    precision: str | torch.dtype | precision_lib.Precision | None = None,
    compile_options: dict | None = None,
) -> Callable[[TrainState, PyTree, dict], tuple[TrainState, dict]]:
    """The optimizer half of the train step on its own: `update(state, grads, aux) -> (state, metrics)`.

    The same code `make_train_step` runs after the backward (`apply_gradients`: norms, the optimizer,
    the non-finite skip, the step counter; then donation), compiled as one graph. For gradients made
    elsewhere (DP-SGD noise, gradients from another process, `bench/optimizer.py`).

    Args:
      optimizer: the `Transform` whose state is `state.opt_state`.
      donate: write the new params and optimizer state into the input state's buffers.
      compile: compile with `torch.compile(fullgraph=True)`.
      skip_nonfinite: keep the old state when the gradient norm (or `aux["loss"]`) is not finite.
      precision: only its loss-scaling rule is used (see `apply_gradients`).
      compile_options: extra keyword arguments for `torch.compile`.

    Returns:
      The update function; `aux` (e.g. `{"loss": loss}`) passes into the metrics.

    Example:
      >>> update = update_step(optim.adamw(3e-4))
      >>> state, metrics = update(state, grads, {"loss": loss})
    """
    prec = precision_lib.get(precision)
    inner = make_update(optimizer, donate=donate, skip_nonfinite=skip_nonfinite or prec.loss_scaling, precision=prec)

    def update(state: TrainState, grads: PyTree, aux: dict | None = None):
        return inner(state, dict(aux or {}), grads)

    return compiler.maybe_compile(update, compile, compile_options)
