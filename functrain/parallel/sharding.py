"""Sharding as data: ordered (regex -> placements per mesh axis) rules, and sharding a state tree.

Internals: docs/internals.md "functrain.parallel.sharding".

Example:
    >>> rules = parallel.default_rules(gpt.TP_RULES)   # FSDP on dp_shard + GPT TP on tp
    >>> state = parallel.shard_state(state, ctx.mesh, rules)
    >>> full = parallel.gather(state.params)          # plain tensors on every rank
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from functrain import tree as tree_lib
from functrain.parallel.mesh import TP_AXIS
from functrain.state import TrainState

__all__ = [
    "Rule",
    "FSDP_RULES",
    "tp_rules",
    "default_rules",
    "placements_for",
    "active_mesh",
    "shard_params",
    "shard_state",
    "gather",
    "init_sharded",
]

PyTree = Any
Spec = Placement | str
Rule = tuple[str, Mapping[str, Spec]]

FSDP_RULES: list[Rule] = [(r".*", {"dp_shard": Shard(0), "cp": Shard(0)})]
"""FSDP: every parameter `Shard(0)` on the dp_shard axis and on the cp axis (replicated on
dp_replicate and tp); with both axes wider than 1, cp moves to the next dim (`Shard(1)`, see the
normalizations above), so a context-parallel rank never holds a whole parameter either."""

_TP_KINDS = ("colwise", "rowwise", "replicate")


def tp_rules(kinds: Sequence[tuple[str, str]], axis: str = TP_AXIS) -> list[Rule]:
    """Turns a model's `TP_RULES` ((regex, "colwise"|"rowwise"|"replicate"), ...) into rules.

    Args:
      kinds: ordered (pattern, kind) pairs, e.g. `functrain.models.gpt.TP_RULES`.
      axis: the tensor-parallel mesh axis.

    Returns:
      A list of `(pattern, {axis: kind})` rules.

    Example:
      >>> tp_rules([("mlp.fc", "colwise"), (".*", "replicate")])
      [('mlp.fc', {'tp': 'colwise'}), ('.*', {'tp': 'replicate'})]
    """
    out: list[Rule] = []
    for pattern, kind in kinds:
        if kind not in _TP_KINDS:
            raise ValueError(f"tensor-parallel kind must be one of {_TP_KINDS}, got {kind!r} for {pattern!r}")
        out.append((pattern, {axis: kind}))
    return out


def default_rules(tp: Sequence[tuple[str, str]] | None = None) -> list[Rule]:
    """The default rules: a model's TP kinds on the tp axis (if given), then FSDP on dp_shard.

    Args:
      tp: the model's `TP_RULES`, or None for FSDP only.

    Returns:
      An ordered rule list for `shard_state` / `tensor_parallel`.

    Example:
      >>> rules = default_rules(gpt.TP_RULES)
    """
    return (tp_rules(tp) if tp else []) + list(FSDP_RULES)


def _spec_placement(spec: Spec | None, ndim: int) -> Placement:
    """The placement a rule spec gives a tensor with `ndim` dims."""
    if spec is None or spec == "replicate":
        return Replicate()
    if spec == "colwise":
        return Shard(0) if ndim >= 1 else Replicate()
    if spec == "rowwise":
        return Shard(1) if ndim >= 2 else Replicate()
    if isinstance(spec, Shard):
        if ndim == 0:
            return Replicate()
        return Shard(spec.dim % ndim)
    if isinstance(spec, Placement):
        return spec
    raise ValueError(f"bad placement spec {spec!r}: use a Placement or one of {_TP_KINDS}")


def placements_for(name: str, shape: Sequence[int], mesh, rules: Sequence[Rule]) -> tuple[Placement, ...]:
    """The placements (one per mesh axis) that `rules` give a tensor `name` of `shape`.

    Args:
      name: the dotted parameter name (e.g. "blocks.0.attn.q.weight").
      shape: its global shape.
      mesh: the DeviceMesh (named axes).
      rules: ordered rules (see the module docstring).

    Returns:
      A tuple of `Shard`/`Replicate`, one per mesh axis, after the normalizations above.

    Example:
      >>> placements_for("blocks.0.attn.q.weight", (32, 32), mesh, default_rules(gpt.TP_RULES))
      (Replicate(), Shard(dim=1), Shard(dim=0))
    """
    axes = mesh.mesh_dim_names
    ndim = len(shape)
    out: list[Placement] = []
    for axis in axes:
        spec = None
        for pattern, per_axis in rules:
            if axis in per_axis and re.search(pattern, name):
                spec = per_axis[axis]
                break
        out.append(_spec_placement(spec, ndim))
    for i in range(len(axes)):
        if mesh.size(i) == 1:
            out[i] = Replicate()
    # tp keeps its dim; every other axis moves off a dim that another axis already shards.
    order = sorted(range(len(axes)), key=lambda i: axes[i] != TP_AXIS)
    taken: set[int] = set()
    for i in order:
        p = out[i]
        if not isinstance(p, Shard):
            continue
        if p.dim in taken:
            free = [d for d in range(ndim) if d not in taken]
            p = Shard(free[0]) if free else Replicate()
            out[i] = p
        if isinstance(p, Shard):
            taken.add(p.dim)
    return tuple(out)


def active_mesh(mesh):
    """The sub-mesh of `mesh`'s axes with more than one rank (the 1-D dp_shard axis if none).

    State DTensors live on it: DTensor's sharding propagation cost grows steeply with the number
    of mesh dims, size-1 dims included (docs/results.md; paid again when tracing).

    Args:
      mesh: a DeviceMesh with named axes.

    Returns:
      A DeviceMesh over the same ranks with only the axes of size > 1 (in order).

    Example:
      >>> active_mesh(ctx.mesh).mesh_dim_names      # dp_shard=2, tp=1 -> ('dp_shard',)
    """
    names = mesh.mesh_dim_names
    keep = tuple(n for i, n in enumerate(names) if mesh.size(i) > 1)
    if not keep:
        keep = ("dp_shard",) if "dp_shard" in names else (names[0],)
    if keep == tuple(names):
        return mesh
    return mesh[keep if len(keep) > 1 else keep[0]]


def _distribute(x: torch.Tensor, mesh, placements, src_rank: int | None) -> DTensor:
    """`x` (plain or DTensor) as a DTensor on `mesh` with `placements`."""
    if isinstance(x, DTensor):
        if x.device_mesh != mesh:
            raise ValueError("shard_state: a DTensor leaf lives on another mesh; gather it first")
        return x.redistribute(mesh, placements)
    d = distribute_tensor(x.detach(), mesh, list(placements), src_data_rank=src_rank)
    local = d.to_local()
    if local.numel() and local.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        # A local slice or replica can alias the input; the state must own its buffers (donation).
        d = DTensor.from_local(local.clone(), mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride())
    return d


def shard_params(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    mesh,
    rules: Sequence[Rule] | None = None,
    *,
    src_rank: int | None = 0,
) -> dict[str, DTensor]:
    """Shards a {name: tensor} dict (or a lazy iterable of pairs) onto `mesh`, one tensor at a time.

    Given an iterable that creates each full tensor on demand, at most one full parameter exists at
    a time besides the shards (an init that never holds the whole model).

    Args:
      params: {name: full tensor} or an iterable of (name, full tensor).
      mesh: the DeviceMesh.
      rules: sharding rules (default `FSDP_RULES`).
      src_rank: the rank whose values are scattered (0); None: every rank slices its own copy
        locally with no communication (the values must then be equal on every rank).

    Returns:
      {name: DTensor} in the input order.

    Example:
      >>> params = shard_params(((n, init_one(n)) for n in names), ctx.mesh, rules)
    """
    rules = FSDP_RULES if rules is None else rules
    mesh = active_mesh(mesh)
    items = params.items() if isinstance(params, Mapping) else params
    out = {}
    for name, x in items:
        out[name] = _distribute(x, mesh, placements_for(name, x.shape, mesh, rules), src_rank)
    return out


def init_sharded(
    init_params,
    key: torch.Tensor,
    mesh,
    rules: Sequence[Rule] | None = None,
    *,
    device=None,
    names: Collection[str] | None = None,
) -> dict[str, DTensor]:
    """Sharded initialization: every rank draws only its own block of each parameter.

    No rank ever holds a whole parameter, let alone the whole model; with an init that draws each
    block from (key, name, position) (as `functrain.models.gpt.init_params` does through
    `rng.normal`), the shards are bit for bit those of the single-process init.

    Args:
      init_params: `init_params(key, device, where=...) -> {name: local block}`, where
        `where(name, global_shape) -> (offset, local_shape)` names this rank's block (a `Task`'s
        `init_params`). It must call `where` for every parameter, in its output order.
      key: the `rng` key.
      mesh: the DeviceMesh.
      rules: sharding rules (default `FSDP_RULES`).
      device: where the local blocks live.
      names: make only these parameters (a pipeline stage's, `functrain.parallel.pipeline`); the others are
        drawn as empty blocks and left out. None: all of them.

    Returns:
      {name: DTensor} with the placements `rules` give, in `init_params`' order.

    Example:
      >>> params = parallel.init_sharded(task.init_params, rng.key(0), ctx.mesh, task.shard_rules)
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    rules = FSDP_RULES if rules is None else rules
    mesh = active_mesh(mesh)
    layout: dict = {}  # name -> (global shape, placements)

    def where(name, shape):
        """This rank's block of parameter `name`."""
        shape = tuple(int(s) for s in shape)
        if names is not None and name not in names:  # not this stage's: draw nothing
            return [0] * len(shape), [0] * len(shape)
        placements = placements_for(name, shape, mesh, rules)
        layout[name] = (shape, placements)
        local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, list(placements))
        return list(offset), list(local_shape)

    blocks = init_params(key, device, where=where)
    out = {}
    for name, local in blocks.items():
        if name not in layout:
            continue
        shape, placements = layout[name]
        stride = torch.empty(shape, device="meta").stride()
        out[name] = DTensor.from_local(
            local.contiguous(), mesh, placements, run_check=False, shape=shape, stride=stride
        )
    return out


