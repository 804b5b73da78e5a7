"""Where the parameters live, as one interface the train step calls the same way on 1 or N processes.

Internals: docs/internals.md "functrain.parallel.layout".

Example:
    >>> lay = layout_of(state.params)
    >>> params = lay.gather(state.params)            # what the forward computes with
    >>> grads = lay.reduce_grads(grads, state.params)  # back to the params' placements
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from functrain import tree as tree_lib
from functrain.ops import foreach

__all__ = ["Layout", "Local", "LOCAL", "is_dtensor"]

PyTree = Any


def is_dtensor(x) -> bool:
    """Whether `x` is a DTensor (without importing DTensor: none can exist unless it was)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(x, dtensor.DTensor)


class Layout:
    """What the train step needs to know about where the params live (see the module docstring).

    Attributes:
      dp_rank, dp_world: this process's data-parallel index and the number of dp replicas.
      sharded: True for DTensor params (`gather` communicates), False for plain ones.
    """

    dp_rank: int = 0
    dp_world: int = 1
    sharded: bool = False  # whether `gather` does any communication (a loss may then gather per stage)

    def gather(self, params: PyTree, rows: tuple[str, ...] = ()) -> PyTree:
        """Plain tensors to compute with (all-gathered over the dp axes when sharded). `rows` names
        position tables (`functrain.step.staged.Stage.rows`) a layout may hand over as this rank's rows on
        the cp axis instead (`functrain.parallel.context.position_rows` reads either)."""
        raise NotImplementedError

    def gather_start(self, params: PyTree, rows: tuple[str, ...] = ()):
        """`gather` in two halves: starts it, returns a function that waits and gives the result."""
        gathered = self.gather(params, rows)
        return lambda: gathered

    def reduce_grads(self, grads: PyTree, params: PyTree, rows: tuple[str, ...] = ()) -> PyTree:
        """Gradients of the computed tensors (of what `gather(params, rows)` gave), averaged over dp
        ranks, in the params' placements."""
        raise NotImplementedError

    def mean_over_dp(self, metrics: dict) -> dict:
        """Scalar metrics averaged over the dp ranks."""
        raise NotImplementedError

    def sum_over_dp(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the data-parallel ranks (dp_replicate, dp_shard; not cp, whose ranks share
        rows): each rank's rows of a split workload, filled in where the others hold zeros, made whole."""
        raise NotImplementedError

    def fold_in_dp(self, key: torch.Tensor) -> torch.Tensor:
        """A key that differs per dp rank (dropout masks must), the same on tp ranks."""
        raise NotImplementedError

    def token_weights(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, total) of this rank's microbatches' target counts (K,): `total` sums them over every
        rank whose gradients are averaged, `weights[k] = counts[k] * ranks / total` (0 when total is 0),
        so the average over those ranks of `sum_k weights[k] * mean_loss_k` is the mean over every target."""
        total = counts.sum()
        return counts / total.clamp(min=1), total

    def global_norm(self, tree: PyTree, *, fused: bool = False) -> torch.Tensor:
        """The L2 norm of all leaves over the whole mesh (see `functrain.tree.global_norm`)."""
        return tree_lib.global_norm(tree, fused=fused)

    def select(self, ok: torch.Tensor, new: PyTree, old: PyTree) -> PyTree:
        """Leafwise `new if ok else old` (a 0-d bool, no host sync), in `old`'s placements."""
        raise NotImplementedError

    def write_into(self, old: PyTree, new: PyTree) -> PyTree:
        """Copies every leaf of `new` into the matching leaf of `old` (donation); returns `old`."""
        raise NotImplementedError

    def local_model_state(self, model_state: PyTree) -> PyTree:
        """The model state as plain tensors to compute with (it is replicated: every rank holds it whole)."""
        return model_state

    def sync_model_state(self, model_state: PyTree, how: str) -> PyTree:
        """The model state each rank updated from its own rows, made one again over the dp ranks:
        "broadcast" keeps dp rank 0's, "mean" averages the floating leaves (identity on one process)."""
        return model_state


class Local(Layout):
    """Plain tensors on one process: nothing to gather, reduce or average."""

    def gather(self, params, rows=()):
        return params

    def reduce_grads(self, grads, params, rows=()):
        return grads

    def mean_over_dp(self, metrics):
        return metrics

    def sum_over_dp(self, x):
        return x

    def fold_in_dp(self, key):
        return key

    def select(self, ok, new, old):
        old_leaves, spec = tree_lib.flatten(old)
        out = [o if n is o else torch.where(ok, n, o) for o, n in zip(old_leaves, spec.flatten_up_to(new))]
        return spec.unflatten(out)

    def write_into(self, old, new):
        pairs = tree_lib.copy_pairs(old, new)
        if pairs:
            foreach.copy_([o for o, _ in pairs], [n for _, n in pairs])
        return old


LOCAL = Local()
