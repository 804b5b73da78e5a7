"""The one microbatch accumulator: a step's batch cut into microbatches, and the sum of what they give.

Every route runs its microbatches through it: the one-graph step's traced loop, the forward graph's
eager loop, torch's scan (`stacked`) and the pipeline's schedule.

Example:
    >>> mbs = Microbatches(batch, key, 4, LOCAL, count_targets=None, loss_scale=None)
    >>> for i, (mb, k) in enumerate(mbs):
    ...     aux, grads = one(mb, k, mbs.factor(i))       # grads shaped like params
    ...     mbs.add(i, aux, by_position(grads))
    >>> aux, grads = mbs.result(params)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

import functrain.step.metric_names as M
from functrain import rng as rng_lib
from functrain import tree as tree_lib

__all__ = ["Microbatches", "by_position", "split_microbatches", "step_key"]

PyTree = Any


def step_key(state, lay) -> torch.Tensor:
    """This step's key on this data-parallel rank: `state.rng` folded with the step, then with the dp rank.

    Args:
      state: the `TrainState` (its `rng` and `step`).
      lay: the params' `functrain.parallel.Layout` (`fold_in_dp`).

    Returns:
      The key the step's microbatches draw from.

    Example:
      >>> mbs = Microbatches(batch, step_key(state, lay), 4, lay, count_targets=None, loss_scale=None)
    """
    return lay.fold_in_dp(rng_lib.fold_in(state.rng, state.step))


def split_microbatches(batch: PyTree, k: int, what: str = "accum_steps") -> PyTree:
    """Every batch leaf (B, ...) reshaped to (k, B // k, ...): the microbatches of accumulation and of
    pipeline stages.

    Args:
      batch: a pytree of tensors sharing dim 0.
      k: the number of microbatches.
      what: the config key that set `k`, for the error.

    Returns:
      The same tree, each leaf (k, B // k, ...).

    Raises:
      ValueError: B is not divisible by k (one line naming `what`).

    Example:
      >>> split_microbatches((x, y), 4)[0].shape   # x: (32, T)
      torch.Size([4, 8, T])
    """

    def split(x):
        if x.shape[0] % k:
            raise ValueError(
                f"batch dimension {x.shape[0]} is not divisible by {what}={k}; make the batch size a multiple of {what}"
            )
        return x.reshape(k, x.shape[0] // k, *x.shape[1:])  # (K, B/K, ...)

    return tree_lib.map(split, batch)


class Microbatches:
    """A step's batch as `k` microbatches, each with its key and its loss factor, summing what they give.

    The gradients are summed in float32 when `k > 1` (in the compute dtype otherwise) and the metrics with
    them; `result` gives their mean, or, with `count_targets`, their sum weighted by each microbatch's
    share of the step's targets over every data-parallel rank (`Layout.token_weights`): the mean over every
    target token, whatever `k` and the number of ranks.

    Args:
      batch: the step's batch (dim 0 divides by `k`).
      key: the step's RNG key; microbatch i draws from `rng.split(key, k)[i]` (the key itself when `k == 1`),
        or None (an eval step's: no key).
      k: the number of microbatches.
      lay: the params' layout (its `token_weights` sums the counts over the ranks).
      count_targets: `batch -> target count`, or None (every microbatch weighs the same).
      loss_scale: the fp16 loss scale (a 0-d tensor), or None.
      what: the config key that set `k`, for the error on a batch it does not divide.

    Example:
      >>> mbs = Microbatches(batch, key, 2, LOCAL, count_targets=None, loss_scale=None)
      >>> [mb["x"].shape[0] for mb, _ in mbs]   # batch["x"]: (8, T)
      [4, 4]
    """

    def __init__(
        self, batch: PyTree, key, k: int, lay, *, count_targets: Callable | None, loss_scale, what: str = "accum_steps"
    ):
        self.k, self.loss_scale = k, loss_scale
        stacked: Any = split_microbatches(batch, k, what) if k > 1 else None  # (K, B/K, ...) each leaf
        self.stacked = stacked
        self.batches = [batch] if k == 1 else [tree_lib.map(lambda x, i=i: x[i], stacked) for i in range(k)]
        self.keys: Any = rng_lib.split(key, k) if k > 1 and key is not None else [key] * k  # (K, 2)
        self.weights = self.total = None
        if count_targets is not None:  # counted before the forward, over every microbatch and rank
            counts = [torch.as_tensor(count_targets(mb)).to(torch.float32).reshape(()) for mb in self.batches]
            self.weights, self.total = lay.token_weights(torch.stack(counts))
        self._grads: dict = {}
        self._metrics: Any = None

    def __iter__(self) -> Iterator[tuple[PyTree, Any]]:
        return iter(zip(self.batches, self.keys))

    def weight(self, i: int):
        """Microbatch `i`'s weight (a 0-d tensor), or None when every one weighs the same."""
        return None if self.weights is None else self.weights[i]

    def factor(self, i: int):
        """What microbatch `i`'s loss is multiplied by before its backward (loss scale times weight), or None."""
        return self.scaled(self.weight(i))

    def scaled(self, w):
        """The loss scale times `w` (a weight, or None), or None when neither is there."""
        if w is None or self.loss_scale is None:
            return self.loss_scale if w is None else w
        return self.loss_scale * w

    def add(self, i: int, metrics: PyTree, grads: dict) -> None:
        """Adds microbatch `i`'s metrics (weighted) and gradients (`{name or position: tensor}`; absent: zero)."""
        w = self.weight(i)
        if w is not None:
            metrics = tree_lib.map(lambda a: a * w, metrics)
        self._metrics = metrics if self._metrics is None else tree_lib.map(torch.add, self._metrics, metrics)
        self.add_grads(grads)

    def add_grads(self, grads: dict) -> None:
        """Adds gradients by name (a pipeline stage's share of them; `add` takes the metrics too)."""
        for n, g in grads.items():
            g = g.float() if self.k > 1 else g
            self._grads[n] = g if n not in self._grads else self._grads[n] + g

    def add_sums(self, metrics: dict, grads: dict) -> None:
        """Adds every microbatch's metrics and gradients at once, weighted and summed already (scan's carry)."""
        self._metrics = metrics
        self.add_grads(grads)

    def mean(self, x):
        """`x` (a tensor or a tree) summed over microbatches, made their mean where unweighted."""
        if self.weights is not None or self.k == 1:  # weighted already: the sum is the mean over every target
            return x
        return tree_lib.map(lambda a: a * (1.0 / self.k), x)

    def metrics(self) -> dict:
        """The metrics' mean (or weighted sum), with the step's target count when counted."""
        out = dict(self.mean(self._metrics))
        if self.total is not None:
            out[M.TARGETS] = self.total  # the same on every rank: its mean over them is itself
        return out

    def grads(self, like: dict) -> dict:
        """The gradients' mean (or weighted sum) for every key of `like`, zeros where none was added."""
        return {n: self.mean(self._grads[n]) if n in self._grads else torch.zeros_like(p) for n, p in like.items()}

    def result(self, params: PyTree) -> tuple[dict, PyTree]:
        """`(metrics, grads)` with the grads shaped like the pytree `params` (added by leaf position)."""
        leaves, spec = tree_lib.flatten(params)
        grads = self.grads(dict(enumerate(leaves)))
        return self.metrics(), spec.unflatten([grads[i] for i in range(len(leaves))])


def by_position(grads: PyTree) -> dict:
    """A gradient tree's leaves keyed by position (what `Microbatches.result` unflattens)."""
    return dict(enumerate(tree_lib.leaves(grads)))
