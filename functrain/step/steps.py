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

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

import functrain.metric_names as M
import functrain.step.grads as grads_lib
import functrain.step.precision as precision_lib
from functrain import compiler, optim
from functrain.nn import mode as mode_lib
from functrain.nn import randomness
from functrain.nn.model_state import call_loss, check_loss, has_model_state, restore_dtypes
from functrain.parallel.dispatch import layout_of
from functrain.parallel.layout import Layout
from functrain.state import TrainState
from functrain.step.grads import (
    LossFn,
    Microbatches,
    PyTree,
    accumulated_value_and_grad,
    compute_model_state,
    step_key,
    with_frozen,
)
from functrain.step.staged import StagedLoss
from functrain.step.update import blocks_by_name, fused_in_place, grouped_update, make_update, plan_groups, to_master

__all__ = ["make_train_step", "make_eval_step"]


def make_train_step(  # noqa: PLR0913
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
    """Builds `step(state, batch) -> (new_state, metrics)`: forward, backward, the update, compiled together.

    Args (each in full: docs/internals.md "make_train_step's arguments"; the routes: docs/compiler.md "Compile units"):
      loss_fn: `(params, batch, key) -> (loss, aux)` (with model state a fourth argument, returned third).
      optimizer: a `functrain.optim.Transform`, e.g. `optim.adamw(3e-4)`.
      accum_steps: microbatches per step, their gradients averaged inside the one call.
      compile: True/"step" (the default route), "blocks" (a graph per stage kind of a staged loss), False (eager).
      donate: write the new state into the input's buffers (the input is consumed).
      accum_impl: "unroll" (a traced loop) or "scan" (torch's scan: compile time flat in `accum_steps`).
      precision: "fp32", "bf16", "fp16" (loss-scaled) or a `Precision`; the state keeps fp32 masters.
      skip_nonfinite: skip the update (params and optimizer state kept, `state.guard` counts) on a non-finite
        loss or grad norm.
      compile_options: extra keyword arguments for `torch.compile`.
      layout: build for this params layout only (a step run inside another transform, e.g. `vmap`).
      fullgraph: False compiles around graph breaks (several graphs, still no recompiles).
      model_state_sync: "broadcast" (dp rank 0's buffers, as DDP) or "mean" (their mean over dp ranks).
      count_targets: `batch -> target count`: the loss and gradients become the mean over every target token of
        the step, whatever `accum_steps` and the ranks; None: every microbatch weighs the same.

    Returns:
      The step. Its metrics (0-d tensors): `loss`, `grad_norm`, `update_norm`, `lr`, the aux (averaged over
      microbatches); with skipping `skipped`, `consecutive_skips`, `skipped_total`; under fp16 `loss_scale`;
      with `count_targets` `targets`.

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
        compile=compile,
        compile_options=compile_options,
    )
    if layout is not None:  # one layout, resolved now; run inside another transform, whose caller checks
        return _InTrainMode(choose_route(spec, layout))
    return _TrainStep(spec)


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
    mode: str | None  # "step", "blocks" or None (eager)
    options: dict | None  # torch.compile's options (fullgraph=False added when asked)
    stage_loss: LossFn | None  # compile="blocks": the loss with each stage compiled


def _train_spec(  # noqa: PLR0913
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
    compile: bool | str,
    compile_options: dict | None,
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
    mode = _compile_mode(compile)
    options = _with_fullgraph(compile_options, fullgraph, mode)
    stage_loss = None
    if mode == "blocks":
        if accum_impl == "scan":
            raise ValueError("compile='blocks' runs the microbatches as a Python loop: use accum_impl='unroll'")
        stage_loss = _stage_compiled(loss_fn, options)
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
        mode,
        options,
        stage_loss,
    )


def choose_route(spec: _TrainSpec, lay: Layout) -> Callable[[TrainState, PyTree], tuple[TrainState, dict]]:
    """The train step for params laid out as `lay`: its route, chosen once (docs/compiler.md "Compile units").

    Eager: prepare, the loss and grads over the microbatches, the update, in Python. compile="step" on one
    process: the split step (`_split_step`). compile="step" on sharded params, around graph breaks or under CUDA
    graphs: the eager body compiled as one graph. compile="blocks": the staged loss's stage graphs run from
    Python, prepare and the update compiled, the update group by group.
    """
    if spec.mode is None:
        return _Body(spec, lay, spec.loss_fn, _as_is, grouped=False)
    if spec.mode == "blocks":
        return _Body(spec, lay, spec.stage_loss, _compiler(spec.options), grouped=True)
    options = compiler.with_step_passes(spec.options)
    if lay.sharded or not spec.fullgraph or compiler.records_cuda_graphs(options):
        return _whole_graph(spec, lay)
    return _split_step(spec, lay, _compiler(options))


def _whole_graph(spec: _TrainSpec, lay: Layout):
    """compile="step", the whole step one graph: the eager body compiled."""
    return compiler.maybe_compile(
        _Body(spec, lay, spec.loss_fn, _as_is, grouped=False), True, compiler.with_step_passes(spec.options)
    )


def _split_step(spec: _TrainSpec, lay: Layout, piece: Callable):
    """compile="step" on one process: the loss's forward one graph (its backward AOTAutograd's, the gradients by
    autograd; `grads.grads_by_autograd`), or the loss and its gradients as one graph (a staged loss, torch's scan);
    then the update group by group (`update.grouped_update`, the grad norm summed as the one graph sums it: the same
    bits), or through the optimizer's fused kernel."""
    prepare = _prepare_for(spec.prec, lay, per_stage=False)
    joint = piece(_joint_for(spec, lay, prepare))
    whole = piece(_whole_update_for(spec.update, spec.prec, lay, per_stage=False))
    update = _Update(spec, lay, whole, piece, groups=True, exact_norms=True, kernel=True)
    grads = _ForwardThenAutograd(spec, lay, piece, joint) if _forward_graph_takes(spec) else joint

    def step(state: TrainState, batch: PyTree):
        return update(state, *grads(state, batch))

    return step


def _compiler(options: dict | None) -> Callable:
    """`piece(fn)`: `fn` compiled with `options` (a piece of a step)."""

    def piece(fn):
        return compiler.maybe_compile(fn, True, options)

    return piece


def _as_is(fn):
    """`fn` itself (no compile)."""
    return fn


def _forward_graph_takes(spec: _TrainSpec) -> bool:
    """Whether the loss's gradients come from `grads.grads_by_autograd` (a staged loss brings its own gradient route,
    and torch's scan accumulates inside one graph)."""
    return not isinstance(spec.loss_fn, StagedLoss) and (spec.accum_steps == 1 or spec.accum_impl == "unroll")


class _ForwardThenAutograd:
    """`(aux, grads, model_state)`: the compiled forward and autograd's backward (`grads.grads_by_autograd`), or the
    loss and its gradients as one graph (`joint`) inside a transform or a trace, where plain autograd cannot run."""

    def __init__(self, spec: _TrainSpec, lay: Layout, piece: Callable, joint: Callable):
        loss_fn, prec = spec.loss_fn, spec.prec  # (what the forward's graph computes with, alone)

        def forward(*args):
            return grads_lib.forward_loss(loss_fn, prec, lay, *args)

        self.forward, self.lay, self.joint = grads_lib.ForwardGraph(forward, piece(forward)), lay, joint
        self.plan = grads_lib.GradPlan(prec, spec.accum_steps, spec.count_targets, spec.model_state_sync)

    def __call__(self, state: TrainState, batch: PyTree):
        if not compiler.eager_autograd_ok():
            return self.joint(state, batch)
        return grads_lib.grads_by_autograd(self.forward, self.plan, self.lay, state, batch)


class _Body:
    """The train step as one body: prepare (cast, gather, key), the loss and grads over the microbatches, the
    update. Eager or compiled whole (`piece` as is), or its prepare and update compiled by `piece` around a staged
    loss's stage graphs (compile="blocks"); `grouped`: the update group by group."""

    def __init__(self, spec: _TrainSpec, lay: Layout, loss_fn, piece: Callable, *, grouped: bool):
        if lay.sharded and spec.accum_impl == "scan" and spec.accum_steps > 1:
            raise ValueError(
                "accum_impl='scan' runs on one process only (its carry holds plain tensors): "
                "use accum_impl='unroll' on sharded params"
            )
        # Sharded params and a staged loss: each stage gathers its own params and reduce-scatters its
        # own grads (FSDP's per-block schedule); otherwise the whole model is gathered first.
        per_stage = lay.sharded and isinstance(loss_fn, StagedLoss)
        self.spec, self.lay, self.loss_fn, self.per_stage = spec, lay, loss_fn, per_stage
        self.prepare = piece(_prepare_for(spec.prec, lay, per_stage))
        whole = piece(_whole_update_for(spec.update, spec.prec, lay, per_stage))
        grouped = grouped and (per_stage or not lay.sharded)
        blocks = loss_fn.blocks if grouped else None
        self.update = _Update(
            spec, lay, whole, piece, groups=grouped, blocks=blocks, kernel=grouped and not lay.sharded
        )

    def __call__(self, state: TrainState, batch: PyTree):
        aux, grads, model_state = _loss_and_grads(
            self.spec, self.lay, self.loss_fn, self.per_stage, self.prepare, state, batch
        )
        return self.update(state, aux, grads, model_state)


def _kernel_when_compiled(spec) -> bool:
    """Whether a compiled step updates through the optimizer's fused kernel (`adamw(fused=True)`, donating)."""
    opt = spec.optimizer
    return opt.fused is not None and opt.traits.fused_compiled and spec.donate


def _prepare_for(prec, lay: Layout, per_stage: bool) -> Callable:
    """`prepare(state, batch)`: the params, frozen params and batch to compute with (cast before the gather: half
    the bytes on the wire), and this step's key (per step, per dp rank)."""

    def prepare(state: TrainState, batch: PyTree):
        params, batch = precision_lib.to_compute(prec, state.params, batch)
        frozen, _ = precision_lib.to_compute(prec, state.frozen, None)
        if not per_stage:
            params, frozen = lay.gather(params), lay.gather(frozen)
        return params, frozen, batch, step_key(state, lay)

    return prepare


def _whole_update_for(update, prec, lay: Layout, per_stage: bool) -> Callable:
    """`whole_update(state, aux, grads, model_state=None)`: grads to the masters' dtypes and placements, metrics
    averaged over dp ranks, the update (with the new model state, kept unless the update is skipped). (Not the loss: a
    compiled update's key holds only what it computes with, so another model of the same shapes loads it.)"""

    def whole_update(state: TrainState, aux: dict, grads: PyTree, model_state: PyTree = None):
        grads = to_master(grads, state.params, prec.scale_of(state.guard))
        if not per_stage:  # grads back to the params' placements (per stage: done already)
            grads = lay.reduce_grads(grads, state.params)
        return update(state, lay.mean_over_dp(aux), grads, model_state)

    return whole_update


def _joint_for(spec: _TrainSpec, lay: Layout, prepare: Callable) -> Callable:
    """`loss_and_grads(state, batch)`: prepare and the loss's gradients, to compile as one graph."""

    def loss_and_grads(state: TrainState, batch: PyTree):
        return _loss_and_grads(spec, lay, spec.loss_fn, False, prepare, state, batch)

    return loss_and_grads


class _Update:
    """The step's update `(state, aux, grads, model_state)`, its route chosen here: through the optimizer's fused
    kernel, eagerly, where `kernel` and the optimizer has one (`adamw(fused=True)`, donating); else, without a model
    state and where `groups`, group by group (`update.grouped_update`, planned at the first call: the plan runs the
    optimizer on meta tensors), the groups a staged loss's `blocks` (compile="blocks") or the params'
    numbered blocks (`update.blocks_by_name`, with `exact_norms`); else `whole`."""

    def __init__(
        self,
        spec: _TrainSpec,
        lay: Layout,
        whole: Callable,
        piece: Callable,
        *,
        groups: bool,
        kernel: bool,
        blocks: list | None = None,
        exact_norms: bool = False,
    ):
        self.spec, self.lay, self.whole, self.piece = spec, lay, whole, piece
        self.groups, self.kernel = groups, kernel and _kernel_when_compiled(spec)
        self.blocks, self.exact_norms = blocks, exact_norms
        self.by_groups: Callable | None = None

    def __call__(self, state: TrainState, aux: dict, grads: PyTree, model_state: PyTree):
        spec, with_state = self.spec, has_model_state(model_state)
        if self.kernel:  # torch's precompiled kernel: nothing to compile
            master = to_master(grads, state.params, spec.prec.scale_of(state.guard))
            ms = model_state if with_state else None
            done = fused_in_place(state, aux, master, spec.optimizer, spec.guarded, spec.prec, ms)
            if done is not None:
                return done
        if with_state or not self.groups:
            return self.whole(state, aux, grads, model_state if with_state else None)
        if self.by_groups is None:
            self.by_groups = self._plan(state)
        return self.by_groups(state, aux, grads)

    def _plan(self, state: TrainState) -> Callable:
        """The grouped update for these params and this optimizer, or `whole` where the plan refuses."""
        spec = self.spec
        blocks = blocks_by_name(state.params) if self.blocks is None else self.blocks
        groups, why = plan_groups(state.params, blocks, spec.optimizer)
        if why and self.blocks is not None and len(blocks) > 1:  # (one block: nothing to share, nothing to say)
            warnings.warn(
                "compile='blocks': the optimizer update stays one graph over every tensor, so its compile "
                f"grows with depth: {why}",
                stacklevel=5,
            )
        if not groups:
            return self.whole
        return grouped_update(
            spec.optimizer,
            groups,
            self.lay,
            donate=spec.donate,
            guarded=spec.guarded,
            prec=spec.prec,
            piece=self.piece,
            exact_norms=self.exact_norms,
        )


def _loss_and_grads(spec: _TrainSpec, lay: Layout, loss_fn, per_stage, prepare, state, batch):
    """`(aux, grads, model_state)`: prepare, the accumulated loss and grads, the model state made one over the
    ranks."""
    params, frozen, batch, key = prepare(state, batch)
    model_state = compute_model_state(state.model_state, lay, spec.prec)
    scale = spec.prec.scale_of(state.guard)
    mbs = Microbatches(batch, key, spec.accum_steps, lay, count_targets=spec.count_targets, loss_scale=scale)
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


class _InTrainMode:
    """`step(state, batch)` with the modules in training mode."""

    def __init__(self, step: Callable):
        self.step = step

    def __call__(self, state: TrainState, batch: PyTree):
        with mode_lib.running(train=True):
            return self.step(state, batch)


class _TrainStep:
    """`make_train_step`'s step: the route for the state's layout (chosen at its first call), in train mode, after
    a one-line check that the loss takes the state's model state."""

    def __init__(self, spec: _TrainSpec):
        self.spec, self.steps = spec, _PerLayout(lambda lay: choose_route(spec, lay))

    def __call__(self, state: TrainState, batch: PyTree):
        check_loss(self.spec.loss_fn, state.model_state)
        with mode_lib.running(train=True):
            out = self.steps.get(state.params)(state, batch)
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

    fns = _PerLayout(lambda lay: compiler.maybe_compile(build(lay), mode == "step", compile_options))

    def evaluate(state: TrainState, batch: PyTree):
        check_loss(loss_fn, state.model_state)
        with mode_lib.running(train=False):
            return fns.get(state.params)(state, batch)

    return evaluate


class _PerLayout:
    """`build(layout)` made once per params layout (`LOCAL`, or one per mesh)."""

    def __init__(self, build):
        self.build, self.fns = build, {}

    def get(self, params: PyTree):
        """The function for `params`' layout."""
        return self.for_layout(layout_of(params))

    def for_layout(self, lay: Layout):
        """The function for layout `lay` (built on first use)."""
        fn = self.fns.get(id(lay))
        if fn is None:
            fn = self.fns[id(lay)] = self.build(lay)
        return fn
