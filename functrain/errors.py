"""`FunctrainError`: the base of every error functrain raises for bad input or an unusable resource.

Its message is one line naming the problem and the fix; `python -m functrain.main` prints it as
`functrain: error: <message>` and exits 1 (any other exception is a bug: its traceback is shown).

Example:
    >>> try:
    ...     train(config, workdir)
    ... except FunctrainError as exc:
    ...     print(f"functrain: error: {exc}")
"""

from __future__ import annotations

__all__ = ["FunctrainError"]


class FunctrainError(Exception):
    """A one-line error (config, data, checkpoint, export, training): what is wrong and what to do.

    Each package's own error derives from it and from the builtin it always was (`ConfigError` and
    `DataError` from `ValueError`, `TrainingError` from `RuntimeError`, ...), so `except ValueError` still
    catches what it caught.

    Example:
      >>> isinstance(ConfigError("lr=-1 is out of range"), FunctrainError)
      True
    """
