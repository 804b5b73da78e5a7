"""The training loop: runs any `functrain.task.Task`, and knows no model.

`run(task, optimizer, config, workdir, ctx)` builds the state (params from the task, sharded by its
rules, optimizer state made from the sharded params), the compiled train and eval steps, restores
the latest checkpoint (compiling while the bytes stream in), then steps. Everything periodic is a
`Hook` with an `every`: logging, evaluation, checkpointing, the skip watch, the profiler window and
garbage collection are built-in hooks, and research code adds its own the same way:

    >>> def probe(info):
    ...     print(info.step, float(info.metrics["grad_norm"]))
    >>> loop.run(task, opt, config, "runs/x", ctx, hooks=[loop.every(100, probe)])

A hook is called after each step whose number is a multiple of its `every` (and after the last
step, unless `at_end=False`) with a `StepInfo`: the step number, the new state and the step's
metrics (device tensors: reading one syncs). Between log steps the loop itself reads no tensor value
(the skip watch and the NaN check read at log steps, preemption is agreed one step late over the
host), so on an accelerator the host queues steps ahead of the device. Preemption (SIGTERM), a first
Ctrl-C and `stop_at` end the run with a checkpoint of the current step (a second Ctrl-C stops at
once); restarting the same command resumes it bit-exactly. One run per workdir: the main process
holds `<workdir>/.lock` while it runs (`functrain.workdir_lock`), so a second run started on the same
workdir stops with one line instead of deleting the first's checkpoints.

The loop's own config keys (`functrain.validate.LOOP_CHECKS`): steps, stop_at, batch_size,
accum_steps, log_every, eval_every, compile, fullgraph, model_state_sync, compile_cache, cuda_graphs,
donate, peak_flops, deterministic, precision, max_consecutive_skips, tensorboard, device, host_memory,
gc_every, seed, checkpoint.*, profile.*.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import json
import math
import resource
import signal
import subprocess
import functools
import sys
import time
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import numpy as np
import torch

from functrain import checkpoint as ckpt_lib
from functrain.data import record as data_record_lib
from functrain.data.prefetch import Prefetcher
from functrain import memory, parallel
from functrain.parallel import pipeline
from functrain.compiler import cache as compile_cache
from functrain.compiler import cuda_graphs
from functrain import metric_names as M
from functrain import metrics as metrics_lib
from functrain import rng as rng_lib
from functrain import tree as tree_lib
from functrain import tensorboard as tensorboard_lib
from functrain import validate, workdir_lock
from functrain import optim as optim_lib
from functrain.optim.base import Transform
from functrain.state import TrainState, init_state
from functrain.step import make_eval_step, make_train_step
from functrain.task import Task

__all__ = ["Hook", "StepInfo", "TrainingError", "checkpoint_path", "every", "resolve_device", "run"]


class TrainingError(RuntimeError):
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


class _Log(Hook):
    """Writes the step's metrics (plus throughput, MFU, peak memory, the params' norm)."""

    def __init__(self, n, writer, throughput, device, skips_enabled, data_position=None, batches=None,
                 param_norm=tree_lib.global_norm):
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
        row[M.PEAK_MEM_MB] = _peak_memory_mb(self.device)
        if self.batches is not None:  # the loop's wait for batches since the last log line, per step
            steps = max(1, info.step - self._logged_step) if self._logged_step is not None else self.every
            row[M.DATA_WAIT_MS] = 1e3 * (self.batches.wait_s - self._waited) / steps
            self._waited, self._logged_step = self.batches.wait_s, info.step
        if self.data_position is not None:
            row.update(self.data_position(info.step))
        self.writer.write(info.step, row)
        self.last = row


class _Eval(Hook):
    """Mean loss of the eval step over the task's eval batches."""

    def __init__(self, n, eval_step, batches, writer):
        self.every, self.eval_step, self.batches, self.writer = n, eval_step, batches, writer
        self.val_loss = float("nan")

    def after(self, info):
        sets = self.batches if isinstance(self.batches, dict) else {None: self.batches}
        row, every = {}, []
        for name, batches in sets.items():
            losses = [self.eval_step(info.state, b)[M.LOSS].detach().float() for b in batches]
            every += losses
            if name is not None:
                row[f"{M.VAL_LOSS}/{name}"] = float(torch.stack(losses).mean())
        self.val_loss = float(torch.stack(every).mean())
        self.writer.write(info.step, {M.VAL_LOSS: self.val_loss, **row})


