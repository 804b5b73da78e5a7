"""`apply(model, params, *args)`: a module's forward with `params` in place of its parameters.

Internals: docs/internals.md "functrain.functional".

Example:
    >>> logits = functional.apply(model, state.params, x, dropout_key=key)   # (B, T, V)
    >>> logits, ms = functional.apply(cnn, params, x, model_state=ms)         # with buffers
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from functrain.nn import meta as meta_lib
from functrain.nn import mode as mode_lib

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
    for name, t in itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    ):
        names.setdefault(id(t), []).append(name)
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def apply(model: nn.Module, params: Any, *args, model_state: Any = None, train: bool | None = None, **kwargs):
    """Calls `model(*args, **kwargs)` with `params` in place of its parameters (functional_call).

    Args:
      model: the module (a real one or a storage-free template built on the "meta" device).
      params: {name: tensor} for every parameter (tied parameters under any one of their names).
      *args, **kwargs: the forward's arguments.
      model_state: optional {name: tensor} of buffers (`TrainState.model_state`). The module gets
        clones, updates them in place as it would its own buffers (BatchNorm's statistics in train
        mode), and the clones come back: the dict passed in is never written.
      train: run the module in training (True) or eval (False) mode for this call; None (default):
        the mode of the enclosing step (`make_train_step`: train, `make_eval_step`: eval), or the
        template's own outside any step. The template's flags are put back afterwards.

    Returns:
      Whatever the module's forward returns; with `model_state`, `(output, new_model_state)`.

    Raises:
      ValueError: the template would compute with a tensor on the meta device that `params` and
        `model_state` do not replace (one line naming them), or tied names given different tensors.

    Example:
      >>> logits = functrain.apply(model, state.params, x, dropout_key=key)
      >>> logits, ms = functrain.apply(cnn, params, x, model_state=state.model_state)
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
    tensors = params
    state = None
    if model_state is not None:
        state = {name: value.clone() for name, value in model_state.items()}  # the module updates these
        tensors = {**params, **state}
    missing = meta_lib.unreplaced(model, tensors.keys())  # (one walk of the template's tensors)
    if missing:
        raise ValueError(meta_lib.refusal(missing, tensors))
    flag = mode_lib.current() if train is None else train
    changed = mode_lib.switched(model, flag) if flag is not None else []
    watched = [] if torch.compiler.is_compiling() else _template_buffers(model, tensors)
    try:
        out = torch.func.functional_call(model, tensors, args, kwargs, tie_weights=False)
    finally:
        mode_lib.restore(changed)
    written = [n for n, b, version in watched if b._version != version]
    if written:
        raise ValueError(
            f"functrain.apply: the forward wrote into buffer(s) {', '.join(written[:3])} of the template, "
            "which the model state does not carry (non-persistent buffers); pass them in the model state "
            "(init_state(..., model_state=functrain.nn.buffers_of(module, persistent=False))) so the "
            "step updates them purely"
        )
    return out if state is None else (out, state)


def _template_buffers(model: nn.Module, given) -> list[tuple[str, torch.Tensor, int]]:
    """(name, buffer, its version counter) of the template's real buffers that `given` does not replace."""
    return [(n, b, b._version) for n, b in model.named_buffers() if n not in given and b.device.type != "meta"]
