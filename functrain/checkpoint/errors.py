"""The one exception type the checkpoint package raises for bad or unusable checkpoints."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing, uncommitted, corrupt, or does not fit the template.

    The message is a single line that names the checkpoint path, the leaf (when one is
    involved), what is wrong and what to do about it.
    """


def one_line(e: BaseException, limit: int = 240) -> str:
    """An exception as one short line: ``Type: message`` with whitespace collapsed, truncated."""
    text = " ".join(str(e).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}"
