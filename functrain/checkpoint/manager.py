"""Manager: numbered checkpoints under one directory, async save, retention, validated restore."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import threading
import warnings
from typing import Any

import torch

from . import _dist, orbax_format, reader, tsspec
from .errors import CheckpointError, one_line
from .writer import AsyncWriter


class Manager:
    """Saves and restores numbered checkpoints ``<directory>/<step>/`` in the Orbax orbax_format.

    Saves are asynchronous: ``save`` blocks only for the previous save and the host snapshot; the
    write, the cross-rank barrier and the commit (rename of ``<step>.orbax-checkpoint-tmp``) run in a
    background thread on a gloo process group created here (so construct the Manager on every rank
    at the same point). Only committed steps are listed; directories left by a crash
    (``*.orbax-checkpoint-tmp*``) are ignored and removed by rank 0 at construction. Works on one
    process without torch.distributed and on N processes when it is initialized.

    Args:
      directory: root directory of the checkpoints (created if needed).
      keep: keep the last ``keep`` committed checkpoints (None: keep all).
      every: ``should_save(step)`` is true for multiples of ``every``.
      keep_every: additionally keep every checkpoint whose step is a multiple of this, forever.
      compression: "zstd" (default) or None.
      group: process group for the background barriers (default: a new gloo group).
      reuse_buffers: keep the host snapshot buffers between saves (default True): the blocking part
        of a save becomes a memcpy, at the price of one host copy of this rank's shards held while
        the Manager lives (pinned memory for CUDA tensors).

    Example:
      >>> with Manager("/runs/gpt/ckpt", keep=3, every=1000) as mgr:
      ...     if mgr.latest_step() is not None:
      ...         state = mgr.restore(template=abstract_state).result()
      ...     for step in range(start, steps):
      ...         state, metrics = train_step(state, batch(step))
      ...         mgr.save(step, state)          # no-op unless should_save(step)
    """

    def __init__(
        self,
        directory: str,
        keep: int | None = 3,
        every: int = 1,
        keep_every: int | None = None,
        *,
        compression: str | None = "zstd",
        group=None,
        reuse_buffers: bool = True,
    ):
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 or None, got {keep}")
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
        if compression not in tsspec.COMPRESSIONS:
            raise ValueError(f"compression must be one of {tsspec.COMPRESSIONS}, got {compression!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep, self.every, self.keep_every = keep, every, keep_every
        self.compression = compression
        self._writer = AsyncWriter(group, reuse_buffers=reuse_buffers)
        self._lock = threading.Lock()
        self._pending_step: int | None = None
        self._rank = _dist.rank()
        status = None
        if self._rank == 0:
            try:
                os.makedirs(self.directory, exist_ok=True)
                for tmp in orbax_format.tmp_dirs(self.directory):
                    shutil.rmtree(tmp, ignore_errors=True)
            except OSError as e:
                status = one_line(e)
        error = _dist.first_error(_dist.exchange(self._writer.group, status))
        if error is not None:
            raise CheckpointError(f"checkpoint directory {self.directory}: cannot be prepared ({error})")
        self._steps = self._scan()

    def _scan(self) -> list[int]:
        """Committed steps on disk (integer directories holding a commit marker), sorted."""
        return sorted(
            step
            for step, path in orbax_format.step_dirs(self.directory).items()
            if os.path.exists(os.path.join(path, orbax_format.COMMIT_MARKER))
        )

    def reload(self) -> None:
        """Re-reads the committed steps from disk (after another program changed the directory)."""
        self.wait()
        with self._lock:
            self._steps = self._scan()

    def step_path(self, step: int) -> str:
        """The directory of checkpoint ``step``."""
        return os.path.join(self.directory, str(int(step)))

    def all_steps(self) -> list[int]:
        """The committed steps, ascending (a save still in flight is not listed)."""
        with self._lock:
            return list(self._steps)

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none."""
        with self._lock:
            return self._steps[-1] if self._steps else None

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would save: ``step`` is a multiple of ``every``, not saved or being saved."""
        with self._lock:
            return step % self.every == 0 and step not in self._steps and step != self._pending_step

    def save(self, step: int, state: Any, force: bool = False, *, custom_metadata: dict | None = None) -> bool:
        """Starts saving ``state`` as checkpoint ``step`` if ``should_save(step)`` or ``force``.

        Waits for the previous save (re-raising its error), snapshots the local shards to host
        memory and returns; call on every rank.

        Args:
          step: the step number (the directory name).
          state: pytree of tensors/DTensors; free to mutate or donate once this returns.
          force: save even if ``step`` is not a multiple of ``every``.
          custom_metadata: a JSON-serializable dict kept with the checkpoint (``custom_metadata(step)``
            reads it; orbax's ``CheckpointManager.metadata(step).custom_metadata`` too).

        Returns:
          True if a save was started, False if skipped.

        Example:
          >>> mgr.save(step, state)
          >>> mgr.save(final_step, state, force=True); mgr.wait()
        """
        step = int(step)
        if not (force or self.should_save(step)):
            return False  # without waiting for a save in flight: the training loop keeps going
        self.wait()
        if step in self.all_steps():
            raise CheckpointError(
                f"checkpoint {self.step_path(step)} already exists; restore it or save under another step"
            )
        with self._lock:
            self._pending_step = step
        self._writer.save(
            self.step_path(step),
            state,
            compression=self.compression,
            on_commit=lambda: self._committed(step),
            custom_metadata=custom_metadata,
        )
        return True

    def _committed(self, step: int) -> None:
        """Background, every rank: records ``step`` and applies retention (rank 0 deletes)."""
        with self._lock:
            self._pending_step = None
            self._steps = sorted(set(self._steps) | {step})
            drop = [s for s in self._steps if not self._keeps(s)]
            self._steps = [s for s in self._steps if s not in drop]
        if self._rank == 0:
            for s in drop:
                self._delete(s)

    def _keeps(self, step: int) -> bool:
        """Whether retention keeps ``step`` (caller holds the lock)."""
        if self.keep_every is not None and step % self.keep_every == 0:
            return True
        return self.keep is None or step in self._steps[-self.keep :]

    def _delete(self, step: int) -> None:
        """Rank 0: removes a checkpoint, renaming it to a tmp name first so a crash never leaves half of one."""
        path = self.step_path(step)
        doomed = f"{orbax_format.tmp_path(path)}-deleting"
        try:
            os.rename(path, doomed)
            shutil.rmtree(doomed)
        except OSError as e:
            warnings.warn(f"checkpoint {path}: could not delete old checkpoint ({e})", stacklevel=2)

    def restore(
        self,
        step: int | None = None,
        template: Any = None,
        *,
        device: torch.device | str | None = None,
        allow_cast: bool = False,
        strict: bool = False,
    ) -> concurrent.futures.Future:
        """Restores checkpoint ``step`` (default: the latest) onto ``template``; see ``reader.restore``.

        Validates first and raises one CheckpointError naming the checkpoint, the leaf and the fix.

        Args:
          step: the step to restore, or None for the latest committed one.
          template: pytree of tensors / DTensors (meta is fine) / ArraySpec giving structure, shapes,
            dtypes and target meshes; None restores everything as plain CPU tensors.
          device: device for meta tensors / ArraySpecs without one (default CPU).
          allow_cast: convert stored dtypes to the template's instead of raising on a mismatch.
          strict: refuse checkpoint leaves the template does not name.

        Returns:
          A concurrent.futures.Future resolving to the restored pytree.

        Example:
          >>> state = mgr.restore(template=abstract(state)).result()
        """
        self.wait()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"checkpoint directory {self.directory}: no committed checkpoint to restore")
        return reader.restore(self.step_path(step), template, device=device, allow_cast=allow_cast, strict=strict)

    def metadata(self, step: int | None = None) -> dict[str, reader.ArrayInfo]:
        """Shapes/dtypes/chunks of checkpoint ``step`` (default: the latest); see ``read_metadata``."""
        self.wait()
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"checkpoint directory {self.directory}: no committed checkpoint")
        return reader.read_metadata(self.step_path(step))

    def custom_metadata(self, step: int | None = None) -> dict:
        """The ``custom_metadata`` saved with checkpoint ``step`` (default: the latest; {} when none).

        Example:
          >>> mgr.save(100, state, custom_metadata={"data": "v2"}); mgr.wait()
          >>> mgr.custom_metadata(100)
          {'data': 'v2'}
        """
        self.wait()
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"checkpoint directory {self.directory}: no committed checkpoint")
        return orbax_format.read_custom_metadata(self.step_path(step))

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is committed; re-raises its error."""
        try:
            self._writer.wait()
        finally:  # committed (already recorded) or failed: either way nothing is in flight now
            with self._lock:
                self._pending_step = None

    def close(self) -> None:
        """Waits for the save in flight and shuts the background thread down (call on every rank)."""
        try:
            self.wait()
        finally:
            self._writer.close()

    def __enter__(self) -> Manager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
