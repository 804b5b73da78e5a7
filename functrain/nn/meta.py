"""The meta-template check: `functrain.apply` never computes with a tensor that has no storage.

Internals: docs/internals.md "functrain.nn.meta".

Example:
    >>> unreplaced(template, params.keys())
    ('lm_head.weight',)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["meta_tensors", "refusal", "unreplaced"]


@torch.compiler.assume_constant_result  # a property of the module: computed, never traced
def meta_tensors(model: nn.Module) -> tuple[tuple[str, tuple[int, ...], bool], ...]:
    """(name, shape, is_parameter) of every parameter and buffer of `model` on the meta device.

    Args:
      model: a module (every name of a tied tensor is listed).

    Returns:
      A tuple in registration order.

    Example:
      >>> meta_tensors(template)[0]
      ('wte.weight', (256, 64), True)
    """
    found = []
    named = itertools.chain(
        ((n, t, True) for n, t in model.named_parameters(remove_duplicate=False)),
        ((n, t, False) for n, t in model.named_buffers(remove_duplicate=False)),
    )
    for name, t, is_param in named:
        if t is not None and t.device.type == "meta":
            found.append((name, tuple(t.shape), is_param))
    return tuple(found)


def unreplaced(model: nn.Module, given: Iterable[str]) -> list[tuple[str, tuple[int, ...], bool]]:
    """The meta tensors of `model` whose names are not in `given`."""
    given = set(given)
    return [entry for entry in meta_tensors(model) if entry[0] not in given]


def refusal(missing: list, given: dict) -> str:
    """The one-line error for meta tensors a call would read (naming them, a likely broken tie, the fixes)."""
    names = []
    for name, shape, is_param in missing[:6]:
        twin = next(
            (
                n
                for n, v in given.items()
                if hasattr(v, "shape") and tuple(v.shape) == shape and n.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]
            ),
            None,
        )
        kind = "parameter" if is_param else "buffer"
        names.append(
            f"{kind} {name} {list(shape)}" + (f" (tied to {twin}? `.to('meta')` unties weights)" if twin else "")
        )
    more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
    return (
        f"functrain.apply: the template would compute with {len(missing)} tensor(s) on the meta device that "
        f"neither the params nor the model state replace: {', '.join(names)}{more}; build the template "
        "under `with torch.device('meta'):` (which keeps ties) and pass every parameter in the params and "
        "every buffer in the model state (functrain.nn.buffers_of(real_module, persistent=False) for "
        "non-persistent ones), or build the template on a real device"
    )
