"""Populations: K models (different seeds and/or hyper-parameters) trained by one compiled step.

Internals: docs/internals.md "functrain.population".

Example:
    >>> states = [optim.set_hyperparams(init_state(params_k, opt, seed=k), lr=lr_k) for k, ...]
    >>> pop = population.stack(states)
    >>> step = population.make_population_step(loss_fn, opt)
    >>> pop, metrics = step(pop, batch)       # metrics["loss"]: (K,)
    >>> best = population.member(pop, int(metrics["loss"].argmin()))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from functrain import compiler
from functrain import step as step_lib
from functrain.nn.model_state import check_loss
from functrain.ops import foreach
from functrain.parallel.layout import LOCAL
from functrain.state import TrainState

__all__ = ["make_population_step", "member", "stack", "unstack"]

PyTree = Any


def stack(states: Sequence[TrainState]) -> TrainState:
    """K states of the same structure as one state whose leaves have a leading dimension K.

    Args:
      states: the members (e.g. `init_state` with different seeds, then `optim.set_hyperparams`).

    Returns:
      The population state; the frozen params (`TrainState.frozen`, a LoRA base), the same for
      every member, are shared, not stacked.

    Example:
      >>> pop = stack([init_state(model, opt, seed=s) for s in range(8)])
    """
    first = states[0]
    if any(not _same(s.frozen, first.frozen) for s in states[1:]):
        raise ValueError(
            "population.stack: the members hold different frozen params; a population shares one "
            "frozen base (give every member the same TrainState.frozen dict)"
        )
    stacked: Any = optree.tree_map(lambda *xs: torch.stack(xs), *[s.replace(frozen={}) for s in states])  # type: ignore[arg-type]
    return stacked.replace(frozen=first.frozen)  # shared, not stacked: one base for every member


def _same(a: dict, b: dict) -> bool:
    """Whether two frozen dicts hold the same tensors (the same objects, or equal values)."""
    return a.keys() == b.keys() and all(a[k] is b[k] or torch.equal(a[k], b[k]) for k in a)


def member(state: TrainState, i: int) -> TrainState:
    """Member `i` of a population state (views of its leaves).

    Args:
      state: a population state.
      i: the member's index.

    Returns:
      A plain `TrainState`.

    Example:
      >>> solo = member(pop, 3)
    """
    member: Any = optree.tree_map(lambda x: x[i], state.replace(frozen={}))  # type: ignore[arg-type]
    return member.replace(frozen=state.frozen)


def unstack(state: TrainState) -> list[TrainState]:
    """Every member of a population state, in order.

    Args:
      state: a population state.

    Returns:
      A list of K plain `TrainState`s.

    Example:
      >>> members = unstack(pop)
    """
    k = state.step.shape[0]
    return [member(state, i) for i in range(k)]


def make_population_step(
    loss_fn: Callable,
    optimizer,
    *,
    batch_axis: int | None = None,
    compile: bool = True,
    donate: bool = True,
    precision=None,
    skip_nonfinite: bool = True,
    compile_options: dict | None = None,
) -> Callable[[TrainState, PyTree], tuple[TrainState, dict]]:
    """`step(population, batch) -> (population, metrics)`: the train step of every member at once.

    Args:
      loss_fn: as for `make_train_step`.
      optimizer: as for `make_train_step` (its hyper-parameters may differ per member: they are state).
      batch_axis: None: every member trains on the same batch; 0: batch leaves have a leading K dim,
        one batch per member.
      compile: compile the vmapped step as one graph (`torch.compile(fullgraph=True)`).
      donate: write the new population into the input's buffers (the input is consumed).
      precision, skip_nonfinite: as for `make_train_step` (the skip guard is per member).
      compile_options: extra keyword arguments for `torch.compile`.

    Returns:
      The step; its metrics have a leading K dimension (`metrics["loss"][k]` is member k's loss).

    Example:
      >>> step = make_population_step(loss_fn, optim.adamw(1e-3))
      >>> pop, metrics = step(pop, batch)
    """
    # The eager body for unsharded params, resolved now (not inside the trace: that would recompile).
    body = step_lib.make_train_step(
        loss_fn,
        optimizer,
        compile=False,
        donate=False,
        precision=precision,
        skip_nonfinite=skip_nonfinite,
        layout=LOCAL,
    )

    def population_step(state: TrainState, batch: PyTree):
        # every leaf has the member dim but the frozen params', shared by all members (a LoRA base)
        dims: Any = TrainState(*([0] * (len(TrainState._fields) - 1)), frozen=None)  # type: ignore[misc, arg-type]
        new, metrics = torch.func.vmap(body, in_dims=(dims, batch_axis), out_dims=(dims, 0))(state, batch)
        new = new.replace(frozen=state.frozen)  # (never written)
        if donate:
            new = LOCAL.write_into(state.replace(frozen={}), new.replace(frozen={})).replace(frozen=state.frozen)
        return new, metrics

    population_step = compiler.maybe_compile(population_step, compile, compile_options)  # as make_train_step

    def step(state: TrainState, batch: PyTree):
        check_loss(loss_fn, state.model_state)
        with foreach.per_tensor():  # vmap has no batching rules for the fused foreach kernels
            return population_step(state, batch)

    return step
