"""TensorBoard scalars through torch's public writer, `torch.utils.tensorboard.SummaryWriter`.

Internals: docs/internals.md "functrain.trainer.tensorboard".

Example:
    >>> writer = TensorBoardWriter("runs/gpt/tb")
    >>> writer.write(100, {"loss": 2.13, "lr": 3e-4, "eta": "5m"})   # "eta" (not a number) is skipped
    >>> writer.close()
    # tensorboard --logdir runs/gpt/tb
"""

from __future__ import annotations

import importlib.util
import numbers
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["TensorBoardWriter", "available", "MISSING"]

MISSING = (
    "tensorboard events off: the tensorboard package is not installed (pip install tensorboard); "
    "metrics.jsonl has every metric"
)
"""The line the loop prints when `tensorboard=True` but the package is absent."""


def available() -> bool:
    """Whether the `tensorboard` package is installed (without importing it).

    Returns:
      True when `import tensorboard` would find the package.

    Example:
      >>> writer = TensorBoardWriter(logdir) if tensorboard.available() else None
    """
    return importlib.util.find_spec("tensorboard") is not None


def _scalar(value: Any) -> float | None:
    """`value` as a float when it is a real number (0-d tensors and numpy scalars too), else None."""
    if isinstance(value, (str, bytes)) or value is None:
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "ndim", None) == 0 or getattr(value, "shape", None) == ():  # torch / numpy 0-d
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    return None


class TensorBoardWriter:
    """Writes scalar metrics to a TensorBoard event file, the same interface as `metrics.JsonlWriter`.

    Args:
      logdir: directory for the event file (created if missing). Point `tensorboard --logdir` at
        it (or at its parent to compare runs).
      filename_suffix: appended to the file name (e.g. ".rank0").

    Raises:
      ModuleNotFoundError: the tensorboard package is not installed (`available()` is False).

    Example:
      >>> with TensorBoardWriter(workdir / "tb") as tb:
      ...     tb.write(step, {"loss": 2.1, "val_loss": 2.3})
    """

    def __init__(self, logdir: str | os.PathLike, filename_suffix: str = ""):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(str(self.logdir), filename_suffix=filename_suffix)
        self._closed = False

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Adds every numeric entry of `metrics` as a scalar at `step`, then flushes.

        Strings (e.g. "eta") and other non-numbers are skipped; 0-d tensors are read with `float()`.
        """
        now = time.time()
        wrote = False
        for k, v in metrics.items():
            x = _scalar(v)
            if x is not None:  # NaN / inf are written as such; TensorBoard shows them
                self._writer.add_scalar(str(k), x, global_step=int(step), walltime=now)
                wrote = True
        if wrote:
            self._writer.flush()  # TensorBoard tails the file: make each step visible at once

    def close(self) -> None:
        """Flushes and closes the file (idempotent)."""
        if not self._closed:
            self._closed = True
            self._writer.close()

    def __enter__(self) -> TensorBoardWriter:
        """The writer itself (closed on exit)."""
        return self

    def __exit__(self, *exc) -> None:
        """Closes the file."""
        self.close()
