"""Pure train and eval steps: `step(state, batch) -> (state, metrics)`, compiled by `torch.compile`.

Internals: docs/internals.md "functrain.step.steps".

Example:
    >>> def loss_fn(params, batch, key):
    ...     logits = functrain.apply(model, params, batch["x"], dropout_key=key)
    ...     return gpt.cross_entropy(logits, batch["y"]), {}
    >>> step = make_train_step(loss_fn, optim.adamw(3e-4))
    >>> state, metrics = step(state, batch)
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

import functrain.step.forward_graph as forward_graph
import functrain.step.metric_names as M
import functrain.step.precision as precision_lib
import functrain.step.update_groups as update_groups
from functrain import compiler, optim
from functrain import rng as rng_lib
from functrain.nn import mode as mode_lib
from functrain.nn import randomness
from functrain.nn.model_state import call_loss, check_loss, has_model_state, restore_dtypes
from functrain.parallel.dispatch import layout_of
from functrain.parallel.layout import Layout
from functrain.state import TrainState
from functrain.step.forward_graph import compute_model_state
from functrain.step.grads import (
    LossFn,
    PyTree,
    accumulated_value_and_grad,
    value_and_grad,
    with_frozen,
)
from functrain.step.loss_contract import loss_and_aux
from functrain.step.microbatches import Microbatches
from functrain.step.staged import StagedLoss
from functrain.step.update import apply_gradients, fused_in_place, make_update, to_master, update_step

__all__ = [
    "apply_gradients",
    "loss_and_aux",
    "make_train_step",
    "make_eval_step",
    "update_step",
    "value_and_grad",
    "with_frozen",
]


def make_train_step(
    loss_fn: LossFn,
    optimizer: optim.Transform,
    *,
    accum_steps: int = 1,
    compile: bool | str = True,
    donate: bool = True,
    accum_impl: str = "unroll",
    precision: str | torch.dtype | precision_lib.Precision | None = None,
    skip_nonfinite: bool = True,
    compile_options: dict | None = None,
    layout: Layout | None = None,
    fullgraph: bool = True,
    model_state_sync: str = "broadcast",
    count_targets: Callable[[PyTree], torch.Tensor] | None = None,
) -> Callable[[TrainState, PyTree], tuple[TrainState, dict]]:
    """Builds `step(state, batch) -> (new_state, metrics)`.

    Args:
      loss_fn: `(params, batch, key) -> (loss, aux)`: a scalar loss and a dict of scalar tensors
        to report. `key` is this step's (and microbatch's) RNG key, for dropout.
      optimizer: a `functrain.optim.Transform` (e.g. `optim.adamw(...)`).
      accum_steps: split the batch into this many microbatches and average their gradients
        inside the one call (the batch dimension must divide by it).
      compile: True (or "step"): compiled with `torch.compile(fullgraph=True)`: on one process the
        loss's forward is one graph, its backward AOTAutograd's (the gradients by autograd between
        them, as `torch.compile(model)` trains; `functrain.step.forward_graph`), and the update runs
        after it: through the optimizer's fused kernel when it has one (`optim.adamw(..., fused=True)`:
        1 graph in all), else group by group, the params' alike numbered blocks sharing one graph of
        the grads' squared norms and one update graph (`functrain.step.update_groups.blocks_by_name`),
        the other params one of each, the grad norm one more: 6 graphs at any depth, the numbers of
        the whole step compiled as one graph bit for bit (2: the loss and the whole update, without two
        alike blocks or for an optimizer that is not leafwise or a model with model state). A staged
        loss and `accum_impl="scan"` take the loss and its gradients as one graph. Sharded params,
        CUDA graphs and `fullgraph=False` compile the whole step as one graph.
        "blocks": for a staged loss (`functrain.step.staged.staged_loss`, e.g. `gpt.make_loss_fn(...,
        staged=True)`): each stage kind is its own graph, every block running the same one, so
        neither the number of graphs nor the cold compile grows with depth (README "Compile
        unit"); graphs: the step's prepare (cast, key), the embedding, the block (a second one
        for a recomputed block's no-grad forward), the head (see `step.staged.staged_loss`'s
        `compile_stages`), and the optimizer update block by block: one graph for every block, one
        for the rest (`functrain.step.update_groups`; one finish graph over every tensor when the
        optimizer is not leafwise; none with a fused optimizer on one process). False: eager.
      donate: reuse the input state's buffers for the output state (the input is consumed).
      accum_impl: "unroll" (a traced Python loop; one graph) or "scan" (torch's scan higher-order
        op; one graph, compile time independent of accum_steps). torch's scan body cannot enter a
        torch function mode, so under "scan" only the loss's own use of `key` is keyed: a module's
        `nn.Dropout` would draw from torch's generator there, so a step whose loss draws under "scan"
        stops with one line (use "unroll" for keyed module dropout).
      precision: "fp32" (default), "bf16" or "fp16" (with dynamic loss scaling), or a
        `functrain.step.precision.Precision`: forward and backward run in that dtype on a cast copy of
        the params; the state keeps its fp32 master params and optimizer state.
      skip_nonfinite: when the loss or the gradient norm is not finite, skip the update: params
        and optimizer state come back bit-identical, `step` still advances (the next batch is a
        new one) and `state.guard` counts the skip. Always on under fp16 loss scaling.
      compile_options: extra keyword arguments for `torch.compile`. For the one-graph step a
        `mode` is passed as the inductor options it stands for, with functrain's post-grad
        passes added (`options` are extended the same way).
      layout: build the step for params laid out this way only (e.g. `parallel.LOCAL`), instead of
        looking the layout up from the params at each call: for a step run inside another
        transform, such as the population's `torch.func.vmap`.
      fullgraph: True (default): the compiled step must be one graph, and a graph break in the
        loss or the model stops with one line naming it (`functrain.compiler.GraphBreakError`).
        False: torch.compile compiles around graph breaks (several graphs, gradients by plain
        autograd; still no recompiles from step to step), for modules that cannot be one graph.
      model_state_sync: what a data-parallel run keeps of the model state (BatchNorm statistics,
        which each rank updates from its own rows): "broadcast" (default) keeps dp rank 0's, as
        DDP's `broadcast_buffers` does; "mean" averages the floating buffers over the dp ranks
        (integer counters agree anyway), as flax's cross-replica `batch_stats` mean does.
        Normalization itself always uses each rank's own batch statistics (no SyncBatchNorm).
      count_targets: `batch -> number of target tokens` (a 0-d tensor, e.g. `models.lm.count_targets()`)
        for a loss that is a mean over target tokens: the step's loss and gradient are then the mean
        over every target token of the step, whatever `accum_steps` and the number of data-parallel
        and context-parallel ranks (as one process would compute the sum of the losses of all the
        global batch's targets divided by their count), instead of the mean of the microbatches'
        means. The counts are taken from the batch before the forward and summed over the ranks (one
        all-reduce of a scalar); each microbatch's loss is weighted by its share. A microbatch with no
        target adds nothing (the loss must then be finite, e.g. 0, as `models.lm.cross_entropy` is). None:
        every microbatch weighs the same (a loss that is not a mean over tokens).

    The train step runs the model in training mode (`functrain.apply` sets it for the call,
    whatever mode the template is in), and every dropout inside any module draws from the step's key
    (`functrain.nn.randomness`). A state with model state (`TrainState.model_state`, e.g. from
    `init_state(module, ...)`) passes it to `loss_fn` as a fourth argument; the loss returns the
    updated one third (see `functrain.nn.model_state`), and the step keeps it (the old one when it
    skips a non-finite update).

    Returns:
      The step function. Metrics (0-d tensors): `loss`, `grad_norm` (before clipping),
      `update_norm`, `lr` (when the optimizer has a learning rate), plus the
      loss_fn's aux entries (averaged over microbatches); with skipping, `skipped` (1 when this
      step's update was skipped), `consecutive_skips` and `skipped_total`; under fp16,
      `loss_scale` (the scale this step used); with `count_targets`, `targets` (the step's count over
      every microbatch and rank), and the loss and aux are weighted by it.

    Example:
      >>> step = make_train_step(loss_fn, optim.adamw(3e-4), accum_steps=4)
      >>> state, metrics = step(state, batch)
    """
    spec = _train_spec(
        loss_fn,
        optimizer,
        accum_steps=accum_steps,
        accum_impl=accum_impl,
        precision=precision,
        skip_nonfinite=skip_nonfinite,
        donate=donate,
        fullgraph=fullgraph,
        model_state_sync=model_state_sync,
        count_targets=count_targets,
    )
    mode = _compile_mode(compile)
    options = _with_fullgraph(compile_options, fullgraph, mode)
    if mode == "blocks":
        build, wrap = _blocks_route(spec, options)
    elif mode == "step":
        build, wrap = _step_route(spec, options), _as_is
    else:
        build, wrap = _one_graph_route(spec, None, compiled=False)
    if layout is not None:  # one layout, resolved now; run inside another transform, whose caller checks
        return functools.partial(_in_train_mode, wrap(build(layout)))
    return functools.partial(_checked_step, spec.loss_fn, _PerLayout(build, wrap))


class _TrainSpec(NamedTuple):
    """What every route of a train step is built from: `make_train_step`'s arguments, checked."""

    loss_fn: LossFn
    optimizer: optim.Transform
    update: Callable  # `make_update(optimizer, ...)`: the optimizer half
    prec: precision_lib.Precision
    guarded: bool  # a non-finite step is skipped
    donate: bool
    accum_steps: int
    accum_impl: str
    fullgraph: bool
    model_state_sync: str
    count_targets: Callable[[PyTree], torch.Tensor] | None


def _train_spec(
    loss_fn: LossFn,
    optimizer: optim.Transform,
    *,
    accum_steps: int,
    accum_impl: str,
    precision,
    skip_nonfinite: bool,
    donate: bool,
    fullgraph: bool,
    model_state_sync: str,
    count_targets: Callable | None,
) -> _TrainSpec:
    """`make_train_step`'s arguments checked (one line each) and resolved."""
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")
    if accum_impl not in ("unroll", "scan"):
        raise ValueError(f"accum_impl must be 'unroll' or 'scan', got {accum_impl!r}")
    if model_state_sync not in SYNCS:
        raise ValueError(f"model_state_sync must be one of {', '.join(map(repr, SYNCS))}, got {model_state_sync!r}")
    prec = precision_lib.get(precision)
    guarded = skip_nonfinite or prec.loss_scaling
    update = make_update(optimizer, donate=donate, skip_nonfinite=guarded, precision=prec)
    return _TrainSpec(
        loss_fn,
        optimizer,
        update,
        prec,
        guarded,
        donate,
        accum_steps,
        accum_impl,
        fullgraph,
        model_state_sync,
        count_targets,
    )


def _one_graph_route(spec: _TrainSpec, options: dict | None, compiled: bool):
    """The whole step one graph, or eager: `(build(layout) -> step, wrap)`."""
    options = compiler.with_step_passes(options) if compiled else None
    build = functools.partial(_train_body, spec, spec.loss_fn, _as_is, grouped=False)
    return build, functools.partial(compiler.maybe_compile, compile=compiled, options=options)


def _step_route(spec: _TrainSpec, options: dict | None) -> Callable[[Layout], Callable]:
    """compile="step": `build(layout) -> step`. On one process the loss's forward is one graph (its backward
    AOTAutograd's, the gradients by autograd; `forward_graph`) and the update runs after it: group by group
    (`update_groups`, the grad norm summed as the one graph sums it: the same bits), or through the optimizer's
    fused kernel. Sharded params, a step compiled around graph breaks and CUDA graphs keep the whole step one
    graph."""
    whole_route, wrap = _one_graph_route(spec, options, compiled=True)
    options = compiler.with_step_passes(options)

    def build(lay: Layout):
        if lay.sharded or not spec.fullgraph or compiler.records_cuda_graphs(options):
            return wrap(whole_route(lay))
        piece = functools.partial(compiler.maybe_compile, compile=True, options=options)
        prepare = functools.partial(_prepare, spec.prec, lay, False)
        grads = joint = piece(functools.partial(_loss_and_grads, spec, lay, spec.loss_fn, False, prepare))
        whole = piece(functools.partial(_whole_finish, spec.update, spec.prec, lay, False))
        finish: Callable = _GroupedFinish(spec, lay, None, piece, whole, exact_norms=True)
        if _kernel_when_compiled(spec):  # torch's precompiled kernel: nothing to compile
            finish, whole = (functools.partial(_fused_finish, spec, f) for f in (finish, whole))
        if _forward_graph_takes(spec):
            fn = functools.partial(forward_graph.forward, spec.loss_fn, spec.prec, lay)
            forward = forward_graph.Forward(fn, piece(fn))
            plan = forward_graph.Plan(spec.prec, spec.accum_steps, spec.count_targets, spec.model_state_sync)
            grads = functools.partial(_forward_then_autograd, forward, plan, lay, joint)
        return functools.partial(_split_step, grads, finish, whole)

    return build


def _forward_graph_takes(spec: _TrainSpec) -> bool:
    """Whether the loss's gradients come from `forward_graph` (a staged loss brings its own gradient route,
    and torch's scan accumulates inside one graph)."""
    return not isinstance(spec.loss_fn, StagedLoss) and (spec.accum_steps == 1 or spec.accum_impl == "unroll")


def _forward_then_autograd(forward, plan: forward_graph.Plan, lay: Layout, joint, state: TrainState, batch: PyTree):
    """`(aux, grads, model_state)`: the compiled forward and autograd's backward, or the loss and its gradients
    as one graph (`joint`) inside a transform or a trace, where plain autograd cannot run."""
    if not compiler.eager_autograd_ok():
        return joint(state, batch)
    return forward_graph.loss_and_grads(forward, plan, lay, state, batch)


def _fused_finish(spec: _TrainSpec, compiled, state: TrainState, aux: dict, grads: PyTree, *model_state):
    """The update through the optimizer's fused kernel, eagerly; `compiled` where the kernel does not take
    these tensors."""
    loss_scale = state.guard.loss_scale if spec.prec.loss_scaling else None
    master = to_master(grads, state.params, loss_scale)
    done = fused_in_place(state, aux, master, spec.optimizer, spec.guarded, spec.prec, *model_state)
    return compiled(state, aux, grads, *model_state) if done is None else done


def _blocks_route(spec: _TrainSpec, options: dict | None):
    """compile="blocks": prepare and the update are graphs of their own, and the loss runs its stages'
    graphs from eager code: `(build(layout) -> step, wrap)`."""
    if spec.accum_impl == "scan":
        raise ValueError("compile='blocks' runs the microbatches as a Python loop: use accum_impl='unroll'")
    piece = functools.partial(compiler.maybe_compile, compile=True, options=options)
    return functools.partial(_train_body, spec, _stage_compiled(spec.loss_fn, options), piece, grouped=True), _as_is


def _as_is(fn):
    """`fn` itself (no compile)."""
    return fn


def _train_body(spec: _TrainSpec, loss_fn: LossFn, piece: Callable, lay: Layout, *, grouped: bool):
    """The train step for params laid out as `lay` (one body: `parallel.LOCAL` or a mesh's Spmd); `piece`
    compiles its prepare and finish (compile="blocks"), `grouped` runs the update group by group."""
    if lay.sharded and spec.accum_impl == "scan" and spec.accum_steps > 1:
        raise ValueError(
            "accum_impl='scan' runs on one process only (its carry holds plain tensors): "
            "use accum_impl='unroll' on sharded params"
        )
    # Sharded params and a staged loss: each stage gathers its own params and reduce-scatters its
    # own grads (FSDP's per-block schedule); otherwise the whole model is gathered first.
    per_stage = lay.sharded and isinstance(loss_fn, StagedLoss)
    prepare = piece(functools.partial(_prepare, spec.prec, lay, per_stage))
    whole = piece(functools.partial(_whole_finish, spec.update, spec.prec, lay, per_stage))
    finish = _GroupedFinish(spec, lay, loss_fn, piece, whole) if grouped and (per_stage or not lay.sharded) else whole
    if grouped and not lay.sharded and _kernel_when_compiled(spec):  # torch's kernel
        finish, whole = (functools.partial(_fused_finish, spec, f) for f in (finish, whole))
    return functools.partial(_train_step, spec, lay, loss_fn, per_stage, prepare, finish, whole)


def _kernel_when_compiled(spec) -> bool:
    """Whether a compiled step updates through the optimizer's fused kernel (`adamw(fused=True)`, donating)."""
    opt = spec.optimizer
    return opt.fused is not None and opt.traits.fused_compiled and spec.donate


def _prepare(prec, lay: Layout, per_stage: bool, state: TrainState, batch: PyTree):
    """The params, frozen params and batch to compute with (cast before the gather: half the bytes on the
    wire), and this step's key (per step, per dp rank)."""
    params, batch = precision_lib.to_compute(prec, state.params, batch)
    frozen, _ = precision_lib.to_compute(prec, state.frozen, None)
    if not per_stage:
        params, frozen = lay.gather(params), lay.gather(frozen)
    return params, frozen, batch, lay.fold_in_dp(rng_lib.fold_in(state.rng, state.step))


def _whole_finish(update, prec, lay: Layout, per_stage: bool, state, aux: dict, grads, model_state=None):
    """Grads to the masters' dtypes and placements, metrics averaged over dp ranks, the update (with the
    new model state, kept unless the update is skipped). (Not the loss: a compiled finish's key holds
    only what it computes with, so another model of the same shapes loads it.)"""
    grads = to_master(grads, state.params, state.guard.loss_scale if prec.loss_scaling else None)
    if not per_stage:  # grads back to the params' placements (per stage: done already)
        grads = lay.reduce_grads(grads, state.params)
    return update(state, lay.mean_over_dp(aux), grads, model_state)


class _GroupedFinish:
    """The update group by group (`functrain.step.update_groups`) when the plan allows, else the whole finish;
    chosen at the first call, eagerly (the plan runs the optimizer on meta tensors). The groups are a staged
    loss's blocks (compile="blocks"; `loss_fn` None: the params' numbered blocks, `update_groups.blocks_by_name`,
    with `exact_norms`)."""

    def __init__(self, spec: _TrainSpec, lay: Layout, loss_fn, piece, whole, exact_norms: bool = False):
        self.spec, self.lay, self.piece, self.whole = spec, lay, piece, whole
        self.blocks, self.exact_norms = (loss_fn.blocks if loss_fn is not None else None), exact_norms
        self.chosen: Callable | None = None

    def __call__(self, state: TrainState, aux: dict, grads: PyTree):
        if self.chosen is None:
            self.chosen = self._choose(state)
        return self.chosen(state, aux, grads)

    def _choose(self, state: TrainState):
        """The finish for these params and this optimizer."""
        spec = self.spec
        blocks = update_groups.blocks_by_name(state.params) if self.blocks is None else self.blocks
        groups, why = update_groups.plan(state.params, blocks, spec.optimizer)
        if why and self.blocks is not None and len(blocks) > 1:  # (one block: nothing to share, nothing to say)
            warnings.warn(
                "compile='blocks': the optimizer update stays one graph over every tensor, so its compile "
                f"grows with depth: {why}",
                stacklevel=5,
            )
        if not groups:
            return self.whole
        return update_groups.make_finish(
            spec.optimizer,
            groups,
            self.lay,
            donate=spec.donate,
            guarded=spec.guarded,
            prec=spec.prec,
            piece=self.piece,
            exact_norms=self.exact_norms,
        )


def _train_step(spec: _TrainSpec, lay: Layout, loss_fn, per_stage, prepare, finish, whole, state, batch):
    """One train step: prepare, the accumulated loss and grads, the finish (with the model state if any)."""
    return _finish(finish, whole, state, *_loss_and_grads(spec, lay, loss_fn, per_stage, prepare, state, batch))


def _split_step(loss_and_grads, finish, whole, state: TrainState, batch: PyTree):
    """compile="step" on one process: the compiled loss and grads, then the finish."""
    return _finish(finish, whole, state, *loss_and_grads(state, batch))


def _finish(finish, whole, state: TrainState, aux: dict, grads: PyTree, model_state: PyTree):
    """The step's finish: `whole` with the model state when there is one."""
    if not has_model_state(model_state):
        return finish(state, aux, grads)
    return whole(state, aux, grads, model_state)


def _loss_and_grads(spec: _TrainSpec, lay: Layout, loss_fn, per_stage, prepare, state, batch):
    """`(aux, grads, model_state)`: prepare, the accumulated loss and grads, the model state made one over the
    ranks."""
    params, frozen, batch, key = prepare(state, batch)
    loss_scale = state.guard.loss_scale if spec.prec.loss_scaling else None
    model_state = compute_model_state(state.model_state, lay, spec.prec)
    mbs = Microbatches(batch, key, spec.accum_steps, lay, count_targets=spec.count_targets, loss_scale=loss_scale)
    aux, grads, model_state = accumulated_value_and_grad(
        with_frozen(loss_fn, frozen),
        params,
        mbs,
        spec.accum_impl,
        layout=lay if per_stage else None,
        model_state=model_state,
        fullgraph=spec.fullgraph,
    )
    if has_model_state(model_state):
        model_state = lay.sync_model_state(restore_dtypes(model_state, state.model_state), spec.model_state_sync)
    return aux, grads, model_state


def _in_train_mode(step, state: TrainState, batch: PyTree):
    """`step(state, batch)` with the modules in training mode."""
    with mode_lib.running(train=True):
        return step(state, batch)


def _checked_step(loss_fn, steps: _PerLayout, state: TrainState, batch: PyTree):
    """The step for the state's layout, in train mode, after a one-line check that the loss takes the
    state's model state."""
    check_loss(loss_fn, state.model_state)
    with mode_lib.running(train=True):
        out = steps.get(state.params)(state, batch)
    randomness.warn_unkeyed()
    return out


SYNCS = ("broadcast", "mean")
"""`make_train_step`'s `model_state_sync` values."""


def _with_fullgraph(options: dict | None, fullgraph: bool, mode) -> dict | None:
    """`compile_options` with `fullgraph=False` added when asked (a one-graph step compiled around breaks)."""
    if fullgraph:
        return options
    if mode == "blocks":
        raise ValueError(
            "fullgraph=False compiles one step around graph breaks; compile='blocks' compiles the "
            "model's own stages: use compile=True with fullgraph=False"
        )
    return {**(options or {}), "fullgraph": False}


def _compile_mode(compile) -> str | None:
    """`compile` as "step", "blocks" or None (eager)."""
    if compile is True or compile == "step":
        return "step"
    if compile is False or compile is None or compile == "off":
        return None
    if compile == "blocks":
        return compile
    raise ValueError(
        f"compile must be True/'step' (one graph), 'blocks' (a graph per stage kind) or False, got {compile!r}"
    )


def _stage_compiled(loss_fn, options: dict | None):
    """`loss_fn` with each stage compiled on its own (`compile="blocks"`), or a clear error."""
    if not isinstance(loss_fn, StagedLoss):
        raise ValueError(
            "compile='blocks' compiles a staged loss stage by stage, and this loss has no stages: build it "
            "with functrain.step.staged.staged_loss (e.g. gpt.make_loss_fn(template, staged=True)), or use compile=True"
        )
    return loss_fn.compile_stages(options)


def make_eval_step(
    loss_fn: LossFn,
    *,
    compile: bool | str = True,
    precision: str | torch.dtype | precision_lib.Precision | None = None,
    compile_options: dict | None = None,
    fullgraph: bool = True,
    count_targets: Callable[[PyTree], torch.Tensor] | None = None,
) -> Callable[[TrainState, PyTree], dict]:
    """Builds `eval_step(state, batch) -> metrics` ({"loss": ..., **aux}), with no dropout key.

    The model runs in eval mode (`functrain.apply` sets it for the call, whatever mode the
    template is in): no dropout, BatchNorm normalizing with its running statistics, which stay as
    they are (a loss with model state gets `state.model_state`; what it returns is dropped).

    Args:
      loss_fn: the same `(params, batch, key) -> (loss, aux)` as for training; it gets key=None.
      compile: True / "step": one `torch.compile(fullgraph=True)` graph; "blocks": the staged loss's
        stage graphs (see `make_train_step`); False: eager.
      precision: compute precision, as for `make_train_step` (params and inputs are cast).
      compile_options: extra keyword arguments for `torch.compile`.
      fullgraph: False compiles around graph breaks (see `make_train_step`).
      count_targets: as for `make_train_step`: the loss is then the mean over every target token of
        the batch on every data-parallel rank, and `targets` their count (weigh batches by it).

    Returns:
      The eval function; it never changes the state.

    Example:
      >>> eval_step = make_eval_step(loss_fn)
      >>> val_loss = eval_step(state, val_batch)["loss"]
    """

    prec = precision_lib.get(precision)
    mode = _compile_mode(compile)
    compile_options = _with_fullgraph(compile_options, fullgraph, mode)
    if mode == "blocks":  # the stages' own graphs (the no-grad ones the train step's recompute uses)
        loss_fn = _stage_compiled(loss_fn, compile_options)

    def build(lay: Layout):
        """The eval function for params laid out as `lay`."""

        per_stage = lay.sharded and isinstance(loss_fn, StagedLoss)

        def eval_step(state: TrainState, batch: PyTree):
            params, batch = precision_lib.to_compute(prec, state.params, batch)
            model_state = compute_model_state(state.model_state, lay, prec)
            if isinstance(loss_fn, StagedLoss) and has_model_state(model_state):
                raise ValueError(
                    "a staged loss (functrain.step.staged) takes no model state: use a plain loss function "
                    "for a model with buffers"
                )
            frozen, _ = precision_lib.to_compute(prec, state.frozen, None)
            with torch.no_grad():
                if per_stage:  # each stage gathers its own params
                    staged: Any = with_frozen(loss_fn, frozen)  # a StagedLoss
                    loss, aux = staged.apply_sharded(params, batch, None, layout=lay)
                else:
                    loss, aux, _ = call_loss(
                        with_frozen(loss_fn, lay.gather(frozen)), lay.gather(params), batch, None, model_state
                    )
                metrics = {M.LOSS: loss, **aux}
                if count_targets is None:
                    return lay.mean_over_dp(metrics)
                one = Microbatches(batch, None, 1, lay, count_targets=count_targets, loss_scale=None)
                w = one.weight(0)
                return {**lay.mean_over_dp({k: v * w for k, v in metrics.items()}), M.TARGETS: one.total}

        return eval_step

    fns = _PerLayout(build, lambda f: compiler.maybe_compile(f, mode == "step", compile_options))

    def evaluate(state: TrainState, batch: PyTree):
        check_loss(loss_fn, state.model_state)
        with mode_lib.running(train=False):
            return fns.get(state.params)(state, batch)

    return evaluate


class _PerLayout:
    """`wrap(build(layout))` made once per params layout (`LOCAL`, or one per mesh)."""

    def __init__(self, build, wrap):
        self.build, self.wrap, self.fns = build, wrap, {}

    def get(self, params: PyTree):
        """The function for `params`' layout."""
        return self.for_layout(layout_of(params))

    def for_layout(self, lay: Layout):
        """The function for layout `lay` (built on first use)."""
        fn = self.fns.get(id(lay))
        if fn is None:
            fn = self.fns[id(lay)] = self.wrap(self.build(lay))
        return fn
