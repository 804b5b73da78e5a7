"""How this rank trains: the state, steps and reports of one process (possibly sharded) or of a pipeline rank.

Internals: docs/internals.md "functrain.trainer.route".

Example:
    >>> state, route = choose(task, optimizer, config, ctx, device, compile=True, compile_options=None)
    >>> state, metrics = route.train_step(state, batch)
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from functrain import config_checks, parallel
from functrain import rng as rng_lib
from functrain import tree as tree_lib
from functrain.optim.base import Transform
from functrain.parallel import pipeline
from functrain.state import TrainState, init_state
from functrain.step import make_eval_step, make_train_step
from functrain.task import Task
from functrain.trainer import frozen as frozen_lib

__all__ = ["Route", "choose", "microbatching"]


@dataclasses.dataclass
class Route:
    """This rank's steps, and what differs between one process and a pipeline rank.

    Attributes:
      train_step, eval_step: `step(state, batch) -> (state, metrics)` and `eval_step(state, batch) -> metrics`.
      param_norm: the global norm of a params tree (over every pipeline rank where pipelined).
      whole: whether `state` is the whole model's tree (a checkpoint leaf it lacks is an error on restore).
      banner: what the run's first line adds after the mesh ("" for one process).
      finish: `finish(state) -> (results, note)`: the task's end-of-run results and a line to print
        instead when there are none (None otherwise).
    """

    train_step: Callable
    eval_step: Callable
    param_norm: Callable
    whole: bool
    banner: str
    finish: Callable[[TrainState], tuple[dict, str | None]]


def microbatching(config: Any, ctx: parallel.ParallelContext) -> tuple[str, int]:
    """(the config key, its value) that cuts each batch: `pp.microbatches` on a pipeline, else `accum_steps`."""
    if ctx.pp_world > 1:
        return "pp.microbatches", config.pp.microbatches
    return "accum_steps", config.accum_steps


def choose(
    task: Task,
    optimizer: Transform,
    config: Any,
    ctx: parallel.ParallelContext,
    device,
    compile: bool | str,
    compile_options: dict | None,
) -> tuple[TrainState, Route]:
    """This rank's fresh state and its `Route`: a pipeline rank's when `ctx.pp_world > 1`, else one process's.

    Args:
      task: the model family's `Task`.
      optimizer: the `functrain.optim.Transform` to train with.
      config: the run's config (the loop's keys).
      ctx: the parallel context (`functrain.parallel.setup`).
      device: the device to compute on.
      compile: the step's compile mode (False, True or "blocks").
      compile_options: extra keyword arguments for `torch.compile` (CUDA graphs' options), or None.

    Returns:
      `(state, route)`: the fresh `TrainState` (this rank's params, sharded on the mesh) and the `Route`.

    Raises:
      config_checks.ConfigError: a pipeline asked of a run it cannot carry (CUDA graphs, model state, too
        many stages), in one line.

    Example:
      >>> state, route = choose(task, opt, config, ctx, torch.device("cpu"), compile=True, compile_options=None)
    """
    if ctx.pp_world > 1:
        return _pipeline(task, optimizer, config, ctx, device, compile)
    params, frozen = frozen_lib.split(task, _init_params(task, rng_lib.key(config.seed), device, ctx))
    model_state = task.init_model_state(device) if task.init_model_state is not None else None
    # moments mirror the placements; the model state is replicated (plain tensors on every rank); the
    # frozen params (a LoRA base) are sharded like the params, with no optimizer state
    state = init_state(params, optimizer, seed=config.seed, copy=False, model_state=model_state, frozen=frozen)
    del params, model_state, frozen
    fullgraph = bool(config.fullgraph)
    train_step = make_train_step(
        task.loss_fn,
        optimizer,
        accum_steps=config.accum_steps,
        compile=compile,
        donate=config.donate,
        precision=config.precision,
        skip_nonfinite=config.max_consecutive_skips > 0,
        compile_options=compile_options,
        fullgraph=fullgraph,
        model_state_sync=config.model_state_sync,
        count_targets=task.count_targets,
    )
    eval_step = make_eval_step(
        task.loss_fn, compile=compile, precision=config.precision, fullgraph=fullgraph, count_targets=task.count_targets
    )

    def finish(state: TrainState) -> tuple[dict, None]:
        """On every rank: a sharded task gathers stage by stage (collectives), never the whole model."""
        return task.finish(frozen_lib.merged(state), rng_lib.fold_in(state.rng, state.step)), None

    return state, Route(train_step, eval_step, tree_lib.global_norm, whole=True, banner="", finish=finish)


def _pipeline(
    task: Task, optimizer: Transform, config: Any, ctx: parallel.ParallelContext, device, compile: bool | str
) -> tuple[TrainState, Route]:
    """A pipeline rank's route: only its stages' params are drawn, sharded over the stage's mesh."""
    if config.cuda_graphs:
        raise config_checks.ConfigError(
            "cuda_graphs=True records one step graph; a pipeline runs a schedule of stage "
            "graphs: drop --config.cuda_graphs or set --config.mesh.pp=1"
        )
    if task.init_model_state is not None:
        raise config_checks.ConfigError(
            "this model has model state (buffers such as BatchNorm statistics) and the "
            "pipeline's stages carry params only: set --config.mesh.pp=1"
        )
    key = rng_lib.key(config.seed)
    try:
        pipe = pipeline.place(task.loss_fn, pipeline.param_shapes(task.init_params, key), group=ctx.pp_group)
    except ValueError as exc:
        raise config_checks.ConfigError(f"{exc} (--config.mesh.pp)") from None
    params, frozen = frozen_lib.split(
        task, parallel.init_sharded(task.init_params, key, ctx.mesh, task.shard_rules, device=device, names=pipe.names)
    )
    state = init_state(params, optimizer, seed=config.seed, copy=False, frozen=frozen)  # this rank's stages
    staged = bool(compile)  # a pipeline's stages always compile one by one
    train_step = pipeline.make_pipeline_step(
        pipe,
        optimizer,
        microbatches=config.pp.microbatches,
        schedule=config.pp.schedule,
        compile=staged,
        donate=config.donate,
        precision=config.precision,
        skip_nonfinite=config.max_consecutive_skips > 0,
        count_targets=task.count_targets,
    )
    eval_step = pipeline.make_pipeline_eval_step(pipe, compile=staged, precision=config.precision)
    note = (
        f"finish skipped: the params are split over {ctx.pp_world} pipeline stages (sample from the final "
        "checkpoint on one mesh)"
    )
    banner = f" x pp={ctx.pp_world} ({config.pp.schedule}, {config.pp.microbatches} microbatches)"
    return state, Route(
        train_step,
        eval_step,
        lambda tree: pipeline.global_norm(pipe, tree),
        whole=False,
        banner=banner,
        finish=lambda state: ({}, note),
    )


def _init_params(task: Task, key, device, ctx):
    """The task's fresh params: each rank draws only its shards when the task's init takes `where`,
    else the whole tree is made and sharded one parameter at a time."""
    if ctx.mesh is None:
        return task.init_params(key, device)
    if "where" in inspect.signature(task.init_params).parameters:
        return parallel.init_sharded(task.init_params, key, ctx.mesh, task.shard_rules, device=device)
    params = task.init_params(key, device)
    return parallel.shard_params(params.items(), ctx.mesh, task.shard_rules)
