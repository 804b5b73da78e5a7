"""The loop's hooks: `Hook` with an `every`, `StepInfo`, and the built-in hooks the loop runs (logging,
evaluation, checkpoints, the skip watch, the profiler window, garbage collection).

Internals: docs/internals.md "functrain.trainer.hooks".
"""

from __future__ import annotations

import dataclasses
import gc
import math
import resource
from collections.abc import Callable

import torch

import functrain.metric_names as M
from functrain import tree as tree_lib
from functrain.errors import FunctrainError
from functrain.state import TrainState
from functrain.trainer import frozen as frozen_lib
from functrain.trainer import metrics as metrics_lib

__all__ = [
    "Eval",
    "GarbageCollection",
    "Hook",
    "Log",
    "Profiler",
    "SaveCheckpoints",
    "SkipWatch",
    "StepInfo",
    "TrainingError",
    "every",
]


class TrainingError(FunctrainError, RuntimeError):
    """A run cannot go on (non-finite loss, skipped updates, bad batch split, ...); the message says
    why and what to do."""


@dataclasses.dataclass
class StepInfo:
    """What a hook sees after a step.

    Attributes:
      step: the number of updates done (1 after the first step).
      state: the new `TrainState` (do not keep it past the call: the next step donates it).
      metrics: the step's metrics, device tensors (reading one syncs).
      final: this is the last step of the run (the run's `steps`, `stop_at` or a preemption).
    """

    step: int
    state: TrainState
    metrics: dict
    final: bool = False


class Hook:
    """Something the loop does every `every` steps: `after(info)` after those steps (and the last).

    Subclass it, or make one from a function with `every(n, fn)`. `before(step)` runs before each
    step (the profiler starts there), `close()` once at the end (errors included).
    """

    every: int = 1
    at_end: bool = True

    def before(self, step: int) -> None:
        """Called before each step (the number of updates done so far)."""

    def after(self, info: StepInfo) -> None:
        """Called after steps that are a multiple of `every` (and after the last, if `at_end`)."""

    def close(self) -> None:
        """Called once when the loop ends."""


class _FnHook(Hook):
    """A hook from a function."""

    def __init__(self, n: int, fn: Callable[[StepInfo], None], at_end: bool):
        if n < 1:
            raise ValueError(f"a hook's every must be >= 1, got {n}")
        self.every, self.fn, self.at_end = n, fn, at_end

    def after(self, info: StepInfo) -> None:
        self.fn(info)


def every(n: int, fn: Callable[[StepInfo], None], *, at_end: bool = True) -> Hook:
    """A hook calling `fn(info)` after every `n`-th step (and after the last one, if `at_end`).

    Args:
      n: the period in steps.
      fn: `fn(StepInfo) -> None`.
      at_end: also call it after the run's last step.

    Returns:
      A `Hook`.

    Example:
      >>> hooks = [loop.every(500, lambda info: save_ema(info.state))]
    """
    return _FnHook(n, fn, at_end)


# ---------------------------------------------------------------------------------------------
# Built-in hooks


class Log(Hook):
    """Writes the step's metrics (plus throughput, MFU, peak memory, the params' norm)."""

    def __init__(
        self,
        n,
        writer,
        throughput,
        device,
        skips_enabled,
        data_position=None,
        batches=None,
        param_norm=tree_lib.global_norm,
    ):
        self.every, self.writer, self.throughput, self.device = n, writer, throughput, device
        self.skips_enabled, self.data_position, self.batches = skips_enabled, data_position, batches
        self.param_norm = param_norm  # over the whole model (a pipeline's: over every stage)
        self.last: dict = {}
        self._waited, self._logged_step = 0.0, None

    def after(self, info):
        row = metrics_lib.to_python(info.metrics)
        for k in M.PER_STEP_FLAGS:  # about one step only; the total is logged
            row.pop(k, None)
        if not self.skips_enabled and not math.isfinite(row[M.LOSS]):
            raise TrainingError(
                f"loss is {row[M.LOSS]} at step {info.step}; lower optim.lr, enable optim.clip, or check the "
                "data (the last checkpoint is kept)"
            )
        row[M.PARAM_NORM] = float(self.param_norm(info.state.params))  # a pass: log steps only
        row.update(self.throughput.report(info.step))
        if M.TARGETS in row and M.STEP_TIME_S in row:  # the supervised tokens of this step, at the window's pace
            row[M.TARGETS_PER_S] = row[M.TARGETS] / row[M.STEP_TIME_S]
        row[M.PEAK_MEM_MB] = _peak_memory_mb(self.device)
        if self.batches is not None:  # the loop's wait for batches since the last log line, per step
            steps = max(1, info.step - self._logged_step) if self._logged_step is not None else self.every
            row[M.DATA_WAIT_MS] = 1e3 * (self.batches.wait_s - self._waited) / steps
            self._waited, self._logged_step = self.batches.wait_s, info.step
        if self.data_position is not None:
            row.update(self.data_position(info.step))
        self.writer.write(info.step, row)
        self.last = row


