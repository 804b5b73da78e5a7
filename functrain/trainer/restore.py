"""Resuming a run: the checkpoint manager of a workdir, the restore of its latest step (compiling the
step while the bytes stream in), params from another run (`checkpoint.init_from`), the
hyper-parameters' policy, and the check that the data is the checkpoint's.
"""

from __future__ import annotations

import time
from pathlib import Path

from functrain import checkpoint as ckpt_lib
from functrain import optim as optim_lib
from functrain.config_checks import ConfigError
from functrain.data import record as data_record_lib
from functrain.state import TrainState
from functrain.trainer import frozen as frozen_lib

__all__ = ["checkpoint_path", "init_params_from", "make_manager", "maybe_restore"]


def make_manager(config, workdir: Path) -> ckpt_lib.Manager | None:
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
    raise ConfigError(
        f"{key.lstrip('-')}={path!r}: no committed checkpoint there; give a step directory "
        "(<workdir>/checkpoints/<step>), a checkpoints directory or a workdir "
        f"({key if key.startswith('--') else '--config.' + key})"
    )


def init_params_from(path: str, state: TrainState, print_fn) -> TrainState:
    """`state` with its params read from the checkpoint at `path` (onto their mesh); optimizer fresh. A run
    with frozen params (a LoRA base) reads those, its adapters start fresh."""
    step_dir = checkpoint_path(path)
    if state.frozen:
        frozen = ckpt_lib.restore(step_dir, {"params": ckpt_lib.abstract(state.frozen)}).result()["params"]
        print_fn(f"frozen base read from checkpoint {step_dir}")
        return state.replace(frozen=frozen)
    params = ckpt_lib.restore(step_dir, {"params": ckpt_lib.abstract(state.params)}).result()["params"]
    print_fn(f"params initialized from checkpoint {step_dir} (optimizer state, step and schedule start fresh)")
    return state.replace(params=params)


def maybe_restore(  # noqa: PLR0913
    manager,
    state: TrainState,
    train_step,
    batch_at,
    config,
    print_fn,
    whole: bool = True,
    data_record: dict | None = None,
    frozen_record: dict | None = None,
) -> TrainState:
    """Restores the latest checkpoint, if any, compiling the step while the bytes stream in (`whole`:
    the state is the whole tree, so a checkpoint leaf it lacks is an error; a pipeline stage's is a part).
    A checkpoint of other data stops the run first (`data.record.check_resume`), one trained over other
    frozen params too (`frozen_record`, `functrain.trainer.frozen`); the frozen params are the run's own."""
    latest = manager.latest_step() if manager is not None else None
    if latest is None:
        return state
    try:
        meta = manager.custom_metadata(latest).get("functrain", {})
        frozen_lib.check(meta.get(frozen_lib.KEY), frozen_record, manager.step_path(latest))
        saved = meta.get("data")
        allow = bool(config.data.allow_changed)
        changed = data_record_lib.check_resume(saved, data_record, latest, allow)
        if changed:
            print_fn(changed)
        return _restore(manager, latest, state, train_step, batch_at, config, print_fn, whole)
    except frozen_lib.FrozenMismatch:
        raise  # (an earlier step was trained over the same other base)
    except ckpt_lib.CheckpointError as exc:
        if isinstance(exc, ckpt_lib.MismatchError):
            raise _mismatch(exc, manager, latest) from None
        raise ckpt_lib.CheckpointError(f"{exc}; {_how_to_skip(manager, latest)}") from None


def _how_to_skip(manager, latest: int) -> str:
    """The command that resumes from the step before `latest` (moving `latest` aside, losing nothing)."""
    path = manager.step_path(latest)
    earlier = [s for s in manager.all_steps() if s < latest]
    if not earlier:
        return (
            f"no earlier step is kept: move it aside (mv {path} {path}.corrupt) and run the same command to start over"
        )
    return (
        f"to resume from step {earlier[-1]}, move this one aside (mv {path} {path}.corrupt) and run the same "
        "command again"
    )


def _mismatch(exc, manager, latest: int) -> Exception:
    """A state that does not fit the checkpoint: as it is when the params differ, else how to keep the params."""
    if any(name.startswith("params.") for name in exc.leaves):
        return exc  # the params do not fit: starting from them cannot help
    return ckpt_lib.CheckpointError(  # what does not fit is optimizer state (or another state field)
        f"{exc}; to keep its params under this optimizer, start a new --workdir with "
        f"--config.checkpoint.init_from={manager.step_path(latest)}"
    )


def _restore(
    manager, latest: int, state: TrainState, train_step, batch_at, config, print_fn, whole: bool = True
) -> TrainState:
    """`maybe_restore`'s restore of step `latest` (MismatchError when the state does not fit)."""
    t0 = time.perf_counter()
    held = frozen_lib.saved(state)  # what the checkpoint holds: no frozen params
    future = manager.restore(latest, ckpt_lib.abstract(held), strict=whole)
    read_done: list[float] = []  # when the bytes were in (the compile below may take longer)
    future.add_done_callback(lambda _: read_done.append(time.perf_counter()))
    configured = optim_lib.get_hyperparams(state)  # read now: the compile below consumes `state`
    if not config.checkpoint.async_restore:
        future.result()  # blocking restore: the bytes first, compilation after (for comparison)
    elif config.compile and batch_at is not None:  # (None: batches that need the restored params)
        # Compile now, on the fresh state (consumed and thrown away), while TensorStore reads.
        train_step(state, batch_at(latest))
    restored = future.result().replace(frozen=state.frozen)  # (never written by the step: still whole)
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
        print_fn(
            f"hyper-parameters differ from the config ({diff}); keeping the checkpoint's "
            "(checkpoint.resume_hyperparams=checkpoint)"
        )
        return restored
    print_fn(
        f"hyper-parameters from the config replace the checkpoint's: {diff} "
        "(--config.checkpoint.resume_hyperparams=checkpoint keeps the checkpoint's)"
    )
    return optim_lib.set_hyperparams(restored, **changed)
