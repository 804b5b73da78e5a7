"""The collectives of a sharded train/eval step (used by `functrain.step` when params are DTensors).

Internals: docs/internals.md "functrain.parallel.spmd".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from functrain import rng as rng_lib
from functrain import tree as tree_lib
from functrain.parallel import gloo
from functrain.parallel.collectives import all_gather, reduce_scatter, wait
from functrain.parallel.layout import Layout
from functrain.parallel.mesh import CP_AXIS, DP_AXES, GRAD_AXES, dp_coordinates

__all__ = ["Spmd", "global_norm", "mesh_of"]

PyTree = Any

ONE_BUCKET = 1 << 62
"""`Spmd`'s default `bucket_numel`: one bucket per (kind, axis, dtype). Smaller buckets (~one block each)
with inductor's `reorder_for_compute_comm_overlap` gave no measurable gain on 2 gloo CPU ranks
(bench/sharded.py --bucket-numel 1000000 --reorder)."""

ROUTES = ("auto", "reduce_scatter", "all_to_all", "all_reduce")
"""The values `Spmd`'s `reduce_scatter` takes."""


def mesh_of(params: PyTree):
    """The DeviceMesh of a params tree whose leaves are DTensors, or None for plain tensors.

    Args:
      params: the params pytree.

    Returns:
      The mesh shared by all leaves, or None when no leaf is a DTensor.

    Raises:
      ValueError: some leaves are DTensors and others are not, or they use different meshes.

    Example:
      >>> mesh_of(state.params)
    """
    leaves = tree_lib.leaves(params)
    kinds = {isinstance(x, DTensor) for x in leaves}
    if kinds != {True}:
        if True in kinds:
            raise ValueError("params mix DTensors and plain tensors: shard all of them (shard_state)")
        return None
    mesh = leaves[0].device_mesh
    if any(x.device_mesh != mesh for x in leaves):
        raise ValueError("params live on different DeviceMeshes; use one mesh for the whole state")
    return mesh


