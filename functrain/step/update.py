"""The optimizer half of a train step: gradients in, a new state and metrics out; the whole tree at once, or
group by group (one compiled graph reused by every block).

Internals: docs/internals.md "functrain.step.update".

Example:
    >>> state, metrics = apply_gradients(state, grads, optim.adamw(3e-4), aux={"loss": loss})
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

import functrain.metric_names as M
import functrain.step.precision as precision_lib
from functrain import compiler, ops, optim
from functrain import tree as tree_lib
from functrain.ops import foreach
from functrain.optim import base as optim_base
from functrain.parallel.dispatch import layout_of
from functrain.parallel.layout import LOCAL, Layout
from functrain.state import Guard, TrainState

__all__ = [
    "Block",
    "Group",
    "apply_gradients",
    "blocks_by_name",
    "fused_in_place",
    "grouped_update",
    "make_update",
    "plan_groups",
    "to_master",
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


def _update_ok(grad_norm: torch.Tensor, metrics: dict) -> torch.Tensor:
    """Whether an update may be applied: a finite gradient norm and, when reported, a finite loss."""
    ok = torch.isfinite(grad_norm)
    if M.LOSS in metrics:
        ok = ok & torch.isfinite(metrics[M.LOSS])
    return ok


def _apply_to_group(optimizer: optim.Transform, lay: Layout, params, grads, opt_state, norm, ok):
    """The update math of one group of params, the whole tree or a block: `(params, opt_state, update norm)`.

    The optimizer on `grads` (its global-norm transforms read `norm`), the updates applied; where `ok` is a tensor
    (skipping on) a non-finite step keeps the old params and optimizer state. The update norm is summed flat inside
    the update's own loop (one reduction there is nearly free; a second one, e.g. a param norm, makes inductor split
    the loop in two passes: 4x the update's time).

    Example:
      >>> params, opt_state, unorm = _apply_to_group(opt, LOCAL, state.params, grads, state.opt_state, gnorm, None)
    """
    updates, new_opt = optim.call_update(optimizer, grads, opt_state, params, norm=norm)
    new_params = optim.apply_updates(params, updates)
    unorm = lay.global_norm(updates, fused=True)
    if ok is not None:
        new_params, new_opt = lay.select(ok, new_params, params), lay.select(ok, new_opt, opt_state)
    return new_params, new_opt, unorm


def _finish(state: TrainState, metrics: dict, ok, prec: precision_lib.Precision, optimizer, lay: Layout, **new):
    """The one epilogue of every update route: `(state with the fields in `new`, step + 1 and the guard after the
    step, metrics)`. With skipping on (`ok` a tensor) the skip counters (and the fp16 scale this step used) go into
    `metrics`, and a new `model_state` is kept only where the update was applied; the optimizer's reported values
    (e.g. the learning rate) are copied, as a donated state's buffers are overwritten by the next step.

    Example:
      >>> return _finish(state, metrics, ok, prec, optimizer, lay, params=params, opt_state=opt_state)
    """
    guard = state.guard if ok is None else _guard_after(state.guard, ok, prec, metrics)
    metrics.update({k: v.clone() for k, v in optim.report(optimizer, new["opt_state"]).items()})
    model_state = new.pop("model_state", None)
    if model_state is None:
        model_state = state.model_state
    elif ok is not None:  # non-finite: the old model state too
        model_state = lay.select(ok, model_state, state.model_state)
    return state._replace(step=state.step + 1, guard=guard, model_state=model_state, **new), metrics


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
    guarded = skip_nonfinite or prec.loss_scaling
    update = make_update(optimizer, donate=False, skip_nonfinite=guarded, precision=prec, layout=layout)
    return update(state, dict(aux or {}), grads, model_state)


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
    ok = _update_ok(grad_norm, metrics) if guarded else torch.ones((), dtype=torch.bool, device=grad_norm.device)
    # `adamw()`'s eager kernel reports the update's norm as the compiled update does (a copy of the params);
    # `adamw(fused=True)` skips it, as torch.optim.AdamW(fused=True) has none
    before = None if optimizer.traits.fused_compiled else [p.clone() for p in tree_lib.leaves(state.params)]
    opt_state = fused(state.params, grads, state.opt_state, norm=grad_norm, found_inf=(~ok).float())
    if opt_state is None:  # tensors the kernel does not take: nothing was touched
        return None
    if before is not None:
        metrics[M.UPDATE_NORM] = LOCAL.global_norm(foreach.sub(tree_lib.leaves(state.params), before))
    new, metrics = _finish(
        state, metrics, ok if guarded else None, prec, optimizer, LOCAL, opt_state=opt_state, model_state=model_state
    )
    return LOCAL.write_into(state, new), metrics  # (the counters; params and moments changed in place)


def _updated_fields(state: TrainState) -> dict:
    """The fields of `state` the fused update writes in place."""
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step, "guard": state.guard}


def make_update(optimizer, *, donate: bool, skip_nonfinite: bool, precision, layout: Layout | None = None):
    """`update(state, aux, grads, model_state=None) -> (state, metrics)`: the optimizer half of every step (norms, the
    optimizer, the non-finite skip, `_finish`'s epilogue), then donation. Eagerly, with an optimizer that has a fused
    kernel and no `layout` given, the kernel updates in place (on a copy of the params and optimizer state where the
    step does not donate: the same numbers either way); else the update math, which compiles in a graph.

    Args:
      optimizer: the `Transform` whose state is `state.opt_state`.
      donate: write the new params and optimizer state into the input state's buffers.
      skip_nonfinite: keep the old state when the gradient norm (or `aux["loss"]`) is not finite.
      precision: the step's `functrain.step.precision.Precision` (its loss-scaling rule).
      layout: where the params live (default `layout_of(state.params)`); a pipeline stage's sums over every stage.

    Returns:
      The update function.

    Example:
      >>> update = make_update(optim.adamw(3e-4), donate=True, skip_nonfinite=True, precision=precision_lib.get(None))
      >>> state, metrics = update(state, {"loss": loss}, grads)
    """

    def update(state: TrainState, aux: dict, grads: PyTree, model_state: PyTree = None):
        if layout is None and optimizer.fused is not None and compiler.eager_autograd_ok():
            own = state if donate else state._replace(**tree_lib.clone(_updated_fields(state)))
            done = fused_in_place(own, aux, grads, optimizer, skip_nonfinite, precision, model_state)
            if done is not None:
                return done
        lay = layout_of(state.params) if layout is None else layout
        metrics = dict(aux)
        metrics[M.GRAD_NORM] = grad_norm = lay.global_norm(grads)
        ok = None
        if skip_nonfinite:  # decided before the update math, so every per-element loop runs after it
            (flag,) = ops.hoist(_update_ok(grad_norm, metrics))
            ok = flag > 0.5
        params, opt_state, metrics[M.UPDATE_NORM] = _apply_to_group(
            optimizer, lay, state.params, grads, state.opt_state, grad_norm, ok
        )
        new_state, metrics = _finish(
            state, metrics, ok, precision, optimizer, lay, params=params, opt_state=opt_state, model_state=model_state
        )
        return (lay.write_into(state, new_state) if donate else new_state), metrics

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


# The update group by group: one compiled graph reused by every block (compile="blocks").


@dataclasses.dataclass(frozen=True)
class Group:
    """Parameters updated together by one call of a compiled update graph.

    Attributes:
      names: the full names of its parameters.
      as_names: the names its graph sees them under (block 0's for a block; its own otherwise).
      kind: which compiled graphs it runs (groups of one kind share them).
    """

    names: tuple[str, ...]
    as_names: tuple[str, ...]
    kind: int


class Block(NamedTuple):
    """A repeated block of a params dict, found by its names (what `plan_groups` reads of a staged loss's block stages).

    Attributes:
      names: its parameters' full names.
      prefix: what its names start with (e.g. "model.layers.3.").
    """

    names: tuple[str, ...]
    prefix: str


def blocks_by_name(params: dict) -> list[Block]:
    """The blocks of a flat params dict by their names: `<container>.<i>.<rest>` (an `nn.ModuleList`'s).

    The first all-digit part of a name numbers its block ("model.layers.3.mlp.experts.1.w" is block 3
    of "model.layers"); of several containers, the one with the most blocks. Whether the blocks are
    alike (names, shapes) is `plan_groups`' to check.

    Args:
      params: {name: tensor}.

    Returns:
      The blocks in index order (empty when no name is numbered).

    Example:
      >>> [b.prefix for b in blocks_by_name(state.params)]
      ['blocks.0.', 'blocks.1.']
    """
    containers: dict[str, dict[int, list[str]]] = {}
    for name in params:
        parts = name.split(".")
        at = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
        if at is not None:
            container = ".".join(parts[:at]) + "." if at else ""
            containers.setdefault(container, {}).setdefault(int(parts[at]), []).append(name)
    if not containers:
        return []
    container, by_index = max(containers.items(), key=lambda kv: len(kv[1]))  # (a tie: the first seen)
    return [Block(tuple(names), f"{container}{i}.") for i, names in sorted(by_index.items())]


def _signature(params: dict, names: Sequence[str], as_names: Sequence[str]) -> tuple:
    """What a compiled graph specializes on: names seen, shapes, dtypes, placements, local shapes."""
    out = []
    for n, a in sorted(zip(names, as_names), key=lambda x: x[1]):
        x = params[n]
        placed = (tuple(x.placements), tuple(x.to_local().shape)) if hasattr(x, "placements") else ()
        out.append((a, tuple(x.shape), x.dtype, x.device.type, placed))
    return tuple(out)


def plan_groups(params: PyTree, blocks: Sequence, optimizer: optim.Transform) -> tuple[list[Group] | None, str]:
    """The update groups for `params`, or None and the reason the whole-tree update must stay.

    Args:
      params: the trained params (a flat dict {name: tensor or DTensor}; a block's names the dict
        lacks are frozen, `TrainState.frozen`, and not updated).
      blocks: the staged loss's block stages (`functrain.step.staged.Stage`: `names`, `prefix`).
      optimizer: the transform the step applies.

    Returns:
      `(groups, "")`, or `(None, reason)`.

    Example:
      >>> groups, why = plan_groups(state.params, loss_fn.blocks, opt)
    """
    if not isinstance(params, dict) or not all(isinstance(v, torch.Tensor) for v in params.values()):
        return None, "the params are not a flat dict of tensors"
    if not optim.is_leafwise(optimizer):
        return None, "the optimizer is not leafwise (optim.is_leafwise; a custom transform must declare it)"
    if len(blocks) < 2:
        return None, "fewer than two blocks"
    lead = blocks[0]
    trained = lambda b: tuple(n for n in b.names if n in params)  # noqa: E731 (frozen ones: TrainState.frozen)
    want = _signature(params, trained(lead), trained(lead))
    seen: set = set()
    groups: list[Group] = []
    for b in blocks:
        names = trained(b)
        if seen & set(names):
            return None, f"block {b.prefix!r} reads a parameter another block reads"
        seen |= set(names)
        as_names = tuple(lead.prefix + n[len(b.prefix) :] for n in names)
        if not all(n.startswith(b.prefix) for n in names) or _signature(params, names, as_names) != want:
            return None, f"block {b.prefix!r} differs from block {lead.prefix!r} in names, shapes or placements"
        groups.append(Group(names, as_names, 0))
    rest = tuple(n for n in params if n not in seen)
    if rest:
        groups.append(Group(rest, rest, 1))
    why = _check_masks(params, groups, optimizer)
    return (None, why) if why else (groups, "")


def _meta(params: dict, names: Sequence[str], as_names: Sequence[str]) -> dict:
    """Meta tensors shaped like `params[names]` (global shapes), named `as_names`."""
    return {a: torch.empty(params[n].shape, dtype=params[n].dtype, device="meta") for n, a in zip(names, as_names)}


def _mask_log(optimizer: optim.Transform, params: dict) -> list:
    """The masks the optimizer resolves on `params` (meta tensors) in its init and one update."""
    with optim_base.recording_masks() as log:
        state = optimizer.init(params)
        optim.call_update(optimizer, params, state, params, norm=torch.ones((), device="meta"))
    return log


def _check_masks(params: dict, groups: list[Group], optimizer: optim.Transform) -> str:
    """ "" when every leaf gets the same mask flags grouped as on the full tree, else the reason."""
    names = tuple(params)
    try:
        full = _mask_log(optimizer, _meta(params, names, names))
        kinds = {g.kind: _mask_log(optimizer, _meta(params, g.names, g.as_names)) for g in reversed(groups)}
    except Exception as e:  # an optimizer that does not run on meta tensors: keep the one graph
        return f"the optimizer could not be checked on meta tensors ({type(e).__name__}: {e})"
    for g in groups:
        got = kinds[g.kind]
        if len(got) != len(full):
            return "the optimizer resolves a different number of masks on a group than on the full tree"
        for whole, part in zip(full, got):
            for n, a in zip(g.names, g.as_names):
                if (n in whole) != (a in part) or (n in whole and whole[n] != part[a]):
                    return f"a mask gives {n!r} a different flag when resolved on its group"
    return ""


def _param_dicts(names: Sequence[str]) -> Callable:
    """The predicate "a dict keyed by parameter names" (an empty dict counts: nothing to split)."""
    known = frozenset(names)
    return lambda x: isinstance(x, dict) and all(k in known for k in x)


def _first_key_dicts(names: Sequence[str]) -> Callable:
    """`_param_dicts` by a dict's first key only (a fraction of its cost under Dynamo)."""
    known = frozenset(names)
    return lambda x: type(x) is dict and (not x or next(iter(x)) in known)


def _dicts_in(x) -> list:
    """Every dict of a state tree, nested ones included (eager: `_Split` checks its predicate on them)."""
    if isinstance(x, dict):
        return [x, *(d for v in x.values() for d in _dicts_in(v))]
    if isinstance(x, (list, tuple)):
        return [d for v in x for d in _dicts_in(v)]
    return []


class _NodesSpec(NamedTuple):
    """A state tree's structure down to `_Split`'s nodes, walked in plain Python (`unflatten` only)."""

    stop: Callable  # the split's `_stop`: which subtrees are its nodes
    template: PyTree

    def unflatten(self, nodes: list) -> PyTree:
        """The template's structure with `nodes` in place of its nodes."""
        return tree_lib.rebuild(self.template, nodes, self.stop)


class _Split:
    """The optimizer state cut into per-group parts: param-name dicts split, the rest shared."""

    # (Specs are made from the tree at hand, never kept. The walks are plain Python in optree's
    # order, as `functrain.tree`'s.)
    def __init__(self, opt_state: PyTree, names: Sequence[str]):
        full, quick = _param_dicts(names), _first_key_dicts(names)
        # the first key decides, when it decides alike for every dict of this state (checked here, eagerly)
        self.is_dict = quick if all(full(d) == quick(d) for d in _dicts_in(opt_state)) else full
        self.dicts = [self.is_dict(x) for x in self.nodes(opt_state)]

    def flatten(self, tree: PyTree) -> tuple[list, Any]:
        """(the param dicts and shared leaves of a state tree in order, its structure down to them)."""
        out = tree_lib.nodes(tree, self._stop)
        if out is not None:
            return out, _NodesSpec(self._stop, tree)
        return optree.tree_flatten(tree, is_leaf=self.is_dict, none_is_leaf=True)  # (a node type of its own)

    def _stop(self, x) -> bool:
        """Whether `x` is one node of the split: None (a leaf, as optree's `none_is_leaf`) or a param dict."""
        return x is None or self.is_dict(x)

    def nodes(self, tree: PyTree) -> list:
        """The param dicts and shared leaves of a state tree, in order."""
        return self.flatten(tree)[0]

    def part(self, nodes: list, spec, g: Group) -> PyTree:
        """Group `g`'s state: its entries of every param dict (under `g.as_names`), shared leaves as they are."""
        pairs = list(zip(g.names, g.as_names))
        out = [{a: x[n] for n, a in pairs if n in x} if d else x for x, d in zip(nodes, self.dicts)]
        return spec.unflatten(out)

    def shared(self, nodes: list) -> list:
        """The shared leaves of a node list."""
        return [x for x, d in zip(nodes, self.dicts) if not d]

    def merge(self, old_nodes: list, spec, parts: list, groups: list[Group], shared: list) -> PyTree:
        """The full state from the groups' new parts and the new shared leaves."""
        where = {n: (i, a) for i, g in enumerate(groups) for n, a in zip(g.names, g.as_names)}
        new = [self.nodes(p) for p in parts]
        it = iter(shared)
        out = []
        for j, (x, d) in enumerate(zip(old_nodes, self.dicts)):
            out.append({n: new[where[n][0]][j][where[n][1]] for n in x} if d else next(it))
        return spec.unflatten(out)


def grouped_update(  # noqa: C901
    optimizer: optim.Transform,
    groups: list[Group],
    lay: Layout,
    *,
    donate: bool,
    guarded: bool,
    prec,
    piece: Callable,
    exact_norms: bool = False,
) -> Callable:
    """The step's update `(state, aux, grads) -> (state, metrics)`, group by group.

    Args:
      optimizer: the leafwise transform.
      groups: from `plan_groups`.
      lay: the params' layout.
      donate: write the new state into the input state's buffers.
      guarded: skip a non-finite update (keep params and optimizer state).
      prec: the `functrain.step.precision.Precision` (its loss-scaling rule).
      piece: wraps the update phase (`torch.compile`); the others run eagerly, but with `exact_norms`.
      exact_norms: the grad norm computed as the whole-tree update computes it, bit for bit: each
        grad's squared norm in a `piece` per group kind, their sum in the whole tree's leaf order in
        a `piece` of its own (compile="step"); False: a fused foreach norm per group, eagerly.

    Returns:
      The update function; the same new state and metrics as the whole-tree update (with
      `exact_norms` the same bits but the update norm's; else to float32 rounding of the norms).

    Example:
      >>> update = grouped_update(opt, groups, LOCAL, donate=True, guarded=True, prec=prec,
      ...                                    piece=torch.compile)
    """

    def squared_norm(grads: dict):
        """The squared norm of a group's grads (one fused foreach norm; mesh-wide for DTensors)."""
        norm = lay.global_norm(grads)
        return norm * norm

    def norm_phase(aux: dict, squares: list, as_global_norm: bool = False):
        """Metrics averaged over dp, the global grad norm (in float32 `as_global_norm`: `tree.global_norm`'s
        dtype), the skip flag (None when not guarded)."""
        metrics = dict(lay.mean_over_dp(aux))
        grad_norm = torch.stack(squares).sum().sqrt()
        metrics[M.GRAD_NORM] = grad_norm = grad_norm.to(torch.float32) if as_global_norm else grad_norm
        return metrics, grad_norm, _update_ok(grad_norm, metrics) if guarded else None

    def leaf_squares(grads: dict) -> dict:
        """Each grad's squared norm by name (`tree.squared_norms`, as `tree.global_norm` takes them)."""
        names = list(grads)
        return dict(zip(names, tree_lib.squared_norms([grads[n] for n in names])))

    def global_norm(state: TrainState, aux: dict, master: list):
        """`norm_phase` from every leaf's compiled square, summed in the whole tree's leaf order."""
        by_name = {}
        for g, gg in zip(groups, master):
            got = squares_fns[g.kind](gg)
            by_name.update({n: got[a] for n, a in zip(g.names, g.as_names)})
        return exact_phase(aux, tree_lib.leaves({n: by_name[n] for n in state.params}))

    def update_phase_for(split: _Split) -> Callable:
        """The per-group update for optimizer states cut by `split`."""

        def update_phase(params: dict, grads: dict, opt_state: PyTree, grad_norm, ok):
            """The optimizer on one group; its params and moments donated; new shared leaves returned."""
            new_params, new_opt, unorm = _apply_to_group(optimizer, lay, params, grads, opt_state, grad_norm, ok)
            if donate:
                new_params, new_opt = donate_phase(split, params, opt_state, new_params, new_opt)
            return new_params, new_opt, unorm * unorm

        return update_phase

    def donate_phase(split: _Split, params: dict, opt_state: PyTree, new_params: dict, new_opt: PyTree):
        """New params and moments written into the old buffers by one copy call (shared leaves: every group's)."""
        old, spec = split.flatten(opt_state)
        new = split.nodes(new_opt)  # (the update keeps the state's structure)
        if len(new) != len(old):
            raise ValueError(
                f"the optimizer's update changed its state's structure ({len(old)} -> {len(new)} "
                "nodes); a grouped update needs the structure kept: use compile=True"
            )
        moments = [(o, n) for o, n, d in zip(old, new, split.dicts) if d]
        lay.write_into((params, [o for o, _ in moments]), (new_params, [n for _, n in moments]))
        return params, spec.unflatten([o if d else n for o, n, d in zip(old, new, split.dicts)])

    # Only the update is compiled, and with `exact_norms` the norm: the other phases are a few fused kernels
    # (a foreach norm per group) and 0-d arithmetic, which cost a graph's compile (~6 s each here) and gain
    # nothing from one; the norm's bits are the whole-tree update's only when compiled as it compiles them.
    made: dict = {}  # optimizer-state structure -> (its _Split, the compiled update per group kind)
    kinds = sorted({g.kind for g in groups})
    squares_fns = {k: piece(leaf_squares) for k in kinds} if exact_norms else {}
    exact_phase = piece(functools.partial(norm_phase, as_global_norm=True))  # (compiled at a first call: exact_norms)

    def prepare(state: TrainState):
        """The state split and the update per group kind for `state`'s optimizer-state structure."""
        structure = optree.tree_structure(state.opt_state, none_is_leaf=True)
        if structure not in made:
            split = _Split(state.opt_state, list(state.params))
            made[structure] = (split, {k: piece(update_phase_for(split)) for k in kinds})
        return made[structure]

    def update(state: TrainState, aux: dict, grads: dict):
        loss_scale = prec.scale_of(state.guard)
        # masters' dtypes, unscaled
        master = [to_master(_pick(grads, g), _pick(state.params, g), loss_scale) for g in groups]
        if exact_norms:
            metrics, grad_norm, ok = global_norm(state, aux, master)
        else:
            metrics, grad_norm, ok = norm_phase(aux, [squared_norm(gg) for gg in master])
        split, update_fns = prepare(state)
        nodes, spec = split.flatten(state.opt_state)
        params, parts, usq = {}, [], []
        for g, gg in zip(groups, master):
            old_p, old_o = _pick(state.params, g), split.part(nodes, spec, g)
            p, o, u = update_fns[g.kind](old_p, gg, old_o, grad_norm, ok)
            params.update({n: p[a] for n, a in zip(g.names, g.as_names)})
            parts.append(o)
            usq.append(u)
        metrics[M.UPDATE_NORM] = torch.stack(usq).sum().sqrt()
        shared = split.shared(split.nodes(parts[0]))  # every group computed the same ones
        if donate:
            shared = lay.write_into(split.shared(nodes), shared)
        opt_state = split.merge(nodes, spec, parts, groups, shared)
        params = {n: params[n] for n in state.params}  # the input's key order
        new, metrics = _finish(state, metrics, ok, prec, optimizer, lay, params=params, opt_state=opt_state)
        if donate:
            lay.write_into((state.step, state.guard), (new.step, new.guard))
            new = new._replace(step=state.step, guard=state.guard)
        return new, metrics

    return update


def _pick(tree: dict, g: Group) -> dict:
    """`tree`'s entries for group `g`, under the names its graph sees."""
    return {a: tree[n] for n, a in zip(g.names, g.as_names)}
