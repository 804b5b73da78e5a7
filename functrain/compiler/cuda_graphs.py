"""CUDA graphs for the compiled train step (`--config.cuda_graphs`), through inductor's cudagraph trees.

Internals: docs/internals.md "functrain.compiler.cuda_graphs".
"""

from __future__ import annotations

from typing import Any

import optree
import torch

__all__ = ["options", "prepare", "skips", "step_begin"]


def options() -> dict:
    """`torch.compile` keyword arguments that record the step as CUDA graphs.

    Returns:
      `{"mode": "reduce-overhead"}` (inductor's cudagraph trees), for `make_train_step(compile_options=...)`.

    Example:
      >>> step = make_train_step(loss_fn, opt, compile_options=cuda_graphs.options())
    """
    return {"mode": "reduce-overhead"}


def prepare(state: Any) -> Any:
    """Marks every tensor of `state` as a static input of the compiled step (its address stays put).

    Args:
      state: the train state, before the first (compiling) step.

    Returns:
      `state` itself (its tensors marked; no copy).

    Example:
      >>> state = cuda_graphs.prepare(state)
    """
    for leaf in optree.tree_leaves(state, none_is_leaf=False):
        if isinstance(leaf, torch.Tensor):
            torch._dynamo.mark_static_address(leaf, guard=False)  # a moved buffer re-records, never recompiles
    return state


def step_begin() -> None:
    """Starts a new step for cudagraph trees (the previous step's outputs may now be overwritten)."""
    torch.compiler.cudagraph_mark_step_begin()


def skips() -> int:
    """How many compiled graphs inductor has declined to record as CUDA graphs in this process."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])