class _Checkpoint(Hook):
    """Saves every `checkpoint.every` steps (the manager decides), and always at the end, with the
    record of the data the run trains on (`Task.data_record`)."""

    def __init__(self, manager, data_record: dict | None):
        self.manager = manager
        self.custom = {"functrain": {"data": data_record}} if data_record else None

    def after(self, info):
        self.manager.save(info.step, info.state, force=info.final, custom_metadata=self.custom)
        if info.final:
            self.manager.wait()


class _SkipWatch(Hook):
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


class _Profiler(Hook):
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


class _GarbageCollection(Hook):
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


def run(
    task: Task,
    optimizer: Transform,
    config: Any,
    workdir: str | Path,
    ctx: parallel.ParallelContext,
    *,
    hooks: Sequence[Hook] = (),
    print_fn: Callable[..., None] = print,
    t_program: float | None = None,
) -> dict[str, Any]:
    """Trains `task` with `optimizer` as `config` says, writing into `workdir`.

    Args:
      task: the model family's `Task`.
      optimizer: the optimizer (`functrain.optim.config.from_config(config.optim, config.steps)`).
      config: the run config, checked by `functrain.main.check_config` (the loop reads the keys in
        the module docstring).
      workdir: the run directory (`metrics.jsonl`, `tb/`, `config.json`, `run.json`, checkpoints).
      ctx: the `functrain.parallel.ParallelContext` (`parallel.setup(config.mesh)`).
      hooks: extra hooks, run after the built-in ones.
      print_fn: where console lines go (the main process's; other ranks print nothing).
      t_program: `time.perf_counter()` at program start, for the time-to-first-step line.

    Returns:
      A summary: steps, the last logged train loss, the last val loss, whatever `task.finish`
      returned, and `preempted=True` when the run stopped early.

    Raises:
      ConfigError, TrainingError, CheckpointError, DataError: one line each (see `functrain.main`).

    Example:
      >>> with parallel.setup(config.mesh) as ctx:
      ...     summary = loop.run(task, opt, config, "runs/gpt", ctx)
    """
    t_program = time.perf_counter() if t_program is None else t_program
    micro = ("pp.microbatches", config.pp.microbatches) if ctx.pp_world > 1 else ("accum_steps", config.accum_steps)
    validate.check_batch(config.batch_size, micro[1], ctx.dp_world, micro[0])  # (the mesh at hand)
    with workdir_lock.hold(workdir, ctx.is_main_process):  # one run per workdir
        return _train(task, optimizer, config, Path(workdir), ctx, hooks, print_fn, t_program)


