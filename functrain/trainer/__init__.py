"""The trainer: the application built on the functrain library, which the library never imports.

* `main`: the command line (`python -m functrain.main --config=configs/gpt.py`), config loading and
  checks, the parallel context, and the run or the export;
* `loop`: runs any model family's `Task` on the `route` it chooses (one process, or a pipeline rank); `hooks` (`Hook`
with an `every`, the built-in hooks),
  `restore` (resuming a workdir), `preemption` (SIGTERM and Ctrl-C);
* `defaults` and `validate`: the run config's defaults and the loop's own checks;
* `metrics` and `tensorboard`: the metric writers and the throughput/MFU meter; `plot`: loss curves;
* `workdir_lock`: one run per workdir; `memory`: the host allocator's setting.

Example:
    >>> from functrain.trainer import loop
    >>> loop.run(task, optimizer, config, "runs/x", ctx, hooks=[loop.every(100, probe)])
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

if TYPE_CHECKING:  # the public names; at run time each loads on first use (functrain._lazy)
    from functrain.trainer import defaults, hooks, loop, main, memory, metrics, plot, restore, route, validate
    from functrain.trainer.hooks import Hook, StepInfo, TrainingError, every
    from functrain.trainer.loop import run

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
