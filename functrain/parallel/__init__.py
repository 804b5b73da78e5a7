"""Parallel training: process groups and the DeviceMesh, sharding rules, tensor and context parallelism.

Internals: docs/internals.md "functrain.parallel".

Example:
    >>> ctx = parallel.setup(config.mesh)                       # torchrun env -> process group + mesh
    >>> rules = parallel.default_rules(gpt.TP_RULES)
    >>> state = parallel.shard_state(init_state(template_or_model, opt), ctx.mesh, rules)
    >>> model = parallel.tensor_parallel(template, ctx.mesh, rules)   # use in the loss function
    >>> step = make_train_step(loss_fn, opt)
    >>> state, metrics = step(state, local_batch)
    >>> parallel.teardown()
"""

from functrain.config_checks import mesh_shape
from functrain.parallel import (
    context,  # context-parallel attention (sequence split over ranks)
    gloo,  # gloo groups with one worker thread (a torch heap-corruption bug)
    pipeline_schedule,  # pipeline schedules and stage partitions (pure)
    spmd,  # registers the mesh-wide norm with functrain.tree
)
from functrain.parallel.data import data_parallel_kwargs, split_batch
from functrain.parallel.dispatch import configure, layout_of
from functrain.parallel.layout import LOCAL, Layout, Local, is_dtensor
from functrain.parallel.mesh import (
    AXES,
    CP_AXIS,
    DP_AXES,
    GRAD_AXES,
    PP_AXIS,
    TP_AXIS,
    ParallelContext,
    barrier,
    dp_coordinates,
    is_main_process,
    rank,
    setup,
    teardown,
    world_size,
)
from functrain.parallel.sharding import (
    FSDP_RULES,
    Rule,
    active_mesh,
    default_rules,
    gather,
    init_sharded,
    placements_for,
    shard_params,
    shard_state,
    tp_rules,
)
from functrain.parallel.tp import adapter_rules, copy_to_tp, reduce_from_tp, tensor_parallel

__all__ = [
    "LOCAL",
    "Layout",
    "Local",
    "is_dtensor",
    "configure",
    "layout_of",
    "dp_coordinates",
    "context",
    "pipeline_schedule",
    "gloo",
    "spmd",
    "AXES",
    "CP_AXIS",
    "PP_AXIS",
    "DP_AXES",
    "GRAD_AXES",
    "TP_AXIS",
    "FSDP_RULES",
    "ParallelContext",
    "Rule",
    "active_mesh",
    "barrier",
    "copy_to_tp",
    "data_parallel_kwargs",
    "default_rules",
    "gather",
    "init_sharded",
    "is_main_process",
    "mesh_shape",
    "placements_for",
    "rank",
    "reduce_from_tp",
    "setup",
    "shard_params",
    "shard_state",
    "split_batch",
    "teardown",
    "tensor_parallel",
    "adapter_rules",
    "tp_rules",
    "world_size",
]