def _train(task: Task, optimizer: Transform, config: Any, workdir: Path, ctx: parallel.ParallelContext,
           hooks: Sequence[Hook], print_fn: Callable[..., None], t_program: float) -> dict[str, Any]:
    """`run`'s body, once the config is checked and the workdir is this run's."""
    main = ctx.is_main_process
    print_fn = print_fn if main else _silent
    device = resolve_device(config, ctx)
    validate.check_cuda_graphs(config, device.type)
    graphs = bool(config.get("cuda_graphs", False))
    if config.deterministic:
        torch.use_deterministic_algorithms(True)
    if config.host_memory == "keep" and device.type == "cpu":
        memory.keep_freed_memory()
    try:  # before anything is compiled: where compiled graphs are cached across runs
        compile_dir = compile_cache.setup(config.compile_cache, workdir)
    except ValueError as exc:
        raise validate.ConfigError(f"{exc} (--config.compile_cache)") from None
    # The MFU denominator: the config's, else the data sheet's (GPUs), else measured (CPUs): before
    # anything runs beside it (the ISA probe's g++ below once took a core from it: MFU 107.7%), and
    # again after each log window, keeping the best (a busy machine slows some probes, not all).
    peak, probe = _peak_flops(config, device, ctx.world_size)
    if _compile(config) and device.type == "cpu":
        compile_cache.start_isa_probe()  # overlaps Dynamo's trace of the step (8 s cold on 2 cores)
    compile_before = compile_cache.stats()

    if ctx.pp_world > 1:  # this rank's pipeline stages: their params, optimizer state and steps
        pipe, state, train_step, eval_step = _pipeline(task, optimizer, config, ctx, device)
        param_norm = functools.partial(pipeline.global_norm, pipe)
    else:
        params = _init_params(task, rng_lib.key(config.seed), device, ctx)
        model_state = task.init_model_state(device) if task.init_model_state is not None else None
        # moments mirror the placements; the model state is replicated (plain tensors on every rank)
        state = init_state(params, optimizer, seed=config.seed, copy=False, model_state=model_state)
        del params, model_state
        fullgraph = bool(config.get("fullgraph", True))
        train_step = make_train_step(
            task.loss_fn, optimizer, accum_steps=config.accum_steps, compile=_compile(config), donate=config.donate,
            precision=config.precision, skip_nonfinite=config.max_consecutive_skips > 0,
            compile_options=cuda_graphs.options() if graphs else None, fullgraph=fullgraph,
            model_state_sync=config.get("model_state_sync", "broadcast"),
        )
        eval_step = make_eval_step(task.loss_fn, compile=_compile(config), precision=config.precision,
                                   fullgraph=fullgraph)
        param_norm = tree_lib.global_norm

    print_fn(f"functrain: {task.describe}, device {device}, compile={_compile_label(config)}, "
             f"precision {config.precision}, mesh {dict(ctx.shape)}"
             + (f" x pp={ctx.pp_world} ({config.pp.schedule}, {config.pp.microbatches} microbatches)"
                if ctx.pp_world > 1 else ""))
    throughput = metrics_lib.Throughput(task.tokens_per_step, task.flops_per_token, peak, config.steps, probe=probe)
    writers = [metrics_lib.ConsoleWriter(config.steps, print_fn)]
    if main:
        workdir.mkdir(parents=True, exist_ok=True)
        _write_run_info(config, workdir)
        writers += _writers(config.tensorboard, workdir, print_fn)
    writer = metrics_lib.MultiWriter(writers)

    manager = _make_manager(config, workdir)
    t_start = time.perf_counter()
    if config.checkpoint.init_from and (manager is None or manager.latest_step() is None):
        state = _init_params_from(config.checkpoint.init_from, state, print_fn)  # a resume wins over it
    graph_skips = cuda_graphs.skips() if graphs else 0  # before any compile: a restore compiles the step
    if graphs:  # before the step compiles (a restore compiles it while the bytes stream in)
        state = cuda_graphs.prepare(state)  # the donated buffers stay put: static inputs of the graphs
    state = _maybe_restore(manager, state, train_step, task.train_batch, config, print_fn,
                           whole=ctx.pp_world == 1, data_record=task.data_record)
    if graphs:
        state = cuda_graphs.prepare(state)  # the restored tensors (new buffers: the graphs re-record once)

    skips_enabled = config.max_consecutive_skips > 0
    start = int(state.step)
    batches = Prefetcher(task.train_batch, start, depth=config.prefetch, device=device) if config.prefetch else None
    log = _Log(config.log_every, writer, throughput, device, skips_enabled, task.data_position, batches,
               param_norm)
    eval_sets = task.eval_batches()
    eval_sets = {k: list(v) for k, v in eval_sets.items()} if isinstance(eval_sets, Mapping) else list(eval_sets)
    evaluation = _Eval(config.eval_every, eval_step, eval_sets, writer)
    # In this order: a run that stops on skipped updates neither logs nor saves that step.
    builtin: list[Hook] = [_SkipWatch(config.max_consecutive_skips, config.log_every, manager)] if skips_enabled else []
    builtin += [log, evaluation]
    if manager is not None:
        builtin.append(_Checkpoint(manager, task.data_record))
    builtin.append(_Profiler(config.profile.start, config.profile.stop, workdir, print_fn))
    if config.gc_every > 0:
        builtin.append(_GarbageCollection(config.gc_every))
    all_hooks = builtin + list(hooks)

    if start >= config.steps:
        print_fn(f"step {start} has reached steps={config.steps}: nothing to train (raise --config.steps to "
                 "train on)")
    stopped = None
    with _PreemptionFlag(print_fn) as preemption, manager or contextlib.nullcontext():
        try:
            for step in range(start, config.steps):
                for h in all_hooks:
                    h.before(step)
                batch = batches.get(step) if batches is not None else task.train_batch(step)
                if graphs:
                    cuda_graphs.step_begin()  # the previous step's outputs may be overwritten now
                state, m = train_step(state, batch)
                done = step + 1
                if step == start:
                    if graphs and cuda_graphs.skips() > graph_skips:
                        raise validate.ConfigError(
                            "cuda_graphs=True, but inductor could not record the train step as a CUDA graph "
                            "(TORCH_LOGS=perf_hints prints why); drop --config.cuda_graphs")
                    print_fn(f"first step (compile + run) took {time.perf_counter() - t_start:.1f}s; "
                             f"time to first step {time.perf_counter() - t_program:.1f}s")
                    if config.compile:
                        print_fn(compile_cache.report(compile_dir, since=compile_before))
                    throughput.start(done)
                if preemption.requested():
                    stopped = preemption.reason
                elif done == config.stop_at:
                    stopped = "stop_at"
                info = StepInfo(done, state, m, final=stopped is not None or done == config.steps)
                for h in all_hooks:
                    if done % h.every == 0 or (info.final and h.at_end):
                        h.after(info)
                if stopped:
                    print_fn(f"stopped ({stopped}) at step {done}; checkpoint saved, exiting")
                    break
        finally:
            if batches is not None:
                batches.close()
            for h in all_hooks:
                h.close()
            writer.close()
    summary = _summary(workdir, int(state.step), log.last.get(M.LOSS), evaluation.val_loss,
                       trained=start < config.steps)
    if stopped:
        summary["preempted"] = True
        return summary
    if ctx.pp_world > 1:  # a task's finish (e.g. a text sample) reads the whole model, split over the stages here
        print_fn(f"finish skipped: the params are split over {ctx.pp_world} pipeline stages (sample from the "
                 "final checkpoint on one mesh)")
        finished = {}
    else:  # on every rank: a sharded task gathers stage by stage (collectives), never the whole model
        finished = task.finish(state.params, rng_lib.fold_in(state.rng, state.step))
    if main:
        for name, value in finished.items():
            print_fn(f"{name}:\n{value}" if isinstance(value, str) else f"{name}: {value}")
        summary.update(finished)
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _summary(workdir: Path, steps: int, loss, val_loss: float, *, trained: bool) -> dict[str, Any]:
    """The run's summary: its last loss and val loss (None, not NaN, when never evaluated); a run
    that trained nothing (resumed at its end) keeps the losses its `summary.json` already holds."""
    summary: dict[str, Any] = {"steps": steps, "loss": loss, "val_loss": val_loss if math.isfinite(val_loss) else None}
    if not trained:
        try:
            before = json.loads((workdir / "summary.json").read_text())
        except (OSError, ValueError):
            before = {}
        summary.update({k: before[k] for k in ("loss", "val_loss") if summary[k] is None and k in before})
    return summary


