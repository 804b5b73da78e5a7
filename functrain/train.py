"""The training program behind `python -m functrain.main`: config -> state -> compiled loop.

Each piece is a small function so research code can reuse them one by one:
`build_optimizer(config)`, `make_loss_fn(model)`, `evaluate(...)`, and `train(config, workdir)`.

Example:
    >>> from configs import gpt
    >>> train(gpt.get_config("tiny"), "runs/tiny")
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import ml_collections
import torch

from functrain import checkpoint as ckpt_lib
from functrain import compile_cache
from functrain import data as data_lib
from functrain import losses
from functrain import memory
from functrain import metrics as metrics_lib
from functrain import optim, parallel
from functrain import precision as precision_lib
from functrain import remat as remat_lib
from functrain import rng as rng_lib
from functrain import tree as tree_lib
from functrain.models import gpt
from functrain.state import TrainState, init_state
from functrain.step import apply, make_eval_step, make_train_step

__all__ = ["TrainingError", "build_optimizer", "build_schedule", "make_loss_fn", "evaluate", "train"]


class TrainingError(RuntimeError):
    """A run cannot go on (bad config value, non-finite loss, ...); the message says why and what to do."""


def build_schedule(c: ml_collections.ConfigDict, steps: int) -> optim.schedules.Schedule:
    """The learning-rate schedule named by `c.schedule` ("cosine", "constant" or "linear").

    Args:
      c: the `optim` config (lr, min_lr, warmup_steps, schedule).
      steps: total training steps (the decay length).

    Returns:
      A schedule `count -> lr`.

    Example:
      >>> sched = build_schedule(config.optim, config.steps)
    """
    warmup = min(c.warmup_steps, max(steps - 1, 0))
    if c.schedule == "cosine":
        return optim.warmup_cosine(c.lr, warmup, max(steps, warmup + 1), end_value=c.min_lr)
    if c.schedule == "constant":
        return optim.linear_warmup(c.lr, warmup)
    if c.schedule == "linear":
        ramp = optim.linear_warmup(c.lr, warmup)
        decay = optim.linear(c.lr, c.min_lr, max(steps - warmup, 1), transition_begin=warmup)
        return lambda count: torch.where(count < warmup, ramp(count), decay(count))
    raise TrainingError(
        f"optim.schedule={c.schedule!r} is not known; use 'cosine', 'constant' or 'linear'"
    )


def decay_mask(params: dict[str, torch.Tensor]) -> dict[str, bool]:
    """Weight decay on matrices only (not biases, norm scales), as nanoGPT/GPT-2 do."""
    return {name: p.ndim >= 2 for name, p in params.items()}


def build_optimizer(config: ml_collections.ConfigDict) -> optim.Transform:
    """The optimizer described by `config.optim`: clipping, then adamw or sgd with the schedule.

    Args:
      config: the whole run config (uses `config.optim` and `config.steps`).

    Returns:
      A `Transform`.

    Example:
      >>> opt = build_optimizer(config)
    """
    c = config.optim
    lr = build_schedule(c, config.steps)
    if c.name == "adamw":
        try:
            dtypes = {k: precision_lib.parse_dtype(c[k]) for k in ("mu_dtype", "nu_dtype")}
        except ValueError as exc:
            raise TrainingError(f"optim.mu_dtype / optim.nu_dtype: {exc}") from None
        base = optim.adamw(lr, c.b1, c.b2, c.eps, c.weight_decay, mask=decay_mask, **dtypes)
    elif c.name == "sgd":
        base = optim.sgd(lr, momentum=c.momentum, weight_decay=c.weight_decay, mask=decay_mask)
    else:
        raise TrainingError(f"optim.name={c.name!r} is not known; use 'adamw' or 'sgd'")
    if c.clip > 0:
        return optim.chain(optim.clip_by_global_norm(c.clip), base)
    return base


def make_loss_fn(model: torch.nn.Module, chunk_size: int = 0, remat: str | int = "none") -> Callable:
    """`loss_fn(params, batch, key) -> (loss, {})`: next-token cross-entropy of `model`.

    Args:
      model: the (meta-device) GPT template.
      chunk_size: > 0 computes the loss through the tied head in chunks of this many tokens, so the
        (B*T, V) logits never exist (`functrain.losses.chunked_cross_entropy`).
      remat: activation checkpointing: "none", "full" (recompute every block in the backward) or
        N (every N-th block); see `functrain.remat`.

    Returns:
      The loss function for `make_train_step` / `make_eval_step`; `batch` is `(x, y)`.

    Example:
      >>> step = make_train_step(make_loss_fn(template), build_optimizer(config))
    """

    if chunk_size or str(remat) != "none":
        return losses.make_gpt_loss_fn(model, chunk_size=chunk_size, remat=remat)

    def loss_fn(params, batch, key):
        x, y = batch
        logits = apply(model, params, x, dropout_key=key)  # (B, T, V)
        return gpt.cross_entropy(logits, y), {}

    return loss_fn


def evaluate(eval_step, state: TrainState, batches) -> float:
    """Mean eval loss over `batches` (a list of `(x, y)`)."""
    losses = [eval_step(state, b)["loss"] for b in batches]
    return float(torch.stack([l.detach().float() for l in losses]).mean())


def _check_config(config: ml_collections.ConfigDict) -> None:
    """One clear error for inconsistent values."""
    if config.steps < 1:
        raise TrainingError(f"steps={config.steps} must be >= 1")
    if config.batch_size % config.accum_steps:
        raise TrainingError(
            f"batch_size={config.batch_size} is not divisible by accum_steps={config.accum_steps}; "
            "make batch_size a multiple of accum_steps"
        )
    if config.model.n_embd % config.model.n_head:
        raise TrainingError(
            f"model.n_embd={config.model.n_embd} is not divisible by model.n_head={config.model.n_head}"
        )
    for key in ("log_every", "eval_every"):
        if config[key] < 1:
            raise TrainingError(f"{key}={config[key]} must be >= 1")
    if config.max_consecutive_skips < 0:
        raise TrainingError(f"max_consecutive_skips={config.max_consecutive_skips} must be >= 0 (0 = no skipping)")
    try:
        precision_lib.get(config.precision)
    except ValueError as exc:
        raise TrainingError(f"{exc} (--config.precision)") from None
    try:
        remat_lib.parse_policy(config.remat)
    except ValueError as exc:
        raise TrainingError(f"{exc} (--config.remat)") from None


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


def _write_run_info(config: ml_collections.ConfigDict, workdir: Path) -> None:
    """Writes the resolved config and the code revision into the workdir (`config.json`, `run.json`)."""
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    info = {"git_revision": _git_revision(), "torch": torch.__version__, "argv": sys.argv, "started": time.time()}
    (workdir / "run.json").write_text(json.dumps(info, indent=2))


def _peak_memory_mb(device: torch.device) -> float:
    """Peak memory so far: allocated device memory on CUDA, the process's max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class _Profiler:
    """A torch.profiler trace of steps [start, stop) written to `<workdir>/profile` (off if stop <= start)."""

    def __init__(self, start: int, stop: int, workdir: Path, print_fn):
        self.start, self.stop, self.dir, self.print_fn = start, stop, workdir / "profile", print_fn
        self._prof = None

    def before(self, step: int) -> None:
        """Starts tracing when `step` is the window's first."""
        if self.stop > self.start and step == self.start:
            self._prof = torch.profiler.profile(record_shapes=True, with_stack=False)
            self._prof.__enter__()

    def after(self, done: int) -> None:
        """Stops tracing and writes the trace when the window ends."""
        if self._prof is not None and done >= self.stop:
            self._prof.__exit__(None, None, None)
            self.dir.mkdir(parents=True, exist_ok=True)
            path = self.dir / f"trace_steps_{self.start}_{self.stop}.json"
            self._prof.export_chrome_trace(str(path))
            self.print_fn(f"profiler trace of steps [{self.start}, {self.stop}) written to {path}")
            self._prof = None


