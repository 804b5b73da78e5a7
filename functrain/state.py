"""The training state: one pure pytree holding everything a run needs to continue."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import nn

from functrain import rng as rng_lib
from functrain import tree as tree_lib
from functrain.nn.model_state import buffers_of
from functrain.optim.base import Transform

__all__ = ["Guard", "TrainState", "init_guard", "init_state", "params_of"]

PyTree = Any


DEFAULT_LOSS_SCALE = 2.0**16
"""Initial dynamic loss scale (torch.amp.GradScaler's default); used only under fp16 precision."""


class Guard(NamedTuple):
    """The train step's safety counters and dynamic loss scale (all 0-d tensors, in the state).

    Attributes:
      skipped: int64, updates skipped so far because the loss or the grad norm was not finite.
      consecutive: int64, updates skipped in a row up to now (0 after a good step).
      loss_scale: float32, the dynamic loss scale (read only under fp16 precision).
      good_steps: int64, finite steps since the loss scale last changed.
    """

    skipped: torch.Tensor
    consecutive: torch.Tensor
    loss_scale: torch.Tensor
    good_steps: torch.Tensor


def init_guard(device: torch.device | str | None = None, loss_scale: float = DEFAULT_LOSS_SCALE) -> Guard:
    """A fresh `Guard`: no skips, `loss_scale` as the starting dynamic loss scale.

    Args:
      device: where the counters live (the params' device).
      loss_scale: the initial dynamic loss scale (fp16 only).

    Returns:
      A `Guard` of 0-d tensors.

    Example:
      >>> state = state.replace(guard=init_guard(loss_scale=2.0**12))
    """
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return Guard(zero, zero.clone(), torch.tensor(loss_scale, dtype=torch.float32, device=device), zero.clone())


class TrainState(NamedTuple):
    """Params, optimizer state, step counter, RNG key and model state, as one pytree.

    A NamedTuple is a native node for optree, `torch.utils._pytree` and `torch.compile`, so the
    whole state flattens, maps, compiles and checkpoints with no registration. Keep every dict in
    it in one fixed key order: the compiled step guards on it.

    Attributes:
      params: {dotted parameter name: tensor}, in `model.named_parameters()` order.
      opt_state: the optimizer's state (a pytree of tensors).
      step: int64 0-d tensor, the number of updates done.
      rng: int64 key of shape (2,) (see `functrain.rng`); per-step keys are
        `rng.fold_in(state.rng, state.step)`, so the key itself never changes.
      guard: a `Guard`: skipped-update counters and the fp16 dynamic loss scale.
      model_state: {dotted buffer name: tensor}: the module's buffers that a forward reads or
        updates (BatchNorm's running statistics and counters; `functrain.nn.model_state`); empty
        for a model without them. Replicated on a mesh (plain tensors, the same on every rank).
      frozen: {dotted parameter name: tensor}: parameters the loss reads but the step never trains
        (a LoRA run's base weights, `functrain.nn.lora`): the loss gets `{**frozen, **params}`, no
        gradient is taken for them, they have no optimizer state and the step returns them as they
        came (never written, never donated). Sharded like `params` on a mesh; empty otherwise.
    """

    params: PyTree
    opt_state: PyTree
    step: torch.Tensor
    rng: torch.Tensor
    guard: Guard
    model_state: PyTree = {}
    frozen: PyTree = {}

    def replace(self, **changes: Any) -> TrainState:
        """A copy with some fields replaced: `state.replace(step=state.step + 1)`."""
        return self._replace(**changes)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters as a {name: detached tensor} dict sharing the module's storage.

    Args:
      model: an `nn.Module`; tied parameters appear once (under their first name).

    Returns:
      A dict in `named_parameters()` order, each value a plain tensor (`requires_grad=False`).

    Example:
      >>> params = params_of(GPT(cfg))
    """
    return {name: p.detach() for name, p in model.named_parameters()}


def _named(tree: PyTree) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) of every tensor leaf of `tree`."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    return [(".".join(map(str, p)), x) for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)]


def init_state(
    model_or_params: nn.Module | PyTree,
    optimizer: Transform,
    seed: int = 0,
    *,
    copy: bool = True,
    model_state: PyTree = None,
    frozen: PyTree = None,
) -> TrainState:
    """Builds the initial `TrainState` from a model (or a params tree) and an optimizer.

    Args:
      model_or_params: an initialized `nn.Module` (its parameters are taken, see `params_of`, and
        its persistent buffers as the model state, see `functrain.nn.buffers_of`), or a pytree of
        parameter tensors.
      optimizer: a `functrain.optim.Transform`.
      seed: seeds the state's RNG key (`rng.key(seed)`); parameter init is the model's business.
      copy: clone the parameters (and buffers), so that the state owns its tensors and a donating
        step never writes into the module (default True).
      model_state: {name: tensor} of buffers, when they are given explicitly (a params tree, or a
        meta template's buffers made elsewhere); default: the module's, or none for a params tree.
      frozen: {name: tensor} of parameters the loss reads and the step does not train (a LoRA
        run's base: `functrain.nn.lora`); no optimizer state is made for them. Not copied.

    Returns:
      A `TrainState` with `step == 0` on the params' device.

    Example:
      >>> torch.manual_seed(0)
      >>> state = init_state(GPT(cfg), optim.adamw(3e-4), seed=0)
    """
    params: PyTree
    if isinstance(model_or_params, nn.Module):
        params = params_of(model_or_params)
        if model_state is None:
            model_state = buffers_of(model_or_params)
    else:
        params = model_or_params
    model_state = {} if model_state is None else dict(model_state)
    frozen = {} if frozen is None else dict(frozen)
    both = [n for n in frozen if isinstance(params, dict) and n in params]
    if both:
        raise ValueError(
            f"functrain.init_state: {', '.join(both[:3])} is both trained (params) and frozen; give each "
            "parameter to one of them"
        )
    on_meta = [n for n, v in (*_named(params), *_named(model_state), *_named(frozen)) if v.device.type == "meta"]
    if on_meta:
        listed = ", ".join(on_meta[:3]) + (", ..." if len(on_meta) > 3 else "")
        raise ValueError(
            f"functrain.init_state: {len(on_meta)} tensor(s) are on the meta device ({listed}): a meta "
            "template has no numbers; pass real params (a "
            "family's init_params, or the module built on a real device) and keep the template for apply"
        )
    if copy:
        params = tree_lib.map(lambda v: v.detach().clone(), params)
        model_state = tree_lib.map(lambda v: v.detach().clone(), model_state)
    first = next(iter(tree_lib.leaves(params)), None)
    device = first.device if first is not None else None
    return TrainState(
        params=params,
        opt_state=optimizer.init(params),
        step=torch.zeros((), dtype=torch.int64, device=device),
        rng=rng_lib.key(seed, device=device),
        guard=init_guard(device),
        model_state=model_state,
        frozen=frozen,
    )
