"""One run per workdir: the main process holds an advisory lock on `<workdir>/.lock` while it trains.

Internals: docs/internals.md "functrain.trainer.workdir_lock".

Example:
    >>> with workdir_lock.hold("runs/gpt", ctx.is_main_process):
    ...     train()
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import torch

from functrain.trainer.validate import ConfigError

__all__ = ["hold", "LOCK_FILE"]

LOCK_FILE = ".lock"
"""The lock file's name inside the workdir."""


def _try_lock(workdir: Path) -> tuple[int | None, str | None]:
    """(fd holding the lock, None), or (None, the error line) when another process holds it."""
    workdir.mkdir(parents=True, exist_ok=True)
    fd = os.open(workdir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 256).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        return None, (
            f"workdir {workdir} is in use by another run ({holder}); wait for it to end or pass another --workdir"
        )
    os.ftruncate(fd, 0)
    os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}\n".encode())
    return fd, None


def _from_main(error: str | None) -> str | None:
    """The main process's `error`, on every rank of an initialized process group."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return error
    box = [error]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def hold(workdir: str | Path, is_main_process: bool = True) -> Iterator[None]:
    """Holds the workdir's lock for the duration of the `with` block (on the main process).

    Args:
      workdir: the run directory (created if missing).
      is_main_process: whether this process takes the lock (rank 0); the others only learn whether
        it got it.

    Returns:
      A context manager; the lock is released when the block ends (or the process dies).

    Raises:
      ConfigError: another live process holds the lock (one line naming its host and pid), on
        every rank.

    Example:
      >>> with workdir_lock.hold(workdir, ctx.is_main_process):
      ...     summary = _train(...)
    """
    fd, error = None, None
    if is_main_process:
        try:
            fd, error = _try_lock(Path(workdir))
        except OSError as exc:  # reported on every rank, like a held lock
            error = f"workdir {workdir}: {exc.strerror or exc}; pass a writable --workdir"
    error = _from_main(error)
    if error is not None:
        raise ConfigError(error)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing the last descriptor releases the flock
