"""The one exception type the checkpoint package raises for bad or unusable checkpoints."""

from __future__ import annotations

from functrain.errors import FunctrainError


class CheckpointError(FunctrainError, ValueError):
    """A checkpoint is missing, uncommitted, corrupt, or does not fit the template.

    The message is a single line that names the checkpoint path, the leaf (when one is
    involved), what is wrong and what to do about it.
    """


class MismatchError(CheckpointError):
    """The checkpoint does not fit the template: leaves are extra or missing, or one has another
    shape or dtype. `leaves` names them (all the extra or missing ones; the first of another shape or
    dtype, in template order). A program that restores its own state (the training loop) can tell
    what changed, e.g. only the optimizer, and say how to go on."""

    def __init__(self, message: str, leaves):
        super().__init__(message)
        self.leaves = tuple(leaves)


def one_line(e: BaseException, limit: int = 240) -> str:
    """An exception as one short line: ``Type: message`` with whitespace collapsed, truncated."""
    text = " ".join(str(e).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}"
