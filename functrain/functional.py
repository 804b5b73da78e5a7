"""`apply(model, params, *args)`: a module's forward with `params` in place of its parameters.

This is `torch.func.functional_call` with the module's tied names (the GPT's `lm_head.weight` is
`wte.weight`) looked up once per module instead of at every call. functional_call's own weight
tying walks every parameter and buffer of the module on each call; traced by torch.compile, that
walk was 12% of a tiny GPT train step's Dynamo trace (docs/results.md, "Compile time"). Here the
groups of tied names are a constant of the module (`tied_names`, which torch.compile calls
instead of tracing), and functional_call runs with `tie_weights=False` on a dict that already
names every tied copy.

Example:
    >>> logits = functional.apply(model, state.params, x, dropout_key=key)   # (B, T, V)
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

__all__ = ["apply", "tied_names"]


@torch.compiler.assume_constant_result  # a property of the module: computed, never traced
def tied_names(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """The groups of names under which `model` holds one tensor (parameters and buffers).

    Args:
      model: a module (a meta-device template is fine).

    Returns:
      One tuple of names per tensor reachable under more than one name, in registration order.

    Example:
      >>> functional.tied_names(gpt.GPT(cfg))
      (('wte.weight', 'lm_head.weight'),)
    """
    names: dict[int, list[str]] = {}
    for name, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                   model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(name)
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def apply(model: nn.Module, params: Any, *args, **kwargs):
    """Calls `model(*args, **kwargs)` with `params` in place of its parameters (functional_call).

    Args:
      model: the module (a real one or a storage-free template built on the "meta" device).
      params: {name: tensor} for every parameter (tied parameters under any one of their names).
      *args, **kwargs: the forward's arguments.

    Returns:
      Whatever the module's forward returns.

    Example:
      >>> logits = functrain.apply(model, state.params, x, dropout_key=key)
    """
    groups = tied_names(model)
    if groups:
        params = dict(params)
        for group in groups:
            given = [n for n in group if n in params]
            if not given:
                continue
            value = params[given[0]]
            if any(params[n] is not value for n in given[1:]):
                raise ValueError(f"tied parameters {given} were given different tensors; give one of them")
            params.update((n, value) for n in group)
    return torch.func.functional_call(model, params, args, kwargs, tie_weights=False)
