"""Train and eval modes, set by the step that runs a module rather than left to its template.

Internals: docs/internals.md "functrain.nn.mode".

Example:
    >>> with mode.running(train=False):
    ...     logits = functrain.apply(model, params, x)      # eval mode, whatever model.training is
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["current", "restore", "running", "switched"]


class _Mode:
    """The mode the enclosing step set (a plain object: Dynamo traces its writes inside a compiled step)."""

    def __init__(self):
        # an instance attribute from the start: a step that enters `running` inside its graph (the
        # population's) is guarded on this object's __dict__, which must not change from call to call
        self.train: bool | None = None


_STATE = _Mode()


def current() -> bool | None:
    """The mode the enclosing step asks for: True (train), False (eval), or None outside any step.

    Returns:
      A bool, or None where no step set one (then `functrain.apply` leaves the module's own mode).

    Example:
      >>> mode.current()
      None
    """
    return _STATE.train


@contextlib.contextmanager
def running(train: bool | None) -> Iterator[None]:
    """Runs the block with `functrain.apply` in train (True) or eval (False) mode; None: the template's.

    Args:
      train: the mode modules run in inside the block.

    Example:
      >>> with mode.running(train=True):
      ...     loss = loss_fn(params, batch, key)
    """
    before = current()
    _STATE.train = train
    try:
        yield
    finally:
        _STATE.train = before


def switched(model: nn.Module, train: bool) -> list[tuple[nn.Module, bool]]:
    """Sets every submodule's `training` flag to `train`; returns [(module, flag before)] to restore.

    Args:
      model: the module.
      train: the mode to run in.

    Returns:
      The submodules whose flag changed, with their old flags (`restore` puts them back).

    Example:
      >>> changed = switched(model, False); ...; restore(changed)
    """
    changed = []
    for m in model.modules():
        if m.training != train:
            changed.append((m, m.training))
            m.training = train
    return changed


def restore(changed: list[tuple[nn.Module, bool]]) -> None:
    """Puts back the flags `switched` changed."""
    for m, flag in changed:
        m.training = flag
