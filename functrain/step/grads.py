"""The loss's gradients: one batch's value and grad, the one microbatch accumulator, the forward graph.

The accumulator (`Microbatches`) cuts a step's batch into microbatches, keys and weighs them and sums what
they give; every route runs through it: the one-graph step's traced loop and torch's scan
(`accumulated_value_and_grad`), the forward graph's eager loop (`grads_by_autograd`: the loss's forward one
compiled graph, its gradients by autograd, as `torch.compile(model)` trains) and the pipeline's schedule.
Internals: docs/internals.md "functrain.step.grads".

Example:
    >>> loss, aux, grads = value_and_grad(loss_fn, params, batch, key)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

import functrain.metric_names as M
import functrain.step.precision as precision_lib
from functrain import compiler
from functrain import rng as rng_lib
from functrain import tree as tree_lib
from functrain.nn import randomness
from functrain.nn.model_state import call_loss, has_model_state, restore_dtypes
from functrain.parallel.layout import Layout
from functrain.state import TrainState
from functrain.step.staged import StagedLoss

__all__ = [
    "ForwardGraph",
    "GradPlan",
    "Microbatches",
    "accumulated_value_and_grad",
    "by_position",
    "compute_model_state",
    "forward_loss",
    "grads_by_autograd",
    "scaled_loss",
    "split_microbatches",
    "step_key",
    "value_and_grad",
    "with_frozen",
]

PyTree = Any
LossFn = Callable[[PyTree, PyTree, "torch.Tensor | None"], "tuple[torch.Tensor, dict]"]


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


class GradPlan(NamedTuple):
    """What `grads_by_autograd` needs of the train step's arguments.

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


def forward_loss(  # noqa: PLR0913
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
      >>> scaled, aux, _ = forward_loss(loss_fn, prec, LOCAL, params, {}, batch, key, None, {})
    """
    params, batch = precision_lib.to_compute(prec, params, batch)
    frozen, _ = precision_lib.to_compute(prec, frozen, None)
    model_state = compute_model_state(model_state, lay, prec)
    scaled, loss, aux, new_state = scaled_loss(with_frozen(loss_fn, frozen), params, batch, key, model_state, factor)
    metrics: Any = {M.LOSS: loss, **aux}
    detached: Any = tree_lib.map(lambda a: a.detach() if torch.is_tensor(a) else a, metrics)
    return scaled, detached, tree_lib.map(torch.Tensor.detach, new_state)


class ForwardGraph:
    """`forward_loss` compiled, its first call preceded by one eager call without gradients.

    A forward that writes into a template's buffer which the model state does not carry is refused by
    `functrain.apply`'s eager check (its trace cannot see the write, and would apply it to the template
    at every step): the eager call raises that one line before anything is compiled.

    Args:
      fn: `forward_loss` with its first three arguments bound.
      compiled: `fn` compiled (e.g. `compiler.maybe_compile(fn, True, options)`).

    Example:
      >>> fwd = ForwardGraph(fn, compiler.maybe_compile(fn, True, None))
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


def grads_by_autograd(forward_fn: Callable, plan: GradPlan, lay: Layout, state: TrainState, batch: PyTree):
    """`(aux, grads, model state)` of the step's batch: each microbatch through `forward_fn`, its gradients by
    autograd, summed in float32 over the microbatches (their mean, or weighted by their target counts).

    Args:
      forward_fn: `forward_loss` with its first three arguments bound, compiled.
      plan: the step's `GradPlan`.
      lay: the params' layout (`parallel.LOCAL`).
      state: the `TrainState` (its params are not modified).
      batch: the step's batch (dim 0 divides into `plan.accum_steps` microbatches).

    Returns:
      `(aux, grads, model_state)` as the one-graph step's loss half gives them: the aux averaged (or
      weighted) over microbatches, grads shaped like the params (in the compute dtype's float32 sum when
      accumulating), the model state after the last microbatch made one over the ranks.

    Example:
      >>> aux, grads, model_state = grads_by_autograd(forward_fn, plan, LOCAL, state, batch)
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
