"""The trainer: the application built on the functrain library, which the library never imports.

Internals: docs/internals.md "functrain.trainer".

Example:
    >>> from functrain.trainer import loop
    >>> loop.run(task, optimizer, config, "runs/x", ctx, hooks=[loop.every(100, probe)])
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

if TYPE_CHECKING:  # the public names; at run time each loads on first use (functrain._lazy)
    from functrain.trainer import (
        defaults,
        hooks,
        loop,
        main,
        memory,
        metrics,
        optimizer,
        optimizer_checks,
        plot,
        restore,
        route,
        validate,
    )
    from functrain.trainer.hooks import Hook, StepInfo, TrainingError, every
    from functrain.trainer.loop import run

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