class Eval(Hook):
    """Mean loss of the eval step over the task's eval batches (weighted by their `targets` where the
    eval step counts them: the mean over every target token), and of the loss's own metrics as `val_<name>`
    (a preference loss's rewards)."""

    def __init__(self, n, eval_step, batches, writer):
        self.every, self.eval_step, self.batches, self.writer = n, eval_step, batches, writer
        self.val_loss = float("nan")
        self.first: dict = {}  # the loss's own metrics at the first evaluation and at the last ({step, val_<name>})
        self.last: dict = {}

    def after(self, info):
        sets = self.batches if isinstance(self.batches, dict) else {None: self.batches}
        if not any(sets.values()):  # no held-out batches (a GRPO run's prompts): nothing to evaluate
            return
        row: dict = {}
        every: list = []
        outs: list = []
        for name, batches in sets.items():
            rows = [self.eval_step(info.state, b) for b in batches]
            pairs = [(m[M.LOSS].detach().float(), _count(m)) for m in rows]
            every, outs = every + pairs, outs + rows
            if name is not None:
                row[f"{M.VAL_LOSS}/{name}"] = _weighted_mean(pairs)
        scalars = [k for k, v in (outs[0] if outs else {}).items() if k not in (M.LOSS, M.TARGETS) and v.numel() == 1]
        for key in scalars:
            row[f"val_{key}"] = _weighted_mean([(m[key].detach().float().reshape(()), _count(m)) for m in outs])
        self.val_loss = _weighted_mean(every)
        if scalars:
            self.last = {"step": info.step} | {f"val_{k}": row[f"val_{k}"] for k in scalars}
            self.first = self.first or self.last
        self.writer.write(info.step, {M.VAL_LOSS: self.val_loss, **row})


def _count(metrics: dict):
    """The eval step's count of targets, or None where it counts none."""
    return metrics[M.TARGETS].detach().float() if M.TARGETS in metrics else None


def _weighted_mean(pairs: list) -> float:
    """The mean of (loss, count or None) pairs, weighted by the counts when there are any."""
    losses = torch.stack([loss for loss, _ in pairs])
    if pairs[0][1] is None:
        return float(losses.mean())
    counts = torch.stack([c for _, c in pairs])
    return float((losses * counts).sum() / counts.sum().clamp(min=1))


class SaveCheckpoints(Hook):
    """Saves every `checkpoint.every` steps (the manager decides), and always at the end, with the
    record of the data the run trains on (`Task.data_record`); the frozen params (a LoRA base) are
    left out, their record (`functrain.trainer.frozen.record`) kept instead."""

    def __init__(self, manager, data_record: dict | None, frozen_record: dict | None = None):
        self.manager = manager
        records = {k: v for k, v in (("data", data_record), (frozen_lib.KEY, frozen_record)) if v}
        self.custom = {"functrain": records} if records else None

    def after(self, info):
        self.manager.save(info.step, frozen_lib.saved(info.state), force=info.final, custom_metadata=self.custom)
        if info.final:
            self.manager.wait()


class SkipWatch(Hook):
    """Stops the run once `limit` updates in a row were skipped (non-finite loss or grad norm).

    The step skips bad updates on the device and counts them; this reads the consecutive-skips
    counter at the log steps only (reading it is a host sync), so the run stops at the first log
    step with `limit` or more skipped in a row: within `limit + every - 1` skipped steps.
    """

    def __init__(self, limit, every, manager):
        self.limit, self.every, self.manager = limit, every, manager
        self.at_end = False

    def after(self, info):
        n = int(info.metrics.get(M.CONSECUTIVE_SKIPS, 0))
        if n < self.limit:
            return
        if self.manager is not None:
            self.manager.wait()  # a save in flight commits first: the message names what is really kept
        latest = self.manager.latest_step() if self.manager is not None else None
        kept = f"the last checkpoint (step {latest}) is kept" if latest is not None else "no checkpoint was written"
        done = info.step
        raise TrainingError(
            f"the update was skipped at {n} consecutive steps ({done - n + 1} to {done}): the loss or "
            f"the gradient norm was not finite; params are as after step {done - n}, {kept}. "
            f"Lower optim.lr, enable optim.clip, check the data near step {done - n + 1}, or raise "
            "max_consecutive_skips"
        )


class Profiler(Hook):
    """A torch.profiler trace of steps [start, stop) written to `<workdir>/profile`."""

    def __init__(self, start, stop, workdir, print_fn):
        self.start, self.stop, self.dir, self.print_fn = start, stop, workdir / "profile", print_fn
        self._prof = None
        self.at_end = False

    def before(self, step):
        if self.stop > self.start and step == self.start:
            self._prof = torch.profiler.profile(record_shapes=True, with_stack=False)
            self._prof.__enter__()

    def after(self, info):
        if self._prof is not None and info.step >= self.stop:
            self.close()

    def close(self):
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self.dir.mkdir(parents=True, exist_ok=True)
            path = self.dir / f"trace_steps_{self.start}_{self.stop}.json"
            self._prof.export_chrome_trace(str(path))
            self.print_fn(f"profiler trace of steps [{self.start}, {self.stop}) written to {path}")
            self._prof = None


class GarbageCollection(Hook):
    """Python's automatic collection off during training; the young generations (`gc.collect(1)`,
    as torchtitan's GarbageCollection) collected every `n` steps, on every rank at the same step, so
    no rank stalls the others' collectives at a random moment."""

    def __init__(self, n):
        self.every, self.at_end = n, False
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect(1)

    def after(self, info):
        gc.collect(1)

    def close(self):
        if self._was_enabled:
            gc.enable()


# ---------------------------------------------------------------------------------------------
# Run


def _peak_memory_mb(device: torch.device) -> float:
    """Peak memory so far: allocated device memory on CUDA, the process's max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