def _make_manager(config: ml_collections.ConfigDict, workdir: Path) -> ckpt_lib.Manager | None:
    """The checkpoint manager for `<workdir>/checkpoints` (None when checkpointing is off)."""
    c = config.checkpoint
    if not c.enabled:
        return None
    return ckpt_lib.Manager(
        str(workdir / "checkpoints"),
        keep=c.keep,
        every=c.every if c.every > 0 else config.steps,
        keep_every=c.keep_every or None,
    )


def checkpoint_path(path: str) -> str:
    """The committed step directory `path` names: a step directory, a checkpoints root (its latest
    step) or a workdir (its `checkpoints/` latest step).

    Args:
      path: a directory.

    Returns:
      The path of one committed checkpoint.

    Raises:
      TrainingError: nothing committed is found there.

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
    raise TrainingError(
        f"checkpoint.init_from={path!r}: no committed checkpoint there; give a step directory "
        "(<workdir>/checkpoints/<step>), a checkpoints directory or a workdir"
    )


def _init_params_from(path: str, state: TrainState, print_fn) -> TrainState:
    """`state` with its params read from the checkpoint at `path` (onto their mesh); optimizer fresh."""
    step_dir = checkpoint_path(path)
    future = ckpt_lib.restore(step_dir, {"params": ckpt_lib.abstract(state.params)})
    params = future.result()["params"]
    print_fn(f"params initialized from checkpoint {step_dir} (optimizer state, step and schedule start fresh)")
    return state.replace(params=params)


def _maybe_restore(manager, state: TrainState, train_step, batch_at, config, print_fn) -> TrainState:
    """Restores the latest checkpoint, if any, compiling the step while the bytes stream in."""
    latest = manager.latest_step() if manager is not None else None
    if latest is None:
        return state
    t0 = time.perf_counter()
    # Leaves a checkpoint written by older code lacks (e.g. a state field added since) come from the
    # fresh state; leaves this code does not know are an error (strict).
    future = manager.restore(latest, ckpt_lib.abstract(state), defaults=state, strict=True)
    if future.missing:
        print_fn(
            f"checkpoint step {latest} has no {', '.join(future.missing)} (written by an older version): "
            "taken from the fresh state"
        )
    if not config.checkpoint.async_restore:
        future.result()  # blocking restore: the bytes first, compilation after (for comparison)
    elif config.compile:
        # Compile now, on the fresh state (consumed and thrown away), while TensorStore reads.
        train_step(state, batch_at(latest))
    restored = future.result()
    overlap = "compile overlapped" if config.checkpoint.async_restore and config.compile else "blocking"
    print_fn(f"restored checkpoint step {latest} in {time.perf_counter() - t0:.1f}s ({overlap})")
    return restored


class _SkipWatch:
    """Stops the run once `limit` updates in a row were skipped (non-finite loss or grad norm).

    The step skips bad updates on the device; this reads its `consecutive_skips` counter: every
    step on CPU (free), every `limit` steps on accelerators (a host sync), so the run stops within
    `2 * limit - 1` skipped steps at most.
    """

    def __init__(self, limit: int, device: torch.device, manager):
        self.enabled = limit > 0
        self.limit, self.manager = limit, manager
        self.every = 1 if device.type == "cpu" else max(limit, 1)

    def check(self, done: int, metrics: dict) -> None:
        """Raises TrainingError when the skip limit is reached after step `done`."""
        if not self.enabled or "consecutive_skips" not in metrics or done % self.every:
            return
        n = int(metrics["consecutive_skips"])
        if n < self.limit:
            return
        if self.manager is not None:
            self.manager.wait()  # a save in flight commits first: the message names what is really kept
        latest = self.manager.latest_step() if self.manager is not None else None
        kept = f"the last checkpoint (step {latest}) is kept" if latest is not None else "no checkpoint was written"
        raise TrainingError(
            f"the update was skipped at {n} consecutive steps ({done - n + 1} to {done}): the loss or "
            f"the gradient norm was not finite; params are as after step {done - n}, {kept}. "
            f"Lower optim.lr, enable optim.clip, check the data near step {done - n + 1}, or raise "
            "max_consecutive_skips"
        )


class _PreemptionFlag:
    """Turns SIGTERM into a flag the loop checks after each step (agreed over all ranks)."""

    def __init__(self, device: torch.device):
        self._device = device
        self._flag = False

    def __enter__(self):
        self._previous = None
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no handler, never preempted
            pass
        return self

    def _handle(self, signum, frame):
        """Records the signal."""
        self._flag = True

    def requested(self) -> bool:
        """Whether any rank got SIGTERM (one tiny all-reduce when distributed)."""
        flag = self._flag
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            t = torch.tensor([1 if flag else 0], device=self._device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            flag = bool(t.item())
        return flag

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
        return False


def train(config: ml_collections.ConfigDict, workdir: str | Path, *, print_fn=print) -> dict[str, Any]:
    """Runs the training job described by `config`, writing logs and metrics into `workdir`.

    Args:
      config: a config from `configs/gpt.py` (see its docstring for the keys).
      workdir: the run directory (`metrics.jsonl`, `config.json`, data cache, checkpoints).
      print_fn: where console lines go.

    Returns:
      A summary dict: final train loss, final val loss, steps, sample text.

    Example:
      >>> summary = train(get_config("tiny"), "runs/tiny")
    """
    _check_config(config)
    t_program = time.perf_counter()
    try:
        ctx = parallel.setup(config.mesh)  # torchrun env -> process group + mesh; plain python: none
    except ValueError as exc:
        raise TrainingError(f"{exc}; fix --config.mesh.* or the number of processes") from None
    with ctx:
        return _train(config, Path(workdir), ctx, print_fn if ctx.is_main_process else _silent, t_program)


def _silent(*args, **kwargs) -> None:
    """print_fn of the ranks other than 0."""


def _train(config: ml_collections.ConfigDict, workdir: Path, ctx, print_fn, t_program: float) -> dict[str, Any]:
    """`train` inside the process group (see `train`)."""
    main = ctx.is_main_process
    if config.batch_size % (ctx.dp_world * config.accum_steps):
        raise TrainingError(
            f"batch_size={config.batch_size} must divide by data-parallel ranks ({ctx.dp_world}) x "
            f"accum_steps ({config.accum_steps}); change batch_size or the mesh"
        )
    if main:
        workdir.mkdir(parents=True, exist_ok=True)
        _write_run_info(config, workdir)
    if config.deterministic:
        torch.use_deterministic_algorithms(True)
    device = ctx.device if config.device == "auto" else torch.device(config.device)
    if config.host_memory not in ("keep", "default"):
        raise TrainingError(f"host_memory={config.host_memory!r} must be 'keep' or 'default'")
    if config.host_memory == "keep" and device.type == "cpu":
        memory.keep_freed_memory()
    try:  # before anything is compiled: where compiled graphs are cached across runs
        compile_dir = compile_cache.setup(config.compile_cache, workdir)
    except ValueError as exc:
        raise TrainingError(f"{exc}; fix --config.compile_cache") from None
    compile_before = compile_cache.stats()

    cache_dir = config.data.cache_dir or str(workdir / "data")
    dataset = data_lib.load_dataset(
        config.data.path, cache_dir, vocab_size=config.model.vocab_size or None, block_size=config.model.block_size
    )
    vocab = config.model.vocab_size or dataset.vocab_size
    if vocab < dataset.vocab_size:
        raise TrainingError(
            f"model.vocab_size={vocab} is smaller than the data's vocabulary ({dataset.vocab_size}); "
            "set model.vocab_size=0 to take it from the data"
        )
    mcfg = gpt.GPTConfig(
        vocab_size=vocab,
        block_size=config.model.block_size,
        n_layer=config.model.n_layer,
        n_head=config.model.n_head,
        n_embd=config.model.n_embd,
        dropout=config.model.dropout,
        bias=config.model.bias,
    )
    with torch.device("meta"):
        template = gpt.GPT(mcfg)  # shapes only; the state holds the real tensors
    optimizer = build_optimizer(config)
    params = gpt.init_params(template, rng_lib.key(config.seed), device=device)  # full, every rank
    rules = parallel.default_rules(gpt.TP_RULES)
    state = parallel.shard_state(init_state(params, optimizer, seed=config.seed, copy=False), ctx.mesh, rules)
    del params
    model = parallel.tensor_parallel(template, ctx.mesh, rules)  # `template` itself when tp == 1

    loss_fn = make_loss_fn(model, config.loss_chunk_size, config.remat)
    train_step = make_train_step(
        loss_fn, optimizer, accum_steps=config.accum_steps, compile=config.compile, donate=config.donate,
        precision=config.precision, skip_nonfinite=config.max_consecutive_skips > 0,
    )
    eval_step = make_eval_step(loss_fn, compile=config.compile, precision=config.precision)

    dp = dict(parallel.data_parallel_kwargs(ctx), device=device)  # this rank's rows of each batch

    def batch_at(step: int):
        return data_lib.get_batch(
            dataset.train, batch_size=config.batch_size, block_size=mcfg.block_size,
            seed=config.seed, step=step, **dp,
        )

    val_batches = list(
        data_lib.eval_batches(
            dataset.val, batch_size=config.batch_size, block_size=mcfg.block_size,
            num_batches=config.eval_batches, **dp,
        )
    )

    n_params = gpt.num_params(mcfg)
    print_fn(
        f"functrain: GPT {n_params / 1e6:.2f}M params ({config.model.n_layer} layers, d={mcfg.n_embd}), "
        f"vocab {vocab}, {len(dataset.train):,} train tokens, device {device}, "
        f"compile={'on' if config.compile else 'off'}, precision {config.precision}, mesh {dict(ctx.shape)}"
    )
    tokens_per_step = config.batch_size * mcfg.block_size
    peak = ctx.world_size * (metrics_lib.peak_flops(device) or metrics_lib.measure_peak_flops(device))
    throughput = metrics_lib.Throughput(tokens_per_step, gpt.flops_per_token(mcfg), peak, config.steps)
    writers = [metrics_lib.ConsoleWriter(config.steps, print_fn)]
    if main:
        writers.append(metrics_lib.JsonlWriter(workdir / "metrics.jsonl"))
    if main and config.tensorboard:
        writers.append(metrics_lib.TensorBoardWriter(workdir / "tb"))
    writer = metrics_lib.MultiWriter(writers)

    manager = _make_manager(config, workdir)
    t_start = time.perf_counter()
    if config.checkpoint.init_from and (manager is None or manager.latest_step() is None):
        state = _init_params_from(config.checkpoint.init_from, state, print_fn)  # a resume wins over it
    state = _maybe_restore(manager, state, train_step, batch_at, config, print_fn)

    start = int(state.step)
    last: dict[str, Any] = {}
    val_loss = float("nan")
    preempted = False
    profiler = _Profiler(config.profile.start, config.profile.stop, workdir, print_fn)
    skips = _SkipWatch(config.max_consecutive_skips, device, manager)
    with _PreemptionFlag(device) as stop, manager or contextlib.nullcontext():
        try:
            for step in range(start, config.steps):
                profiler.before(step)
                state, m = train_step(state, batch_at(step))
                done = step + 1
                profiler.after(done)
                if step == start:
                    print_fn(
                        f"first step (compile + run) took {time.perf_counter() - t_start:.1f}s; "
                        f"time to first step {time.perf_counter() - t_program:.1f}s"
                    )
                    if config.compile:
                        print_fn(compile_cache.report(compile_dir, since=compile_before))
                    throughput.start(done)
                skips.check(done, m)
                if done % config.log_every == 0 or done == config.steps:
                    last = metrics_lib.to_python(m)
                    for k in ("skipped", "consecutive_skips"):  # per-step flags; the total is logged
                        last.pop(k, None)
                    if not skips.enabled and not math.isfinite(last["loss"]):
                        raise TrainingError(
                            f"loss is {last['loss']} at step {done}; lower optim.lr, enable optim.clip, "
                            "or check the data (the last checkpoint is kept)"
                        )
                    last["param_norm"] = float(tree_lib.global_norm(state.params))  # a pass: log steps only
                    last.update(throughput.report(done))
                    last["peak_mem_mb"] = _peak_memory_mb(device)
                    writer.write(done, last)
                if done % config.eval_every == 0 or done == config.steps:
                    val_loss = evaluate(eval_step, state, val_batches)
                    writer.write(done, {"val_loss": val_loss})
                stopping = stop.requested() or done == config.stop_at
                if manager is not None:
                    manager.save(done, state, force=stopping or done == config.steps)
                if stopping:
                    if manager is not None:
                        manager.wait()
                    why = "stop_at" if done == config.stop_at else "SIGTERM"
                    print_fn(f"stopped ({why}) at step {done}; checkpoint saved, exiting")
                    preempted = True
                    break
        finally:
            writer.close()
    if preempted:
        return {"steps": int(state.step), "loss": last.get("loss"), "val_loss": val_loss, "preempted": True}

    full_params = parallel.gather(state.params)  # a collective: every rank takes part
    summary = {"steps": config.steps, "loss": last.get("loss"), "val_loss": val_loss}
    if main:
        prompt = torch.as_tensor(dataset.encode(config.sample.prompt), dtype=torch.long, device=device)[None]  # (1, T)
        out = gpt.generate(
            template, full_params, prompt, config.sample.max_new_tokens,
            temperature=config.sample.temperature, top_k=config.sample.top_k or None,
            key=rng_lib.fold_in(state.rng, state.step),
        )
        summary["sample"] = dataset.decode(out[0].tolist())
        print_fn("sample:\n" + summary["sample"])
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
