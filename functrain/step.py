"""Pure train and eval steps: `step(state, batch) -> (state, metrics)`, compiled as one graph.

The train step does forward, backward (`torch.func.grad_and_value` over the params), gradient
accumulation, the optimizer (clipping, schedule, update) and the step counter in one function, and
compiles it whole with `torch.compile(fullgraph=True)`. Everything that changes from step to step is
a tensor in the state, so the graph is built once and never recompiled.

Donation. With `donate=True` (the default) the step writes the new params and optimizer state into
the input state's buffers (inside the compiled graph, where inductor makes the update kernels write
straight into them) and returns a state that reuses those buffers. The input state is *consumed*,
as with `jax.jit(..., donate_argnums=0)`: do not read it after the call, use the returned one. This
keeps peak memory near one copy of the state. `donate=False` allocates a new state and leaves the
input untouched (useful for tests, EMA tricks and debugging).

Compile unit. `compile=True` makes the whole step one graph: the fastest steps, but every block is
inlined, so compile time grows with depth. `compile="regions"` keeps the one graph and makes the
blocks calls of one compiled region (`functrain.regions`: compiled once, gradients by a traced
`torch.autograd.grad`). `compile="blocks"` (a staged loss only) compiles the
step's prepare (casts, key) as a graph and lets the loss run its stages as graphs of their own, one
block graph shared by every block (`functrain.remat.staged_loss`'s `compile_stages`); the finish
(grads to the masters, metrics, the optimizer update) runs group by group, one update graph for
every block (`functrain.update_groups`; one finish graph when the optimizer or its masks do not
allow that). No graph per block, none per step.

Precision and safety. `precision="bf16"` (or "fp16", with dynamic loss scaling) runs forward and
backward on a cast copy of the params inside the same graph while the state keeps fp32 masters
(`functrain.precision`). A step whose loss or gradient norm is not finite keeps the old params and
optimizer state (a `torch.where` fused into the update kernels: no host sync, no graph break),
advances `step`, and counts the skip in `state.guard` and the metrics.

Sharded state. When the params are DTensors on a DeviceMesh (`functrain.parallel.shard_state`),
the same body runs through the params' `functrain.parallel.Layout` (`layout_of(params)`): parameters
are gathered over the data-parallel axes, the loss and gradients are taken over the local plain
tensors, gradients are reduce-scattered back to the parameter placements, the optimizer updates the
shards, and the loss is averaged over the data-parallel ranks; the batch is each dp rank's local
part. For plain tensors the layout is `parallel.LOCAL`, whose collectives are the identity: the step
has one body and no `if sharded` branch, and nothing here knows DTensor.

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
from typing import Any, Callable

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

from functrain import metric_names as M
from functrain import compiling, foreach, ops, optim, regions
from functrain import precision as precision_lib
from functrain import rng as rng_lib
from functrain import tree as tree_lib
from functrain import update_groups
from functrain.parallel.layout import Layout, layout_of
from functrain.state import Guard, TrainState

__all__ = [
    "apply",
    "apply_gradients",
    "loss_and_aux",
    "make_train_step",
    "make_eval_step",
    "update_step",
    "value_and_grad",
]

PyTree = Any
LossFn = Callable[[PyTree, PyTree, "torch.Tensor | None"], "tuple[torch.Tensor, dict]"]


def apply(model: nn.Module, params: PyTree, *args, **kwargs):
    """Calls `model(*args, **kwargs)` with `params` in place of its parameters (functional_call).

    Args:
      model: the module (a real one or a storage-free template built on the "meta" device).
      params: {name: tensor} for every parameter (tied parameters once).
      *args, **kwargs: the forward's arguments.

    Returns:
      Whatever the module's forward returns.

    Example:
      >>> logits = functrain.apply(model, state.params, x, dropout_key=key)
    """
    return torch.func.functional_call(model, params, args, kwargs)


def value_and_grad(loss_fn: LossFn, params: PyTree, batch: PyTree, key, *, loss_scale=None, layout=None):
    """Loss, aux and gradients of `loss_fn(params, batch, key)` with respect to `params`.

    Args:
      loss_fn: `(params, batch, key) -> (scalar loss, aux dict)` (or just the loss).
      params: the parameter tree (plain tensors).
      batch: the batch pytree.
      key: the RNG key passed to `loss_fn` (or None).
      loss_scale: optional 0-d tensor; the gradients are those of `loss * loss_scale` (fp16 loss
        scaling) while the returned loss is unscaled.
      layout: for sharded (DTensor) params: the loss's `value_and_grad_sharded(params, batch, key,
        *, layout, loss_scale=None)` is used, which gathers each stage's params itself and returns
        grads in the params' placements (`functrain.remat.staged_loss` has one).

    Returns:
      `(loss, aux, grads)`: detached loss, the aux dict, grads shaped like params.

    A loss function may bring its own gradient route: when `loss_fn` has a
    `value_and_grad(params, batch, key, *, loss_scale=None)` method returning
    `(loss, aux, grads)`, that is used instead of `torch.func.grad_and_value` (e.g. the
    `functrain.remat` losses, which recompute blocks in the backward).

    Example:
      >>> loss, aux, grads = value_and_grad(loss_fn, params, batch, key)
    """
    custom = getattr(loss_fn, "value_and_grad", None)
    if layout is not None:
        custom = functools.partial(loss_fn.value_and_grad_sharded, layout=layout)
    if custom is not None:
        kwargs = {} if loss_scale is None else {"loss_scale": loss_scale}
        loss, aux, grads = custom(params, batch, key, **kwargs)
        return loss.detach(), dict(aux or {}), grads

    def f(p):
        loss, aux = loss_and_aux(loss_fn(p, batch, key))
        scaled = loss if loss_scale is None else loss * loss_scale.to(loss.dtype)
        return scaled, (loss.detach(), aux)

    grads, (_, (loss, aux)) = torch.func.grad_and_value(f, has_aux=True)(params)
    return loss, aux, grads


def loss_and_aux(out) -> tuple[torch.Tensor, dict]:
    """A loss function's result as `(loss, aux dict)`: the loss contract, in one place.

    A loss function returns a scalar tensor, or `(loss, aux)` with `aux` a dict (or None) of
    scalar tensors to report; anything else (e.g. a tuple of two tensors) is an error.

    Args:
      out: what a loss function returned.

    Returns:
      `(loss, aux dict)`.

    Raises:
      TypeError: `out` has another structure.

    Example:
      >>> loss, aux = loss_and_aux(loss_fn(params, batch, key))
    """
    if isinstance(out, torch.Tensor):
        return out, {}
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor) and (
        out[1] is None or isinstance(out[1], dict)
    ):
        return out[0], dict(out[1] or {})
    raise TypeError(
        f"a loss function must return a scalar tensor or (loss, aux dict), got {_describe(out)}; "
        "put extra outputs in the aux dict"
    )


def _describe(x) -> str:
    """A short description of a value's structure for error messages."""
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of ({', '.join(type(v).__name__ for v in x)})"
    return f"a {type(x).__name__}"


def _metrics_and_grads(loss_fn, params, batch, key, loss_scale=None, layout=None):
    """({"loss": loss, **aux}, grads) for one (micro)batch (per-stage gathers with a `layout`)."""
    loss, aux, grads = value_and_grad(loss_fn, params, batch, key, loss_scale=loss_scale, layout=layout)
    return {M.LOSS: loss, **aux}, grads


def _split_microbatches(batch: PyTree, k: int) -> PyTree:
    """Reshapes every batch leaf (B, ...) to (k, B // k, ...)."""

    def split(x):
        if x.shape[0] % k:
            raise ValueError(
                f"batch dimension {x.shape[0]} is not divisible by accum_steps={k}; "
                "make the batch size a multiple of accum_steps"
            )
        return x.reshape(k, x.shape[0] // k, *x.shape[1:])  # (K, B/K, ...)

    return tree_lib.map(split, batch)


def _gathers_per_stage(loss_fn, accum_impl: str, accum_steps: int) -> bool:
    """Whether the loss gathers sharded params stage by stage (`value_and_grad_sharded`, e.g. a
    `functrain.remat.staged_loss`); not under the scan accumulation (its carry holds plain tensors)."""
    return hasattr(loss_fn, "value_and_grad_sharded") and (accum_steps == 1 or accum_impl == "unroll")


def _accumulated_value_and_grad(loss_fn, params, batch, key, accum_steps: int, impl: str, loss_scale=None,
                                layout=None):
    """Mean loss/aux/grads over `accum_steps` microbatches, inside one graph (grads summed in
    float32 when accumulating, else in the compute dtype; the caller casts them to the masters').
    With `layout`, params are sharded and the loss gathers them stage by stage."""
    if accum_steps == 1:
        return _metrics_and_grads(loss_fn, params, batch, key, loss_scale, layout)
    micro = _split_microbatches(batch, accum_steps)
    keys = rng_lib.split(key, accum_steps)  # (K, 2)
    if impl == "scan":
        from torch._higher_order_ops.scan import scan

        def body(carry, xs):
            mb, k = xs
            aux, grads = _metrics_and_grads(loss_fn, params, mb, k, loss_scale)
            return tree_lib.map(torch.add, carry, (grads, aux)), torch.zeros(())

        probe_aux = _zeros_aux(loss_fn, params, micro, keys)
        init = (tree_lib.map(lambda p: torch.zeros_like(p, dtype=torch.float32), params), probe_aux)
        (gsum, asum), _ = scan(body, init, (micro, keys))
    else:  # "unroll": a Python loop traced into the same graph
        gsum = asum = None
        for i in range(accum_steps):
            mb = tree_lib.map(lambda x: x[i], micro)
            aux, grads = _metrics_and_grads(loss_fn, params, mb, keys[i], loss_scale, layout)
            grads = tree_lib.map(lambda g: g.float(), grads)
            gsum = grads if gsum is None else tree_lib.map(torch.add, gsum, grads)
            asum = aux if asum is None else tree_lib.map(torch.add, asum, aux)
    scale = 1.0 / accum_steps
    grads = tree_lib.map(lambda g: g * scale, gsum)  # float32
    return tree_lib.map(lambda a: a * scale, asum), grads


def _to_master(grads: PyTree, master: PyTree, loss_scale) -> PyTree:
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
        ok, torch.where(grow, guard.loss_scale * prec.growth_factor, guard.loss_scale),
        guard.loss_scale * prec.backoff_factor,
    )
    return Guard(skipped, consecutive, scale, torch.where(grow, torch.zeros_like(good), good))


def _update_ok(grad_norm: torch.Tensor, metrics: dict) -> torch.Tensor:
    """Whether an update may be applied: a finite gradient norm and, when reported, a finite loss."""
    ok = torch.isfinite(grad_norm)
    if M.LOSS in metrics:
        ok = ok & torch.isfinite(metrics[M.LOSS])
    return ok


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


def _zeros_aux(loss_fn, params, micro, keys):
    """Zeros shaped like the (loss, aux) of one microbatch, to start the scan's carry."""
    mb = tree_lib.map(lambda x: x[0], micro)
    with torch.no_grad():
        loss, aux = loss_and_aux(loss_fn(params, mb, keys[0]))
    aux = {M.LOSS: loss, **aux}
    return tree_lib.map(lambda a: torch.zeros_like(a, dtype=torch.float32), aux)


def apply_gradients(
    state: TrainState,
    grads: PyTree,
    optimizer: optim.Transform,
    *,
    aux: dict | None = None,
    skip_nonfinite: bool = True,
    precision: "str | torch.dtype | precision_lib.Precision | None" = None,
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

    Returns:
      `(new_state, metrics)`: metrics hold `aux`, `grad_norm`, `update_norm` (of the optimizer's
      update, before a skip), `lr`, and the skip counters when skipping. The params' norm is not
      taken here (it would cost a pass of its own every step): log `tree.global_norm(state.params)`
      when you log, as `functrain.loop` does.

    Example:
      >>> grads = tree.map(lambda g: g + sigma * torch.randn_like(g), clipped_mean_grads)
      >>> state, metrics = apply_gradients(state, grads, opt, aux={"loss": loss})
    """
    prec = precision_lib.get(precision)
    lay = layout_of(state.params)
    metrics = dict(aux or {})
    metrics[M.GRAD_NORM] = grad_norm = lay.global_norm(grads)
    guarded = skip_nonfinite or prec.loss_scaling
    if guarded:  # decided before the update math, so every per-element loop runs after it
        (flag,) = ops.hoist(_update_ok(grad_norm, metrics))
        ok = flag > 0.5
    updates, opt_state = optim.call_update(optimizer, grads, state.opt_state, state.params, norm=grad_norm)
    params = optim.apply_updates(state.params, updates)
    # Summed flat inside the update's own loop (one reduction there is nearly free; a second one,
    # e.g. a param norm, makes inductor split the loop in two passes: 4x the update's time).
    metrics[M.UPDATE_NORM] = lay.global_norm(updates, fused=True)
    guard = state.guard
    if guarded:  # non-finite: keep the old params and optimizer state
        params = lay.select(ok, params, state.params)
        opt_state = lay.select(ok, opt_state, state.opt_state)
        guard = _guard_after(guard, ok, prec, metrics)
    metrics.update(optim.report(optimizer, opt_state))  # e.g. the learning rate this update used
    return TrainState(params, opt_state, state.step + 1, state.rng, guard), metrics


def make_train_step(
    loss_fn: LossFn,
    optimizer: optim.Transform,
    *,
    accum_steps: int = 1,
    compile: "bool | str" = True,
    donate: bool = True,
    accum_impl: str = "unroll",
    precision: "str | torch.dtype | precision_lib.Precision | None" = None,
    skip_nonfinite: bool = True,
    compile_options: dict | None = None,
) -> Callable[[TrainState, PyTree], tuple[TrainState, dict]]:
    """Builds `step(state, batch) -> (new_state, metrics)`.

    Args:
      loss_fn: `(params, batch, key) -> (loss, aux)`: a scalar loss and a dict of scalar tensors
        to report. `key` is this step's (and microbatch's) RNG key, for dropout.
      optimizer: a `functrain.optim.Transform` (e.g. `optim.adamw(...)`).
      accum_steps: split the batch into this many microbatches and average their gradients
        inside the one call (the batch dimension must divide by it).
      compile: True (or "step"): the whole step is one `torch.compile(fullgraph=True)` graph.
        "regions": the same one graph, its blocks (a staged loss whose blocks share one
        computation, remat "none", one process) calls of one `nested_compile_region`, and its
        optimizer update group by group as regions too, so the block is compiled once and the cold
        compile grows less with depth (`functrain.regions`; README "Compile unit").
        "blocks": for a staged loss (`functrain.remat.staged_loss`, e.g. `gpt.make_loss_fn(...,
        staged=True)`): each stage kind is its own graph, every block running the same one, so
        neither the number of graphs nor the cold compile grows with depth (README "Compile
        unit"); graphs: the step's prepare (cast, key), the embedding, the block (a second one
        for a recomputed block's no-grad forward), the head (see `remat.staged_loss`'s
        `compile_stages`), and the optimizer update block by block: one graph for every block, one
        for the rest (`functrain.update_groups`; one finish graph over every tensor when the
        optimizer is not leafwise). False: eager.
      donate: reuse the input state's buffers for the output state (the input is consumed).
      accum_impl: "unroll" (a traced Python loop; one graph) or "scan" (torch's scan higher-order
        op; one graph, compile time independent of accum_steps).
      precision: "fp32" (default), "bf16" or "fp16" (with dynamic loss scaling), or a
        `functrain.precision.Precision`: forward and backward run in that dtype on a cast copy of
        the params; the state keeps its fp32 master params and optimizer state.
      skip_nonfinite: when the loss or the gradient norm is not finite, skip the update: params
        and optimizer state come back bit-identical, `step` still advances (the next batch is a
        new one) and `state.guard` counts the skip. Always on under fp16 loss scaling.
      compile_options: extra keyword arguments for `torch.compile`. For the one-graph step a
        `mode` is passed as the inductor options it stands for, with functrain's post-grad
        passes added (`options` are extended the same way).

    Returns:
      The step function. Metrics (0-d tensors): `loss`, `grad_norm` (before clipping),
      `update_norm`, `lr` (when the optimizer has a learning rate), plus the
      loss_fn's aux entries (averaged over microbatches); with skipping, `skipped` (1 when this
      step's update was skipped), `consecutive_skips` and `skipped_total`; under fp16,
      `loss_scale` (the scale this step used).

    Example:
      >>> step = make_train_step(loss_fn, optim.adamw(3e-4), accum_steps=4)
      >>> state, metrics = step(state, batch)
    """
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")
    if accum_impl not in ("unroll", "scan"):
        raise ValueError(f"accum_impl must be 'unroll' or 'scan', got {accum_impl!r}")
    prec = precision_lib.get(precision)
    guarded = skip_nonfinite or prec.loss_scaling
    update = _make_update(optimizer, donate=donate, skip_nonfinite=guarded, precision=prec)
    mode = _compile_mode(compile)
    if mode in ("blocks", "regions") and accum_impl == "scan":
        raise ValueError(f"compile={mode!r} runs the microbatches as a Python loop: use accum_impl='unroll'")
    # "step": the whole body is one graph; "regions": the same, its blocks one compiled region;
    # "blocks": prepare and the update are graphs of their own and the loss runs its stages' graphs
    # from eager code
    run_loss = {"blocks": lambda: _stage_compiled(loss_fn, compile_options),
                "regions": lambda: regions.region_loss(loss_fn)}.get(mode, lambda: loss_fn)()
    piece = functools.partial(compiling.maybe_compile, compile=mode == "blocks", options=compile_options)
    one_graph = mode in ("step", "regions")
    step_options = _step_passes(compile_options) if one_graph else None  # (+ recompute, reshard, sdpa seeds)
    whole = functools.partial(compiling.maybe_compile, compile=one_graph, options=step_options)

    def build(lay: Layout, loss_fn=loss_fn, piece=lambda f: f, grouped=False, in_regions=False):
        """The step for params laid out as `lay` (one body: `parallel.LOCAL` or a mesh's Spmd)."""

        # Sharded params and a staged loss: each stage gathers its own params and reduce-scatters
        # its own grads (FSDP's per-block schedule); otherwise the whole model is gathered first.
        per_stage = lay.sharded and _gathers_per_stage(loss_fn, accum_impl, accum_steps)

        @piece
        def prepare(state: TrainState, batch: PyTree):
            """The params and batch to compute with (cast before the gather: half the bytes on the
            wire), and this step's key (per step, per dp rank)."""
            params, batch = precision_lib.to_compute(prec, state.params, batch)
            if not per_stage:
                params = lay.gather(params)
            return params, batch, lay.fold_in_dp(rng_lib.fold_in(state.rng, state.step))

        @piece
        def whole_finish(state: TrainState, aux: dict, grads: PyTree):
            """Grads to the masters' dtypes and placements, metrics averaged over dp ranks, the update."""
            grads = _to_master(grads, state.params, state.guard.loss_scale if prec.loss_scaling else None)
            if not per_stage:  # grads back to the params' placements (per stage: done already)
                grads = lay.reduce_grads(grads, state.params)
            return update(state, lay.mean_over_dp(aux), grads)

        chosen: list = []  # compile="blocks"/"regions": the finish, chosen at the first call (from the params)

        def choose(state: TrainState):
            """The finish for these params and this optimizer, picked at the first call (eagerly: the
            plan runs the optimizer on meta tensors)."""
            if chosen:
                return chosen[0]
            groups, why = update_groups.plan(state.params, loss_fn.blocks, optimizer)
            if why and len(loss_fn.blocks) > 1:  # (one block: nothing to share, nothing to say)
                warnings.warn(f"compile={mode!r}: the optimizer update stays one graph over every "
                              f"tensor, so its compile grows with depth: {why}", stacklevel=3)
            # "regions": the groups' grads and update phases are nested compile regions of the one
            # step graph (a region cannot write into its inputs: donated after it returns)
            pieces = dict(piece=functools.partial(regions.region, out_like=lambda p, g, s, norm, ok: (p, s, norm)),
                          grads_piece=regions.region, in_regions=True) if in_regions else dict(piece=piece)
            chosen.append(update_groups.make_finish(
                optimizer, groups, lay, donate=donate, guarded=guarded, prec=prec, to_master=_to_master,
                update_ok=_update_ok, guard_after=_guard_after, **pieces) if groups else whole_finish)
            return chosen[0]

        def ready(state: TrainState):
            """Chooses and prepares the finish eagerly, before the one step graph traces it ("regions")."""
            chosen_finish = choose(state)
            if hasattr(chosen_finish, "prepare"):
                chosen_finish.prepare(state)

        def grouped_finish(state: TrainState, aux: dict, grads: PyTree):
            """The update group by group (functrain.update_groups) when the plan allows, else whole."""
            return choose(state)(state, aux, grads)

        finish = grouped_finish if grouped and (per_stage or not lay.sharded) else whole_finish

        def train_step(state: TrainState, batch: PyTree):
            params, batch, key = prepare(state, batch)
            loss_scale = state.guard.loss_scale if prec.loss_scaling else None
            aux, grads = _accumulated_value_and_grad(
                loss_fn, params, batch, key, accum_steps, accum_impl, loss_scale, layout=lay if per_stage else None
            )
            return finish(state, aux, grads)

        if finish is grouped_finish:
            train_step.ready = ready  # type: ignore[attr-defined]  # (called before a trace: "regions")
        return train_step

    steps = _PerLayout(lambda lay: build(lay, run_loss, piece, grouped=mode in ("blocks", "regions"),
                                         in_regions=mode == "regions"), whole)
    eager = _PerLayout(build, lambda f: f)

    def step(state: TrainState, batch: PyTree):
        fn = steps.get(state.params)
        if mode != "regions":
            return fn(state, batch)
        if hasattr(fn, "ready"):
            fn.ready(state)
        with regions.tracing():  # (trace_autograd_ops, Dynamo's region reuse mended, inductor's buffer reuse off)
            return fn(state, batch)

    step.uncompiled = lambda state, batch: eager.get(state.params)(state, batch)  # type: ignore[attr-defined]
    step.uncompiled_for = eager.for_layout  # type: ignore[attr-defined]  # the eager body of one layout
    return step


def _step_passes(options: dict | None) -> dict:
    """`torch.compile` options with functrain's post-grad passes added after the caller's: cheap held
    activations recomputed after the forward (`functrain.recompute`), then a sharded staged loss's
    kept blocks regathered for their backward (`parallel.reshard`), both no-ops on a graph without
    `mark_forward_done`; last, dropout-free efficient attention's seed and offset kept out of
    inductor's buffer reuse (`functrain.sdpa_seeds`: a CUDA step crashed without it). torch.compile
    takes a mode or options, not both: a `mode` becomes the inductor options it stands for
    (`torch._inductor.list_mode_options`, what torch.compile applies for it), so the passes run
    under a mode too."""
    from functrain.parallel.reshard import RegatherPass
    from functrain.recompute import RecomputePass
    from functrain.sdpa_seeds import SdpaSeedPass

    options = dict(options or {})
    if options.get("backend", "inductor") != "inductor" or (
            options.get("mode") is not None and options.get("options") is not None):
        return options  # (another backend; or both, which torch.compile refuses with its own error)
    mode = options.pop("mode", None)
    if mode is not None:  # ("default" stands for no options)
        from torch._inductor import list_mode_options

        inductor = dict(list_mode_options(mode, options.get("dynamic")))
    else:
        inductor = dict(options.get("options") or {})
    mine = inductor.get("post_grad_custom_post_pass")
    mine = [] if mine is None else list(mine) if isinstance(mine, (list, tuple)) else [mine]
    inductor["post_grad_custom_post_pass"] = _post_passes([*mine, RecomputePass(), RegatherPass(), SdpaSeedPass()])
    options["options"] = inductor
    return options


def _post_passes(passes: list):
    """`passes` as this torch's inductor takes `post_grad_custom_post_pass`: the list itself (torch
    2.13 runs a list in order), or one pass running them in turn (torch 2.11, the CUDA build the lent
    GPU machines carry, calls the option as one pass: "'list' object is not callable")."""
    from torch._inductor.fx_passes import post_grad

    return passes if hasattr(post_grad, "get_custom_graph_passes") else InTurn(passes)


class InTurn(CustomGraphPass):
    """One inductor graph pass that runs `passes` in order; its cache key is made of theirs.

    Example:
      >>> torch.compile(fn, options={"post_grad_custom_post_pass": InTurn([RecomputePass(), RegatherPass()])})
    """

    def __init__(self, passes: list):
        self.passes = list(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self):
        keys = tuple(p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.passes)
        return None if None in keys else keys  # (None: a member cannot be cached, so neither can this)


def _compile_mode(compile) -> "str | None":
    """`compile` as "step", "regions", "blocks" or None (eager)."""
    if compile is True or compile == "step":
        return "step"
    if compile is False or compile is None or compile == "off":
        return None
    if compile in ("blocks", "regions"):
        return compile
    raise ValueError(f"compile must be True/'step' (one graph), 'regions' (one graph, the block compiled once), "
                     f"'blocks' (a graph per stage kind) or False, got {compile!r}")


def _stage_compiled(loss_fn, options: dict | None):
    """`loss_fn` with each stage compiled on its own (`compile="blocks"`), or a clear error."""
    if not hasattr(loss_fn, "compile_stages"):
        raise ValueError(
            "compile='blocks' compiles a staged loss stage by stage, and this loss has no stages: build it "
            "with functrain.remat.staged_loss (e.g. gpt.make_loss_fn(template, staged=True)), or use compile=True"
        )
    return loss_fn.compile_stages(options)


def _make_update(optimizer, *, donate: bool, skip_nonfinite: bool, precision):
    """`update(state, aux, grads) -> (state, metrics)`: `apply_gradients`, then donation."""

    def update(state: TrainState, aux: dict, grads: PyTree):
        new_state, metrics = apply_gradients(state, grads, optimizer, aux=aux, skip_nonfinite=skip_nonfinite,
                                             precision=precision)
        if donate:
            new_state = layout_of(state.params).write_into(state, new_state)
        return new_state, metrics

    return update


def update_step(
    optimizer: optim.Transform,
    *,
    donate: bool = True,
    compile: bool = True,
    skip_nonfinite: bool = True,
    precision: "str | torch.dtype | precision_lib.Precision | None" = None,
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
    inner = _make_update(optimizer, donate=donate, skip_nonfinite=skip_nonfinite or prec.loss_scaling,
                         precision=prec)

    def update(state: TrainState, grads: PyTree, aux: dict | None = None):
        return inner(state, dict(aux or {}), grads)

    return compiling.maybe_compile(update, compile, compile_options)


def make_eval_step(
    loss_fn: LossFn,
    *,
    compile: "bool | str" = True,
    precision: "str | torch.dtype | precision_lib.Precision | None" = None,
    compile_options: dict | None = None,
) -> Callable[[TrainState, PyTree], dict]:
    """Builds `eval_step(state, batch) -> metrics` ({"loss": ..., **aux}), with no dropout key.

    Args:
      loss_fn: the same `(params, batch, key) -> (loss, aux)` as for training; it gets key=None.
      compile: True / "step": one `torch.compile(fullgraph=True)` graph; "regions": one graph, its
        blocks calls of one compiled region; "blocks": the staged loss's stage graphs (see
        `make_train_step`); False: eager.
      precision: compute precision, as for `make_train_step` (params and inputs are cast).
      compile_options: extra keyword arguments for `torch.compile`.

    Returns:
      The eval function; it never changes the state.

    Example:
      >>> eval_step = make_eval_step(loss_fn)
      >>> val_loss = eval_step(state, val_batch)["loss"]
    """

    prec = precision_lib.get(precision)
    mode = _compile_mode(compile)
    if mode == "blocks":  # the stages' own graphs (the no-grad ones the train step's recompute uses)
        loss_fn = _stage_compiled(loss_fn, compile_options)
    elif mode == "regions":  # (a forward only: neither of regions' torch mends is needed)
        loss_fn = regions.region_loss(loss_fn)

    def build(lay: Layout):
        """The eval function for params laid out as `lay`."""

        per_stage = lay.sharded and hasattr(loss_fn, "apply_sharded")

        def eval_step(state: TrainState, batch: PyTree):
            params, batch = precision_lib.to_compute(prec, state.params, batch)
            with torch.no_grad():
                if per_stage:  # each stage gathers its own params
                    loss, aux = loss_fn.apply_sharded(params, batch, None, layout=lay)
                else:
                    loss, aux = loss_and_aux(loss_fn(lay.gather(params), batch, None))
            return lay.mean_over_dp({M.LOSS: loss, **aux})

        return eval_step

    fns = _PerLayout(build, lambda f: compiling.maybe_compile(f, mode in ("step", "regions"), compile_options))

    def evaluate(state: TrainState, batch: PyTree):
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
