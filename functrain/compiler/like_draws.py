"""Routes `torch.rand_like`, `randn_like` and `randint_like` through torch function modes under Dynamo.

Internals: docs/internals.md "functrain.compiler.like_draws".

Example:
    >>> like_draws.route()
"""

from __future__ import annotations

import torch

__all__ = ["LIKES", "route", "dynamo_set", "dynamo_misses_them"]

LIKES = (torch.rand_like, torch.randn_like, torch.randint_like)


def dynamo_set() -> set:
    """Dynamo's set of functions it dispatches to torch function modes (cached by Dynamo)."""
    from torch._dynamo.variables import torch as dynamo_torch

    return dynamo_torch.get_overridable_functions()


def dynamo_misses_them() -> bool:
    """Whether torch itself (overrides and device constructors) leaves the three out of Dynamo's set."""
    from itertools import chain

    from torch.utils._device import _device_constructors

    theirs = set(chain.from_iterable(torch.overrides.get_overridable_functions().values())) | _device_constructors()
    return not any(f in theirs for f in LIKES)


def route() -> None:
    """Adds the three `_like` draws to Dynamo's mode-dispatched functions (idempotent)."""
    dynamo_set().update(LIKES)
