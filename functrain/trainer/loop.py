"""The training loop: runs any `functrain.task.Task`, and knows no model.

Internals: docs/internals.md "functrain.trainer.loop".
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch

import functrain.metric_names as M
from functrain import config_checks, parallel
from functrain import tree as tree_lib
from functrain.compiler import cache as compile_cache
from functrain.compiler import cuda_graphs
from functrain.data.prefetch import Prefetcher
from functrain.optim.base import Transform
from functrain.state import TrainState
from functrain.task import OnPolicy, Task
from functrain.trainer import downstream, exports, memory, validate, workdir_lock
from functrain.trainer import frozen as frozen_lib
from functrain.trainer import metrics as metrics_lib
from functrain.trainer import route as route_lib
from functrain.trainer import tensorboard as tensorboard_lib
from functrain.trainer.hooks import (
    Eval,
    GarbageCollection,
    Hook,
    Log,
    Profiler,
    SaveCheckpoints,
    SkipWatch,
    StepInfo,
    TrainingError,
    every,
)
from functrain.trainer.preemption import PreemptionFlag
from functrain.trainer.restore import checkpoint_path, init_params_from, make_manager, maybe_restore

__all__ = ["Hook", "StepInfo", "TrainingError", "checkpoint_path", "every", "resolve_device", "run"]


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
      optimizer: the optimizer (`functrain.trainer.optimizer.from_config(config.optim, config.steps)`).
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
    key, micro = route_lib.microbatching(config, ctx)
    config_checks.check_batch(config.batch_size, micro, ctx.dp_world, key)  # (the mesh at hand)
    print_fn = print_fn if ctx.is_main_process else _silent
    # One run per workdir; from here on SIGTERM or Ctrl-C is a flag (during the setup too: a signal
    # then stops the run before its first step, cleanly).
    with workdir_lock.hold(workdir, ctx.is_main_process), PreemptionFlag(print_fn) as preemption:
        return _train(task, optimizer, config, _Env(Path(workdir), ctx, print_fn, t_program, preemption), hooks)


class _Env(NamedTuple):
    """Where a run happens: its workdir, its place in the mesh, its console and signals, when the program began."""

    workdir: Path
    ctx: parallel.ParallelContext
    print_fn: Callable[..., None]
    t_program: float
    preemption: PreemptionFlag


def _train(task: Task, optimizer: Transform, config: Any, env: _Env, hooks: Sequence[Hook]) -> dict[str, Any]:
    """`run`'s body, once the config is checked, the workdir is this run's and signals are flagged."""
    if config.lora.rank and task.frozen is None:
        raise config_checks.ConfigError(
            "lora.rank > 0, but this model's Task holds no params frozen (Task.frozen): its "
            "family does not apply lora.*; wrap your module with functrain.nn.lora and set "
            "Task.frozen=functrain.nn.lora.is_base, or drop --config.lora.rank"
        )
    training = _Training(task, optimizer, config, env, hooks)
    return training.end(training.steps())


class _Training:
    """One run of the loop in its phases: the machine, the state and the hooks (`__init__`), the steps (`steps`),
    the end (`end`)."""

    def __init__(self, task: Task, optimizer: Transform, config: Any, env: _Env, hooks: Sequence[Hook]):
        self.task, self.config, self.env, self.print = task, config, env, env.print_fn
        self._machine()
        self._state(optimizer)
        self._hooks(hooks)

    def _machine(self) -> None:
        """The device, CUDA graphs, the compile cache and the MFU denominator, before anything compiles."""
        config, ctx = self.config, self.env.ctx
        self.device = device = resolve_device(config, ctx)
        validate.check_cuda_graphs(config, device.type)
        self.graphs = bool(config.cuda_graphs)
        if config.deterministic:
            torch.use_deterministic_algorithms(True)
        if config.host_memory == "keep" and device.type == "cpu":
            memory.keep_freed_memory()
        try:  # before anything is compiled: where compiled graphs are cached across runs
            self.compile_dir = compile_cache.setup(config.compile_cache, self.env.workdir)
        except ValueError as exc:
            raise config_checks.ConfigError(f"{exc} (--config.compile_cache)") from None
        # The MFU denominator: the config's, else the data sheet's (GPUs), else measured (CPUs): before
        # anything runs beside it (the ISA probe's g++ below once took a core from it: MFU 107.7%), and
        # again after each log window, keeping the best (a busy machine slows some probes, not all).
        self.peak, self.probe = _peak_flops(config, device, ctx.world_size)
        if _compile(config) and device.type == "cpu":
            compile_cache.start_isa_probe()  # overlaps Dynamo's trace of the step (8 s cold on 2 cores)
        self.compile_before = compile_cache.stats()

    def _state(self, optimizer: Transform) -> None:
        """The route and the state: fresh, from `checkpoint.init_from`, or restored; the run's banner and writers."""
        task, config, env, graphs = self.task, self.config, self.env, self.graphs
        options = cuda_graphs.options() if graphs else None
        state, self.route = route_lib.choose(task, optimizer, config, env.ctx, self.device, _compile(config), options)
        export = config.export_hf and task.export is not None and self.route.whole
        self.export_to = env.workdir / "hf" if export else None
        if self.export_to is not None:  # before anything trains: an export that cannot be written fails now
            exports.check_targets(exports.targets(self.export_to, lora=state.frozen is not None and bool(state.frozen)))
        self.counts = _param_counts(state)
        self._banner(state)
        self.throughput = metrics_lib.Throughput(
            task.tokens_per_step, task.flops_per_token, self.peak, config.steps, probe=self.probe
        )
        self.writer = _writer(config, env)
        self.manager = make_manager(config, env.workdir)
        self.t_start = time.perf_counter()
        latest = self.manager.latest_step() if self.manager is not None else None
        if config.checkpoint.init_from and (latest is None or state.frozen):
            state = init_params_from(config.checkpoint.init_from, state, self.print)  # a resume wins (a base: not)
        self.frozen_record = frozen_lib.record(state.frozen, frozen_lib.source_of(config))
        self.data_record = task.data.record()
        self.graph_skips = cuda_graphs.skips() if graphs else 0  # before any compile: a restore compiles the step
        if graphs:  # before the step compiles (a restore compiles it while the bytes stream in)
            state = cuda_graphs.prepare(state)  # the donated buffers stay put: static inputs of the graphs
        on_policy = getattr(task.data, "on_policy", False)  # (its batches need the params: none before the restore)
        state = maybe_restore(
            self.manager,
            state,
            self.route.train_step,
            None if on_policy else task.data.train_batch,
            config,
            self.print,
            whole=self.route.whole,
            data_record=self.data_record,
            frozen_record=self.frozen_record,
        )
        self.state = cuda_graphs.prepare(state) if graphs else state  # (restored tensors: re-recorded once)

    def _banner(self, state: TrainState) -> None:
        """The run's first lines: the model, device, compile, precision, mesh; the trained share under LoRA."""
        config, counts = self.config, self.counts
        self.print(
            f"functrain: {self.task.describe}, device {self.device}, compile={_compile_label(config)}, "
            f"precision {config.precision}, mesh {dict(self.env.ctx.shape)}" + self.route.banner
        )
        if state.frozen:
            self.print(
                f"trains {counts['params_trained']:,} of {counts['params_total']:,} params "
                f"({100 * counts['params_trained'] / counts['params_total']:.2f}%); the rest frozen"
            )

    def _hooks(self, hooks: Sequence[Hook]) -> None:
        """The batches (prefetched), and the hooks in their order: a run that stops on skipped updates neither
        logs nor saves that step; the user's hooks last."""
        task, config, route = self.task, self.config, self.route
        skips = config.max_consecutive_skips > 0
        self.start = start = int(self.state.step)
        on_policy = getattr(task.data, "on_policy", False)  # (a rollout needs the params its step starts from)
        prefetch = 0 if on_policy else config.prefetch
        self.batches = (
            Prefetcher(task.data.train_batch, start, depth=prefetch, device=self.device) if prefetch else None
        )
        self.log = Log(
            config.log_every,
            self.writer,
            self.throughput,
            self.device,
            skips,
            task.data.position,
            self.batches,
            route.param_norm,
        )
        eval_sets = task.data.eval_sets()
        eval_sets = {k: list(v) for k, v in eval_sets.items()} if isinstance(eval_sets, Mapping) else list(eval_sets)
        self.evaluation = Eval(config.eval_every, route.eval_step, eval_sets, self.writer)
        self.choices = downstream.hook(
            task,
            config,
            self.writer,
            compile=_compile(config) is not False,
            whole=route.whole,
            print_fn=self.print,
            interrupt=self.env.preemption.requested,
        )
        builtin: list[Hook] = [SkipWatch(config.max_consecutive_skips, config.log_every, self.manager)] if skips else []
        builtin += [self.log, self.evaluation] + ([self.choices] if self.choices is not None else [])
        if self.manager is not None:
            builtin.append(SaveCheckpoints(self.manager, self.data_record, self.frozen_record))
        builtin.append(Profiler(config.profile.start, config.profile.stop, self.env.workdir, self.print))
        if config.gc_every > 0:
            builtin.append(GarbageCollection(config.gc_every))
        self.hooks = builtin + list(hooks)

    def steps(self) -> str | None:
        """Trains from the state's step to `config.steps`; returns why it stopped early (None: it did not)."""
        config, start, preemption = self.config, self.start, self.env.preemption
        if start >= config.steps:
            self.print(
                f"step {start} has reached steps={config.steps}: nothing to train (raise --config.steps to train on)"
            )
        stopped = None
        with self.manager or contextlib.nullcontext():
            try:
                if self.choices is not None and start == 0 < config.steps:
                    self.choices.evaluate(0, self.state)  # the scores before training: the chance level of the tasks
                if start < config.steps and preemption.agree():  # signalled during the setup or those scores
                    stopped = preemption.reason
                    self.print(
                        f"stopped ({stopped}) before step {start + 1}: no step taken, nothing to save; "
                        "the same command starts again"
                    )
                for step in range(start, config.steps if stopped is None else start):
                    stopped = self._step(step)
                    if stopped:
                        break
            finally:
                if self.batches is not None:
                    self.batches.close()
                for h in self.hooks:
                    h.close()
                self.writer.close()
        return stopped

    def _step(self, step: int) -> str | None:
        """One step with its hooks; why the run stops after it (None: it goes on)."""
        config, preemption, graphs = self.config, self.env.preemption, self.graphs
        for h in self.hooks:
            h.before(step)
        batch = self._batch(step)
        if graphs:
            cuda_graphs.step_begin()  # the previous step's outputs may be overwritten now
        try:
            self.state, m = self.route.train_step(self.state, batch)
        except Exception:  # a signal that interrupted the first compile (its compiler jobs killed)
            if step != self.start or not preemption.signalled():
                raise
            self.print(
                f"stopped ({preemption.reason}) while the first step compiled: no step taken, nothing to save; "
                "the same command starts again"
            )
            return preemption.reason
        done = step + 1
        self.throughput.add(batch)
        if step == self.start:
            self._first_step_report(done)
        stopped = preemption.reason if preemption.requested() else "stop_at" if done == config.stop_at else None
        info = StepInfo(done, self.state, m, final=stopped is not None or done == config.steps)
        for h in self.hooks:
            if done % h.every == 0 or (info.final and h.at_end):
                h.after(info)
        if info.final and stopped is None and preemption.agree():  # a signal during the last step's hooks
            stopped = preemption.reason
        if stopped:
            self.print(f"stopped ({stopped}) at step {done}; checkpoint saved, exiting")
        return stopped

    def _batch(self, step: int):
        """The batch of `step`: prefetched, or read now; on-policy data (`task.OnPolicy`) read with the params."""
        data = self.task.data
        if getattr(data, "on_policy", False):
            return cast(OnPolicy, data).train_batch(step, frozen_lib.merged(self.state))  # (LoRA: base and adapters)
        return self.batches.get(step) if self.batches is not None else data.train_batch(step)

    def _first_step_report(self, done: int) -> None:
        """After the first step: CUDA graphs recorded (or one line), its time with the compile, the cache's report."""
        if self.graphs and cuda_graphs.skips() > self.graph_skips:
            raise config_checks.ConfigError(
                "cuda_graphs=True, but inductor could not record the train step as a CUDA graph "
                "(TORCH_LOGS=perf_hints prints why); drop --config.cuda_graphs"
            )
        now = time.perf_counter()
        self.print(
            f"first step (compile + run) took {now - self.t_start:.1f}s; "
            f"time to first step {now - self.env.t_program:.1f}s"
        )
        if self.config.compile:
            self.print(compile_cache.report(self.compile_dir, since=self.compile_before))
        self.throughput.start(done)

    def end(self, stopped: str | None) -> dict[str, Any]:
        """The run's summary (`summary.json`), and after a run to the end the task's finish and the export."""
        state, workdir, main = self.state, self.env.workdir, self.env.ctx.is_main_process
        trained = self.start < self.config.steps
        summary = _summary(
            workdir, int(state.step), self.log.last.get(M.LOSS), self.evaluation.val_loss, trained=trained
        )
        if self.choices is not None:
            summary.update(self.choices.last)
        held_out = self.evaluation
        summary.update({k: v for k, v in held_out.last.items() if k != "step"})
        if state.frozen:
            summary.update(self.counts)
        if stopped:
            summary["preempted"] = True
            return summary
        if main:  # (again below with what the end adds: a failed export leaves this one)
            (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        finished, note = self.route.finish(state)
        if note:
            self.print(note)
        if self.export_to is not None:
            path, unchecked = exports.write(self.task, frozen_lib.merged(state), self.export_to)
            finished["hf_export"] = str(path)
            if unchecked:
                self.print(unchecked)
        if main and held_out.last:  # (a preference run: the held-out rewards at the first evaluation and now)
            changes = [f"{k} {held_out.first[k]:.4g} -> {v:.4g}" for k, v in held_out.last.items() if k != "step"]
            self.print(f"held out, step {held_out.first['step']} -> {held_out.last['step']}: {', '.join(changes)}")
        if main:
            for name, value in finished.items():
                self.print(f"{name}:\n{value}" if isinstance(value, str) else f"{name}: {value}")
            summary.update(finished)
            (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def _writer(config: Any, env: _Env) -> metrics_lib.MultiWriter:
    """The console, and on the main process `config.json`, `run.json` and the metrics files in the workdir."""
    writers = [metrics_lib.ConsoleWriter(config.steps, env.print_fn)]
    if env.ctx.is_main_process:
        env.workdir.mkdir(parents=True, exist_ok=True)
        _write_run_info(config, env.workdir)
        writers += _writers(config.tensorboard, env.workdir, env.print_fn)
    return metrics_lib.MultiWriter(writers)


def _param_counts(state: TrainState) -> dict[str, int]:
    """{"params_trained", "params_total"}: the state's trained params and those plus its frozen ones."""
    trained = sum(t.numel() for t in tree_lib.leaves(state.params))
    return {"params_trained": trained, "params_total": trained + sum(t.numel() for t in tree_lib.leaves(state.frozen))}


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
    per_device = float(config.peak_flops) or metrics_lib.peak_flops(device)
    if per_device:
        return world * per_device, None
    return world * metrics_lib.measure_peak_flops(
        device
    ), lambda: world * metrics_lib.measure_peak_flops(device, seconds=0.1)


def _silent(*args, **kwargs) -> None:
    """print_fn of the ranks other than 0."""


def _compile(config) -> bool | str:
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
        raise config_checks.fail("device", config.device, "'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type not in ("cpu", "cuda"):
        try:
            torch.empty(0, device=device)
        except (RuntimeError, NotImplementedError, AssertionError):
            raise config_checks.ConfigError(
                f"device={config.device!r} but this torch ({torch.__version__}) has no "
                f"{device.type} device; use 'auto', 'cpu' or 'cuda' (--config.device)"
            ) from None
    if device.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise config_checks.ConfigError(
                f"device={config.device!r} but this torch ({torch.__version__}) sees no CUDA "
                "device; use 'auto' or 'cpu' (--config.device)"
            )
        if (device.index or 0) >= n:
            raise config_checks.ConfigError(
                f"device={config.device!r} but this torch sees {n} CUDA device(s); use "
                f"'auto' or 'cuda:N' with N < {n} (--config.device)"
            )
    return device


def _git_revision() -> str | None:
    """The git revision of the functrain checkout (with '-dirty' if modified), or None."""
    repo = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _write_run_info(config, workdir: Path) -> None:
    """The resolved config and the code revision, into the workdir (`config.json`, `run.json`)."""
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    info = {"git_revision": _git_revision(), "torch": torch.__version__, "argv": sys.argv, "started": time.time()}
    (workdir / "run.json").write_text(json.dumps(info, indent=2))


def _writers(tensorboard: bool, workdir: Path, print_fn) -> list:
    """The main process's file writers: metrics.jsonl always, TensorBoard events when asked and installed."""
    out: list = [metrics_lib.JsonlWriter(workdir / "metrics.jsonl")]
    if tensorboard and tensorboard_lib.available():
        out.append(tensorboard_lib.TensorBoardWriter(workdir / "tb"))
    elif tensorboard:
        print_fn(tensorboard_lib.MISSING)
    return out
