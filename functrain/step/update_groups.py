"""The optimizer update group by group: one compiled graph reused by every block (compile="blocks").

Internals: docs/internals.md "functrain.step.update_groups".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

import functrain.step.metric_names as M
from functrain import optim
from functrain import tree as tree_lib
from functrain.optim import base as optim_base
from functrain.parallel import Layout
from functrain.state import TrainState
from functrain.step.update import apply_to_group, close_update, to_master, update_ok

__all__ = ["Block", "Group", "blocks_by_name", "plan", "grouped_update"]

PyTree = Any


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
    """A repeated block of a params dict, found by its names (what `plan` reads of a staged loss's block stages).

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
    alike (names, shapes) is `plan`'s to check.

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


def plan(params: PyTree, blocks: Sequence, optimizer: optim.Transform) -> tuple[list[Group] | None, str]:
    """The update groups for `params`, or None and the reason the whole-tree update must stay.

    Args:
      params: the trained params (a flat dict {name: tensor or DTensor}; a block's names the dict
        lacks are frozen, `TrainState.frozen`, and not updated).
      blocks: the staged loss's block stages (`functrain.step.staged.Stage`: `names`, `prefix`).
      optimizer: the transform the step applies.

    Returns:
      `(groups, "")`, or `(None, reason)`.

    Example:
      >>> groups, why = update_groups.plan(state.params, loss_fn.blocks, opt)
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
      groups: from `plan`.
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
      >>> update = update_groups.grouped_update(opt, groups, LOCAL, donate=True, guarded=True, prec=prec,
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
        return metrics, grad_norm, update_ok(grad_norm, metrics) if guarded else None

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
            new_params, new_opt, unorm = apply_to_group(optimizer, lay, params, grads, opt_state, grad_norm, ok)
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

    def epilogue(state: TrainState, old_shared: list, new_shared: list, squares: list, metrics: dict, ok):
        """Update norm, skip guard and step counter; the shared optimizer leaves written back."""
        metrics = dict(metrics)
        metrics[M.UPDATE_NORM] = torch.stack(squares).sum().sqrt()
        step, guard = close_update(state, ok, prec, metrics)
        if donate:
            new_shared = lay.write_into(old_shared, new_shared)
            step, guard = lay.write_into((state.step, state.guard), (step, guard))
        return step, guard, new_shared, metrics

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
        new_shared = split.shared(split.nodes(parts[0]))  # every group computed the same ones
        step, guard, shared, metrics = epilogue(state, split.shared(nodes), new_shared, usq, metrics, ok)
        opt_state = split.merge(nodes, spec, parts, groups, shared)
        params = {n: params[n] for n in state.params}  # the input's key order
        # reported values (e.g. the learning rate) are copied: with donation the state's buffers
        # are overwritten by the next step
        metrics.update({k: v.clone() for k, v in optim.report(optimizer, opt_state).items()})
        return state._replace(params=params, opt_state=opt_state, step=step, guard=guard), metrics

    return update


def _pick(tree: dict, g: Group) -> dict:
    """`tree`'s entries for group `g`, under the names its graph sees."""
    return {a: tree[n] for n, a in zip(g.names, g.as_names)}
