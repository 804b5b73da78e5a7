"""The training state: one pure pytree holding everything a run needs to continue."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from functrain import rng as rng_lib
from functrain import tree as tree_lib
from functrain.optim.base import Transform

__all__ = ["TrainState", "init_state", "params_of"]

PyTree = Any


class TrainState(NamedTuple):
    """Params, optimizer state, step counter and RNG key, as one pytree.

    A NamedTuple is a native node for optree, `torch.utils._pytree` and `torch.compile`, so the
    whole state flattens, maps, compiles and checkpoints with no registration. Keep every dict in
    it in one fixed key order: the compiled step guards on it.

    Attributes:
      params: {dotted parameter name: tensor}, in `model.named_parameters()` order.
      opt_state: the optimizer's state (a pytree of tensors).
      step: int64 0-d tensor, the number of updates done.
      rng: int64 key of shape (2,) (see `functrain.rng`); per-step keys are
        `rng.fold_in(state.rng, state.step)`, so the key itself never changes.
    """

    params: PyTree
    opt_state: PyTree
    step: torch.Tensor
    rng: torch.Tensor

    def replace(self, **changes) -> "TrainState":
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


def init_state(
    model_or_params: nn.Module | PyTree,
    optimizer: Transform,
    seed: int = 0,
    *,
    copy: bool = True,
) -> TrainState:
    """Builds the initial `TrainState` from a model (or a params tree) and an optimizer.

    Args:
      model_or_params: an initialized `nn.Module` (its parameters are taken, see `params_of`),
        or a pytree of parameter tensors.
      optimizer: a `functrain.optim.Transform`.
      seed: seeds the state's RNG key (`rng.key(seed)`); parameter init is the model's business.
      copy: clone the parameters, so that the state owns its buffers and a donating step never
        writes into the module (default True).

    Returns:
      A `TrainState` with `step == 0` on the params' device.

    Example:
      >>> torch.manual_seed(0)
      >>> state = init_state(GPT(cfg), optim.adamw(3e-4), seed=0)
    """
    if isinstance(model_or_params, nn.Module):
        params = params_of(model_or_params)
    else:
        params = model_or_params
    if copy:
        params = tree_lib.map(lambda v: v.detach().clone(), params)
    first = next(iter(tree_lib.leaves(params)), None)
    device = first.device if first is not None else None
    return TrainState(
        params=params,
        opt_state=optimizer.init(params),
        step=torch.zeros((), dtype=torch.int64, device=device),
        rng=rng_lib.key(seed, device=device),
    )