def _match(path: str, names: Sequence[str]) -> str | None:
    """The longest parameter name that `path` equals or ends with (at a '.' boundary)."""
    best = None
    for n in names:
        if (path == n or path.endswith("." + n)) and (best is None or len(n) > len(best)):
            best = n
    return best


def shard_state(
    state: TrainState | PyTree,
    mesh,
    rules: Sequence[Rule] | None = None,
    *,
    src_rank: int | None = 0,
) -> TrainState | PyTree:
    """Places a training state (or a bare params tree) on `mesh`: the ONE sharding entry point.

    Parameters get the placements of `rules`. Optimizer-state leaves that mirror a parameter (their
    tree path ends with the parameter's name and their shape equals its shape: Adam's mu/nu, the
    momentum trace, masked states keyed by name) get the same placements. Every other leaf (update
    counts, the step, the RNG key, the model state) stays a plain tensor, i.e. replicated: each rank
    holds the same value. With `mesh=None` (the plain single-process path) the state is returned unchanged.

    Args:
      state: a `TrainState`, or any params pytree.
      mesh: a DeviceMesh with named axes ("dp_replicate", "dp_shard", "cp", "tp"), or None.
      rules: sharding rules (default `FSDP_RULES`; GPT with TP: `default_rules(gpt.TP_RULES)`).
      src_rank: see `shard_params`.

    Returns:
      The same tree with DTensor leaves (full tensors are not kept), placed on
      `active_mesh(mesh)` (the axes of size > 1). It shares no buffer with `state` (replicated
      leaves are copied), so a donating step on either never changes the other.

    Example:
      >>> state = shard_state(init_state(model, opt), ctx.mesh, default_rules(gpt.TP_RULES))
    """
    if mesh is None:
        return state
    rules = FSDP_RULES if rules is None else rules
    mesh = active_mesh(mesh)
    if not isinstance(state, TrainState):
        named = list(tree_lib.named_leaves(state))
        placed = shard_params(named, mesh, rules, src_rank=src_rank)
        return optree.tree_unflatten(optree.tree_structure(state), list(placed.values()))
    named_params = list(tree_lib.named_leaves(state.params))
    params = shard_params(named_params, mesh, rules, src_rank=src_rank)
    shapes = {n: tuple(p.shape) for n, p in named_params}
    names = list(shapes)

    def place(path, leaf):
        n = _match(tree_lib.path_name(path), names)
        if n is None or tuple(leaf.shape) != shapes[n]:
            return leaf.clone()  # replicated; a copy, so the new state owns all its buffers
        return _distribute(leaf, mesh, params[n].placements, src_rank)

    opt_state = optree.tree_map_with_path(place, state.opt_state)
    spec = optree.tree_structure(state.params)
    return state._replace(
        params=optree.tree_unflatten(spec, list(params.values())),
        opt_state=opt_state,
        step=state.step.clone(),
        rng=state.rng.clone(),
        guard=type(state.guard)(*(torch.clone(t) for t in state.guard)),
        model_state=tree_lib.map(torch.clone, state.model_state),  # replicated: plain tensors on every rank
    )


def gather(tree: PyTree) -> PyTree:
    """Full, plain tensors for every DTensor leaf (a collective: call it on every rank).

    Args:
      tree: any pytree (a `TrainState`, a params dict, ...); plain leaves pass through.

    Returns:
      The same structure with plain tensors (each rank gets the whole values), e.g. for sampling,
      evaluation on rank 0 or saving safetensors.

    Example:
      >>> full_params = gather(state.params)
    """
    return tree_lib.map(lambda x: x.full_tensor() if isinstance(x, DTensor) else x, tree)