def _peak_flops(config, device: torch.device, world: int):
    """(peak FLOP/s of the job, probe or None): `config.peak_flops` per device when set, else the data
    sheet's, else a measurement that is taken again at each log step (`metrics.Throughput`'s probe)."""
    per_device = float(config.get("peak_flops", 0.0)) or metrics_lib.peak_flops(device)
    if per_device:
        return world * per_device, None
    return world * metrics_lib.measure_peak_flops(device), \
        lambda: world * metrics_lib.measure_peak_flops(device, seconds=0.1)


def _silent(*args, **kwargs) -> None:
    """print_fn of the ranks other than 0."""


def _compile(config) -> "bool | str":
    """`make_train_step`'s `compile` from the config: False, True (one graph) or "blocks"."""
    if config.compile and config.compile_unit == "blocks":
        return config.compile_unit
    return bool(config.compile)


def _compile_label(config) -> str:
    """How the step is compiled, for the start-up line: "on", "blocks" or "off"."""
    mode = _compile(config)
    return mode if isinstance(mode, str) else "on" if mode else "off"


def resolve_device(config: Any, ctx: parallel.ParallelContext) -> torch.device:
    """The compute device: the context's (cuda:LOCAL_RANK or cpu) unless `config.device` names one.

    Args:
      config: the run config (its `device` key).
      ctx: the parallel context.

    Returns:
      The device.

    Raises:
      ConfigError: a device this torch build or machine lacks (one line naming it and the fix).

    Example:
      >>> resolve_device(config, ctx)  # device(type='cpu')
    """
    if config.device == "auto":
        return ctx.device
    try:
        device = torch.device(config.device)
    except RuntimeError:
        raise validate.fail("device", config.device, "'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type not in ("cpu", "cuda"):
        try:
            torch.empty(0, device=device)
        except (RuntimeError, NotImplementedError, AssertionError):
            raise validate.ConfigError(f"device={config.device!r} but this torch ({torch.__version__}) has no "
                                       f"{device.type} device; use 'auto', 'cpu' or 'cuda' (--config.device)") from None
    if device.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise validate.ConfigError(f"device={config.device!r} but this torch ({torch.__version__}) sees no CUDA "
                                       "device; use 'auto' or 'cpu' (--config.device)")
        if (device.index or 0) >= n:
            raise validate.ConfigError(f"device={config.device!r} but this torch sees {n} CUDA device(s); use "
                                       f"'auto' or 'cuda:N' with N < {n} (--config.device)")
    return device


def _git_revision() -> str | None:
    """The git revision of the functrain checkout (with '-dirty' if modified), or None."""
    repo = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _write_run_info(config, workdir: Path) -> None:
    """The resolved config and the code revision, into the workdir (`config.json`, `run.json`)."""
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    info = {"git_revision": _git_revision(), "torch": torch.__version__, "argv": sys.argv, "started": time.time()}
    (workdir / "run.json").write_text(json.dumps(info, indent=2))


def _peak_memory_mb(device: torch.device) -> float:
    """Peak memory so far: allocated device memory on CUDA, the process's max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _writers(tensorboard: bool, workdir: Path, print_fn) -> list:
    """The main process's file writers: metrics.jsonl always, TensorBoard events when asked and installed."""
    out = [metrics_lib.JsonlWriter(workdir / "metrics.jsonl")]
    if tensorboard and tensorboard_lib.available():
        out.append(metrics_lib.TensorBoardWriter(workdir / "tb"))
    elif tensorboard:
        print_fn(tensorboard_lib.MISSING)
    return out


def _make_manager(config, workdir: Path) -> ckpt_lib.Manager | None:
    """The checkpoint manager for `<workdir>/checkpoints` (None when checkpointing is off)."""
    c = config.checkpoint
    if not c.enabled:
        return None
    return ckpt_lib.Manager(str(workdir / "checkpoints"), keep=c.keep,
                            every=c.every if c.every > 0 else config.steps, keep_every=c.keep_every or None)


def checkpoint_path(path: str, key: str = "checkpoint.init_from") -> str:
    """The committed step directory `path` names: a step directory, a checkpoints root (its latest
    step) or a workdir (its `checkpoints/` latest step).

    Args:
      path: a directory.
      key: the config key or flag that named it (for the error line).

    Returns:
      The path of one committed checkpoint.

    Raises:
      ConfigError: nothing committed is found there.

    Example:
      >>> checkpoint_path("runs/gpt")        # -> 'runs/gpt/checkpoints/2500'
    """
    p = Path(path)
    if (p / "commit_success.txt").exists():
        return str(p)
    for root in (p, p / "checkpoints"):
        steps = [int(c.name) for c in root.glob("*") if c.name.isdigit() and (c / "commit_success.txt").exists()]
        if steps:
            return str(root / str(max(steps)))
    raise validate.ConfigError(
        f"{key.lstrip('-')}={path!r}: no committed checkpoint there; give a step directory "
        f"(<workdir>/checkpoints/<step>), a checkpoints directory or a workdir ({key if key.startswith('--') else '--config.' + key})"
    )


def _pipeline(task: Task, optimizer: Transform, config: Any, ctx: parallel.ParallelContext, device):
    """(pipe, state, train step, eval step) of this rank's pipeline stages (`functrain.parallel.pipeline`): only
    their params are drawn, sharded over the stage's mesh."""
    if config.get("cuda_graphs", False):
        raise validate.ConfigError("cuda_graphs=True records one step graph; a pipeline runs a schedule of stage "
                                   "graphs: drop --config.cuda_graphs or set --config.mesh.pp=1")
    if task.init_model_state is not None:
        raise validate.ConfigError("this model has model state (buffers such as BatchNorm statistics) and the "
                                   "pipeline's stages carry params only: set --config.mesh.pp=1")
    key = rng_lib.key(config.seed)
    try:
        pipe = pipeline.place(task.loss_fn, pipeline.param_shapes(task.init_params, key), group=ctx.pp_group)
    except ValueError as exc:
        raise validate.ConfigError(f"{exc} (--config.mesh.pp)") from None
    params = parallel.init_sharded(task.init_params, key, ctx.mesh, task.shard_rules, device=device,
                                   names=pipe.names)
    state = init_state(params, optimizer, seed=config.seed, copy=False)
    compile = bool(_compile(config))
    train_step = pipeline.make_train_step(
        pipe, optimizer, microbatches=config.pp.microbatches, schedule=config.pp.schedule, compile=compile,
        donate=config.donate, precision=config.precision, skip_nonfinite=config.max_consecutive_skips > 0)
    eval_step = pipeline.make_eval_step(pipe, compile=compile, precision=config.precision)
    return pipe, state, train_step, eval_step


def _init_params(task: Task, key, device, ctx):
    """The task's fresh params: each rank draws only its shards when the task's init takes `where`,
    else the whole tree is made and sharded one parameter at a time."""
    if ctx.mesh is None:
        return task.init_params(key, device)
    if "where" in inspect.signature(task.init_params).parameters:
        return parallel.init_sharded(task.init_params, key, ctx.mesh, task.shard_rules, device=device)
    params = task.init_params(key, device)
    return parallel.shard_params(params.items(), ctx.mesh, task.shard_rules)


def _init_params_from(path: str, state: TrainState, print_fn) -> TrainState:
    """`state` with its params read from the checkpoint at `path` (onto their mesh); optimizer fresh."""
    step_dir = checkpoint_path(path)
    params = ckpt_lib.restore(step_dir, {"params": ckpt_lib.abstract(state.params)}).result()["params"]
    print_fn(f"params initialized from checkpoint {step_dir} (optimizer state, step and schedule start fresh)")
    return state.replace(params=params)


def _maybe_restore(manager, state: TrainState, train_step, batch_at, config, print_fn,
                   whole: bool = True, data_record: dict | None = None) -> TrainState:
    """Restores the latest checkpoint, if any, compiling the step while the bytes stream in (`whole`:
    the state is the whole tree, so a checkpoint leaf it lacks is an error; a pipeline stage's is a part).
    A checkpoint of other data stops the run first (`data.record.check_resume`)."""
    latest = manager.latest_step() if manager is not None else None
    if latest is None:
        return state
    saved = manager.custom_metadata(latest).get("functrain", {}).get("data")
    changed = data_record_lib.check_resume(saved, data_record, latest, bool(config.get("data", {}).get("allow_changed")))
    if changed:
        print_fn(changed)
    try:
        return _restore(manager, latest, state, train_step, batch_at, config, print_fn, whole)
    except ckpt_lib.MismatchError as exc:
        if any(name.startswith("params.") for name in exc.leaves):
            raise  # the params do not fit: starting from them cannot help
        raise ckpt_lib.CheckpointError(  # what does not fit is optimizer state (or another state field)
            f"{exc}; to keep its params under this optimizer, start a new --workdir with "
            f"--config.checkpoint.init_from={manager.step_path(latest)}") from None


def _restore(manager, latest: int, state: TrainState, train_step, batch_at, config, print_fn,
             whole: bool = True) -> TrainState:
    """`_maybe_restore`'s restore of step `latest` (MismatchError when the state does not fit)."""
    t0 = time.perf_counter()
    # Leaves a checkpoint written by older code lacks (e.g. a state field added since) come from the
    # fresh state; leaves this code does not know are an error (strict).
    future = manager.restore(latest, ckpt_lib.abstract(state), defaults=state, strict=whole)
    read_done: list[float] = []  # when the bytes were in (the compile below may take longer)
    future.add_done_callback(lambda _: read_done.append(time.perf_counter()))
    configured = optim_lib.get_hyperparams(state)  # read now: the compile below consumes `state`
    if future.missing:
        print_fn(f"checkpoint step {latest} has no {', '.join(future.missing)} (written by an older version): "
                 "taken from the fresh state")
    if not config.checkpoint.async_restore:
        future.result()  # blocking restore: the bytes first, compilation after (for comparison)
    elif config.compile:
        # Compile now, on the fresh state (consumed and thrown away), while TensorStore reads.
        train_step(state, batch_at(latest))
    restored = future.result()
    if config.checkpoint.async_restore and config.compile:
        # result() may return before the callback ran in the reading thread: then they just came in
        how = f"compile overlapped; its bytes were read in {min(read_done, default=time.perf_counter()) - t0:.1f}s"
    else:
        how = "blocking"
    print_fn(f"restored checkpoint step {latest} in {time.perf_counter() - t0:.1f}s ({how})")
    return _resume_hyperparams(restored, configured, config.checkpoint.resume_hyperparams, print_fn)


def _resume_hyperparams(restored: TrainState, configured: dict, policy: str, print_fn) -> TrainState:
    """The config's hyper-parameters over the checkpoint's ("config"), or the checkpoint's kept."""
    stored = optim_lib.get_hyperparams(restored)
    changed = {k: v for k, v in configured.items() if k in stored and stored[k] != v}
    if not changed:
        return restored
    diff = ", ".join(f"{k} {stored[k]:g} -> {v:g}" for k, v in changed.items())
    if policy == "checkpoint":
        print_fn(f"hyper-parameters differ from the config ({diff}); keeping the checkpoint's "
                 "(checkpoint.resume_hyperparams=checkpoint)")
        return restored
    print_fn(f"hyper-parameters from the config replace the checkpoint's: {diff} "
             "(--config.checkpoint.resume_hyperparams=checkpoint keeps the checkpoint's)")
    return optim_lib.set_hyperparams(restored, **changed)


class _PreemptionFlag:
    """Turns SIGTERM, and a first Ctrl-C (SIGINT), into a flag the loop checks after each step
    (agreed over all ranks): the run saves the step it is at and ends cleanly. A second Ctrl-C
    stops at once (KeyboardInterrupt; the last committed checkpoint is where it resumes).

    Distributed, the ranks agree one step late and without touching the device: each check starts a
    non-blocking MAX all-reduce of this rank's flag over a gloo group of its own (host memory) and
    reads the one the previous check started, by then long done. Every rank reads the same value at
    the same step, so all stop together; no step waits for the accelerator.
    """

    def __init__(self, print_fn: Callable[..., None] = _silent):
        self._flag = False
        self._print = print_fn
        self.reason = "SIGTERM"  # what set the flag on this process, for the line the loop prints
        self._group = None
        self._pending = None  # (work, numpy buffer) of the all-reduce the last check started

    def __enter__(self):
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            if sig == signal.SIGINT and signal.getsignal(sig) is not signal.default_int_handler:
                continue  # SIGINT ignored (a background job) or handled by the caller: leave it
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handler, never preempted
                pass
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self._group = torch.distributed.new_group(backend="gloo")  # collective: every rank enters here
        return self

    def _handle(self, signum, frame):
        """Records the signal; a second Ctrl-C raises KeyboardInterrupt."""
        if signum == signal.SIGINT:
            if self._flag and self.reason == "SIGINT":
                raise KeyboardInterrupt
            self._print("Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again stops at once)")
        if not self._flag:
            self.reason = signal.Signals(signum).name
        self._flag = True

    def requested(self) -> bool:
        """Whether any rank got SIGTERM or Ctrl-C (distributed: as of the previous check)."""
        if self._group is None:
            return self._flag
        agreed = self._collect()
        buf = np.array([int(self._flag)], dtype=np.int64)  # host memory the all-reduce writes into
        work = torch.distributed.all_reduce(torch.from_numpy(buf), op=torch.distributed.ReduceOp.MAX,
                                            group=self._group, async_op=True)
        self._pending = (work, buf)
        return agreed

    def _collect(self) -> bool:
        """Waits for the pending all-reduce (started a step ago) and returns its value."""
        if self._pending is None:
            return False
        work, buf = self._pending
        self._pending = None
        work.wait()
        return bool(buf[0])

    def __exit__(self, exc_type, *exc):
        if self._group is not None and exc_type is None:  # (after an error a peer may be gone: no wait)
            self._collect()  # every rank started as many: the last one completes everywhere
            torch.distributed.destroy_process_group(self._group)
            self._group = None
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        return False