def _chunk(n: int, w: int) -> int:
    """Rows per rank when `n` rows are sharded over `w` ranks (torch.chunk: ceil)."""
    return -(-n // w)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` with zero rows appended up to `rows` rows."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


class Spmd(Layout):
    """The data-parallel/tensor-parallel bookkeeping of one mesh, as Python constants for tracing.

    Args:
      mesh: a DeviceMesh whose axis names include "dp_replicate"/"dp_shard" (data parallel) or "cp"
        (context parallel: its ranks see other tokens of the same sequences, so their parameters are
        gathered and their gradients averaged as on a data-parallel axis); any other axis (e.g.
        "tp") is model parallel: its placements are kept for compute.
      bucket_numel: the largest gradient/gather bucket in elements (global sizes); a leaf larger
        than it gets a bucket of its own.
      reduce_scatter: how gradients are reduce-scattered over dp_shard (module docstring):
        "reduce_scatter" (the backend's collective), "all_reduce" (the bucket all-reduced, this
        rank's row copied out: what gloo's reduce-scatter does inside, without its copy of the whole
        bucket), "all_to_all" (each rank's rows sent to their owners, then a local sum), or "auto":
        "all_reduce" where the mesh dim's group is gloo, "reduce_scatter" elsewhere (nccl's
        reduce-scatter moves half an all-reduce's bytes).

    Raises:
      ValueError: an unknown `reduce_scatter` route (one line).

    `functrain.parallel.configure(mesh, ...)` sets the options the params on `mesh` get from
    `layout_of` (a train step compiles once per layout).

    Example:
      >>> spmd = Spmd(mesh_of(state.params))
      >>> local = spmd.gather(state.params)
    """

    sharded = True

    def __init__(self, mesh, *, bucket_numel: int = ONE_BUCKET, reduce_scatter: str = "auto"):
        if reduce_scatter not in ROUTES:
            raise ValueError(f"reduce_scatter={reduce_scatter!r}: use one of {', '.join(map(repr, ROUTES))}")
        self.mesh = mesh
        self.bucket_numel, self.reduce_scatter = int(bucket_numel), reduce_scatter
        names = mesh.mesh_dim_names or ()
        # Data- and context-parallel axes with more than one rank: gathered for compute, grads averaged
        # (a context-parallel loss is scaled so that this average is the whole sequence's gradient).
        self.dp_dims = [i for i, n in enumerate(names) if n in GRAD_AXES and mesh.size(i) > 1]
        self.dp_rank, self.dp_world = dp_coordinates(mesh)
        self.cp_dim = names.index(CP_AXIS) if CP_AXIS in names else None  # the mesh dim of cp, if any
        self.cp_rank: int = mesh.get_local_rank(CP_AXIS) if self.cp_dim is not None else 0
        self.cp_world: int = mesh.size(self.cp_dim) if self.cp_dim is not None else 1
        # read by the "auto" route; on a CUDA mesh the groups' gloo half never sees a gradient
        self._gloo = {d: mesh.device_type == "cpu" and gloo.is_gloo(mesh.get_group(d)) for d in self.dp_dims}

    def _route(self, gloo: bool) -> str:
        """The reduce-scatter route for a group (gloo or not), "auto" resolved."""
        if self.reduce_scatter == "auto":
            return "all_reduce" if gloo else "reduce_scatter"
        return self.reduce_scatter

    def _kind(self, p: DTensor):
        """("fsdp", dim) for Shard(0) on one dp dim, ("ddp", None) for Replicate on all, else None."""
        on_dp = [(d, p.placements[d]) for d in self.dp_dims]
        shards = [d for d, pl in on_dp if isinstance(pl, Shard)]
        if not shards and all(isinstance(pl, Replicate) for _, pl in on_dp):
            return ("ddp", None)
        if (
            len(shards) == 1
            and p.placements[shards[0]] == Shard(0)
            and p.ndim > 0
            and not any(p.placements[i] == Shard(0) for i in range(self.mesh.ndim) if i != shards[0])
            and all(isinstance(pl, Replicate) for d, pl in on_dp if d != shards[0])
        ):
            return ("fsdp", shards[0])
        return None

    def _compute_placements(self, placements):
        """Placements of the compute copy: Replicate on the dp axes, unchanged elsewhere."""
        return [Replicate() if i in self.dp_dims else p for i, p in enumerate(placements)]

    def _buckets(self, ps: list):
        """{(kind, dim, dtype, n): [leaf index]} for the bucketable leaves (in leaf order, at most
        `bucket_numel` elements per bucket unless one leaf is larger), and the other indices."""
        buckets: dict = {}
        other = []
        fill: dict = {}  # (kind, dim, dtype) -> (bucket number, elements in it)
        for i, p in enumerate(ps):
            kind = self._kind(p)
            if kind is None:
                other.append(i)
                continue
            key = (*kind, p.dtype)
            n, used = fill.get(key, (0, 0))
            if used and used + p.numel() > self.bucket_numel:
                n, used = n + 1, 0
            fill[key] = (n, used + p.numel())
            buckets.setdefault((*key, n), []).append(i)
        return buckets, other

    def gather(self, params: PyTree, rows: tuple[str, ...] = ()) -> PyTree:
        """Plain local tensors to compute with: all-gathered on dp, this rank's slice on tp; the
        position tables named in `rows` (keys of the `params` dict) stay this rank's rows on cp."""
        return self.gather_start(params, rows)()

    def gather_start(self, params: PyTree, rows: tuple[str, ...] = ()):
        """Starts `gather(params, rows)`'s all-gathers; returns a function that waits and gives the result.

        Eagerly the collectives run in the background until that function is called (compiled,
        it is `gather` in two halves). Lets an eager stage loop gather the next stage while the
        current one computes (`functrain.step.staged`, compile="blocks").
        """
        kept = self._rows_on_cp(params, rows)
        if kept:
            others = self.gather_start({n: p for n, p in params.items() if n not in kept})
            local = {n: self._cp_rows(params[n]) for n in kept}

            def merged() -> PyTree:
                """The gathered params and the position tables' rows, in `params`' order."""
                rest = others()
                return {n: local[n] if n in local else rest[n] for n in params}

            return merged
        ps, spec = tree_lib.flatten(params)
        out: list = [None] * len(ps)
        buckets, other = self._buckets(ps)
        pending = []  # (leaf indices, local shards, rows per rank, ranks, started all-gather)
        for (kind, dim, _, _), idx in buckets.items():
            if kind == "ddp":
                for i in idx:
                    out[i] = ps[i].to_local()
                continue
            w = self.mesh.size(dim)
            locs = [ps[i].to_local() for i in idx]
            chunks = [_chunk(ps[i].shape[0], w) for i in idx]
            flat = torch.cat([_pad_rows(x, c).reshape(-1) for x, c in zip(locs, chunks)])  # (S,)
            pending.append((idx, locs, chunks, w, all_gather(flat, 0, (self.mesh, dim))))
        for i in other:
            p = ps[i]
            out[i] = p.redistribute(self.mesh, self._compute_placements(p.placements)).to_local()

        def finish() -> PyTree:
            """The gathered tensors (waits for the all-gathers)."""
            for idx, locs, chunks, w, started in pending:
                full = wait(started).view(w, -1)  # (w, S)
                off = 0
                for i, x, c in zip(idx, locs, chunks):
                    size = c * _row_numel(x)
                    rows = full[:, off : off + size].reshape(w * c, *x.shape[1:])  # (w c, ...)
                    out[i] = rows[: ps[i].shape[0]]
                    off += size
            return spec.unflatten(out)

        return finish

    def _rows_on_cp(self, params: PyTree, rows: tuple[str, ...]) -> tuple[str, ...]:
        """The names in `rows` that stay row-sharded over cp: with a cp axis of several ranks, dict
        params, and no model-parallel axis cutting the table's rows."""
        if not rows or self.cp_world == 1 or not isinstance(params, dict):
            return ()
        return tuple(
            n
            for n in rows
            if n in params
            and not any(pl == Shard(0) for d, pl in enumerate(params[n].placements) if d not in self.dp_dims)
        )

    def _rows_placements(self, p: DTensor) -> list:
        """A position table's compute placements: `Shard(0)` on cp, Replicate on the other dp axes."""
        return [Shard(0) if d == self.cp_dim else pl for d, pl in enumerate(self._compute_placements(p.placements))]

    def _cp_rows(self, p: DTensor) -> torch.Tensor:
        """This rank's rows of a position table on cp, whole on the other dp axes (`position_rows` reads them)."""
        return p.redistribute(self.mesh, self._rows_placements(p)).to_local()

    def reduce_grads(self, grads: PyTree, params: PyTree, rows: tuple[str, ...] = ()) -> PyTree:
        """Averages local grads over the dp ranks into the params' placements (reduce-scatter); the
        gradients of the position tables in `rows` (`gather`) arrive summed over cp on their rows."""
        kept = self._rows_on_cp(params, rows)
        if kept:
            done = self.reduce_grads(
                {n: g for n, g in grads.items() if n not in kept}, {n: p for n, p in params.items() if n not in kept}
            )
            for n in kept:
                p = params[n]
                # averaged over the dp axes but cp, where `position_rows` summed them already
                src = [
                    Partial("avg") if d in self.dp_dims and d != self.cp_dim else pl
                    for d, pl in enumerate(self._rows_placements(p))
                ]
                cp_sum = DTensor.from_local(
                    grads[n] / self.cp_world, self.mesh, src, run_check=False, shape=p.shape, stride=p.stride()
                )
                done[n] = cp_sum.redistribute(self.mesh, p.placements)
            return {n: done[n] for n in grads}
        ps, spec = tree_lib.flatten(params)
        gs = spec.flatten_up_to(grads)
        out: list = [None] * len(ps)
        buckets, other = self._buckets(ps)
        scale = 1.0 / max(1, _prod(self.mesh.size(d) for d in self.dp_dims))
        for (kind, dim, _, _), idx in buckets.items():
            if kind == "ddp" and not self.dp_dims:  # nothing to average (tp only, 1 device)
                for i in idx:
                    out[i] = self._wrap(gs[i], ps[i])
                continue
            if kind == "ddp":
                flat = torch.cat([gs[i].reshape(-1) for i in idx])
                flat = self._all_reduce(flat, self.dp_dims) * scale
                off = 0
                for i in idx:
                    n = gs[i].numel()
                    out[i] = self._wrap(flat[off : off + n].view(gs[i].shape), ps[i])
                    off += n
                continue
            w = self.mesh.size(dim)
            r = self.mesh.get_local_rank(dim)
            chunks = [_chunk(ps[i].shape[0], w) for i in idx]
            parts = [_pad_rows(gs[i], w * c).reshape(w, -1) for i, c in zip(idx, chunks)]  # (w, n_i)
            mine = self._reduce_scatter(parts, dim, r)  # (S,)
            mine = self._all_reduce(mine, [d for d in self.dp_dims if d != dim]) * scale
            off = 0
            for i, c in zip(idx, chunks):
                g = gs[i]
                size = c * _row_numel(g)
                held = max(0, min(c, ps[i].shape[0] - r * c))  # this rank's rows (torch.chunk)
                out[i] = self._wrap(mine[off : off + size].view(c, *g.shape[1:])[:held], ps[i])
                off += size
        for i in other:
            p = ps[i]
            src = [Partial("avg") if d in self.dp_dims else pl for d, pl in enumerate(p.placements)]
            d = DTensor.from_local(gs[i], self.mesh, src, run_check=False, shape=p.shape, stride=p.stride())
            out[i] = d.redistribute(self.mesh, p.placements)
        return spec.unflatten(out)

    def _reduce_scatter(self, parts: list, dim: int, r: int) -> torch.Tensor:
        """Row r of the (w, n_i) `parts`, concatenated and summed over the ranks of mesh dim `dim`
        (this rank is r there): (S,), S = sum n_i."""
        route = self._route(self._gloo.get(dim, False))
        if route != "all_to_all":
            buf = torch.cat(parts, dim=1)  # (w, S): row j holds every param's chunk for rank j
            if route == "all_reduce":
                full = wait(funcol.all_reduce(buf.reshape(-1), "sum", (self.mesh, dim)))
                return full.view(buf.shape)[r].clone()  # (S,): a copy, so the (w, S) sum can go
            return wait(reduce_scatter(buf.reshape(-1), "sum", 0, (self.mesh, dim)))
        w = parts[0].shape[0]
        # send row j to rank j, keep row r: the buffers of a reduce-scatter, S each, no more
        own = torch.cat([p[r] for p in parts])  # (S,)
        send = torch.cat([p[j] for j in range(w) if j != r for p in parts])  # ((w-1) S,)
        n = own.numel()
        splits = [0 if j == r else n for j in range(w)]
        got = wait(funcol.all_to_all_single(send, splits, splits, (self.mesh, dim)))  # ((w-1) S,)
        return own + got.view(w - 1, n).sum(0)  # rank order after own: a + b on 2 ranks

    def _all_reduce(self, x: torch.Tensor, dims) -> torch.Tensor:
        """Sum of `x` over the mesh dims `dims`, one after the other."""
        for d in dims:
            x = wait(funcol.all_reduce(x, "sum", (self.mesh, d)))
        return x

    def _wrap(self, local: torch.Tensor, like: DTensor) -> DTensor:
        """`local` as a DTensor with `like`'s mesh, placements, shape and stride."""
        return DTensor.from_local(
            local, self.mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
        )

    def mean_over_dp(self, metrics: dict) -> dict:
        """Averages a dict of scalar tensors over the dp ranks (one collective for all of them)."""
        if not self.dp_dims or not metrics:
            return metrics
        keys = list(metrics)
        vals = [torch.as_tensor(metrics[k]) for k in keys]
        stacked = torch.stack([v.detach().float().reshape(()) for v in vals])  # (M,)
        mean = self._all_reduce(stacked, self.dp_dims) / _prod(self.mesh.size(d) for d in self.dp_dims)
        return {k: mean[i].to(v.dtype) for i, (k, v) in enumerate(zip(keys, vals))}

    def sum_over_dp(self, x: torch.Tensor) -> torch.Tensor:
        """`Layout.sum_over_dp`: one all-reduce per data-parallel mesh dim (cp ranks hold the same rows)."""
        names = self.mesh.mesh_dim_names or ()
        return self._all_reduce(x, [d for d in self.dp_dims if names[d] in DP_AXES])

    def token_weights(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`Layout.token_weights`: the count summed over the dp and cp axes (one all-reduce of a scalar). Every
        cp rank counts the whole sequences (a context-parallel loss keeps its own tokens and scales its mean
        to the sequence's, `context.Split.token_mean`), so the step's count is that sum over cp_world."""
        if not self.dp_dims:
            return super().token_weights(counts)
        with torch.no_grad():  # a count: nothing to differentiate
            total = self._all_reduce(counts.sum(), self.dp_dims)
        ranks = _prod(self.mesh.size(d) for d in self.dp_dims)
        return counts * (ranks / total.clamp(min=1)), total / self.cp_world

    def fold_in_dp(self, key: torch.Tensor) -> torch.Tensor:
        """Folds the dp and cp coordinates into a key, so ranks holding other tokens draw other masks."""
        if self.dp_world * self.cp_world == 1:
            return key
        return rng_lib.fold_in(key, self.dp_rank * self.cp_world + self.cp_rank)

    def global_norm(self, tree: PyTree, *, fused: bool = False) -> torch.Tensor:
        """The norm over the whole mesh (see `global_norm`)."""
        return global_norm(tree_lib.leaves(tree), fused=fused)

    def select(self, ok: torch.Tensor, new: PyTree, old: PyTree) -> PyTree:
        """Leafwise `new if ok else old` on the local shards, in `old`'s placements."""
        old_leaves, spec = tree_lib.flatten(old)
        out = []
        for o, n in zip(old_leaves, spec.flatten_up_to(new)):
            if n is o:
                out.append(o)
            elif isinstance(o, DTensor):
                local = torch.where(ok, _local(n, like=o), o.to_local())
                out.append(
                    DTensor.from_local(
                        local, o.device_mesh, o.placements, run_check=False, shape=o.shape, stride=o.stride()
                    )
                )
            else:
                out.append(torch.where(ok, n, o))
        return spec.unflatten(out)

    def local_model_state(self, model_state: PyTree) -> PyTree:
        """Plain tensors of the (replicated) model state."""
        return tree_lib.map(lambda x: x.to_local() if isinstance(x, DTensor) else x, model_state)

    def sync_model_state(self, model_state: PyTree, how: str) -> PyTree:
        """Rank 0's model state ("broadcast") or the floating leaves' mean ("mean") on every dp rank:
        one all-reduce over the dp axes per leaf (the buffers are small)."""
        if not self.dp_dims:
            return model_state
        first = all(self.mesh.get_local_rank(d) == 0 for d in self.dp_dims)
        world = _prod(self.mesh.size(d) for d in self.dp_dims)

        def sync(x: torch.Tensor) -> torch.Tensor:
            if how == "mean":
                if not x.is_floating_point():  # counters: every rank counted the same steps
                    return x
                return self._all_reduce(x, self.dp_dims) / world
            return self._all_reduce(x if first else torch.zeros_like(x), self.dp_dims)  # rank 0's, exactly

        return tree_lib.map(sync, model_state)

    def write_into(self, old: PyTree, new: PyTree) -> PyTree:
        """Copies the local shard of every leaf of `new` into `old`'s (donation); returns `old`."""
        pairs = tree_lib.copy_pairs(old, new)
        if pairs:
            torch._foreach_copy_([_local(o) for o, _ in pairs], [_local(n, like=o) for o, n in pairs])
        return old


def _local(x, like=None):
    """The local shard of a DTensor (in `like`'s placements), or `x` itself for a plain tensor."""
    if not isinstance(x, DTensor):
        return x
    if like is not None and tuple(x.placements) != tuple(like.placements):
        x = x.redistribute(like.device_mesh, like.placements)
    return x.to_local()


def global_norm(xs: list, *, fused: bool = False) -> torch.Tensor:
    """L2 norm of DTensors taken together, over the whole mesh, with few collectives.

    Each leaf's squared local norm counts once per distinct shard: the squares are summed per
    group of leaves sharded on the same mesh dims, and each group is all-reduced over those dims
    only (replicated dims hold copies). One all-reduce per (group, dim) instead of one per leaf.

    Args:
      xs: a list of DTensors (Shard/Replicate placements; Partial ones are reduced first).
      fused: see `functrain.tree.squared_norms`.

    Returns:
      A 0-d float32 plain tensor, the same on every rank.

    Example:
      >>> gnorm = global_norm(tree.leaves(grads))
    """
    xs = [_no_partial(x) for x in xs]
    squares = tree_lib.squared_norms([x.to_local() for x in xs], fused=fused)
    groups: dict = {}
    for x, n in zip(xs, squares):
        dims = tuple(d for d, p in enumerate(x.placements) if isinstance(p, Shard))
        groups.setdefault((x.device_mesh, dims), []).append(n)
    total = None
    for (mesh, dims), ns in groups.items():
        sq = torch.stack(ns).sum()
        for d in dims:
            sq = wait(funcol.all_reduce(sq, "sum", (mesh, d)))
        total = sq if total is None else total + sq
    if total is None:  # no tensors
        return torch.zeros((), dtype=torch.float32)
    return total.sqrt().to(torch.float32)


tree_lib.register_global_norm(DTensor, global_norm)  # tree.global_norm on DTensor leaves lands here


def _no_partial(x: DTensor) -> DTensor:
    """`x` with any Partial placement reduced to Replicate."""
    if not any(p.is_partial() for p in x.placements):
        return x
    return x.redistribute(x.device_mesh, [Replicate() if p.is_partial() else p for p in x.placements])


def _row_numel(x: torch.Tensor) -> int:
    """Elements per dim-0 row of `x`."""
    n = 1
    for s in x.shape[1:]:
        n *= s
    return n


def _prod(xs) -> int:
    """Product of ints."""
    out = 1
    for x in xs:
        out *= x
    return out
