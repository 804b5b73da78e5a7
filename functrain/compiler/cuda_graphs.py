"""CUDA graphs for the compiled train step (`--config.cuda_graphs`), through inductor's cudagraph trees.

A launch-bound step (a small model: hundreds of short kernels, each launched by the host) spends its
time launching; replayed as a CUDA graph, the whole step is one launch. Inductor warms the compiled
step up on its first call, records it on the second and replays it from then on. What that asks of
the step, and how the loop meets it:

- every tensor the graph reads on the one CUDA device: the state's hyper-parameters and counters
  live on the params' device, the batch is copied there before the step;
- the donated state at fixed addresses: the step writes the new state into its input buffers (an
  input mutation, which cudagraph trees accept for static inputs only), so `prepare` marks every
  state tensor static before the step is compiled; donation keeps the addresses from step to step;
- a step boundary: `step_begin()` before each step tells the trees that the previous step's outputs
  (its metrics) may be overwritten. Read a step's metrics before the next step runs, as the loop's
  hooks do; the async checkpoint copies the state on the step's stream before the next step is
  queued, so it never reads a buffer the next replay overwrites.

`skips()` counts the steps inductor refused to record (a CPU tensor in the graph, a mutated input
that is not static): the loop compares it before and after the first step and stops with one line
instead of running on silently without graphs.
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
