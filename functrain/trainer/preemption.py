"""Preemption: SIGTERM and a first Ctrl-C become a flag the loop checks after each step, agreed over
all ranks, so the run saves the step it is at and ends cleanly.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["PreemptionFlag"]


def _silent(*args, **kwargs) -> None:
    """The default print_fn: says nothing."""


class PreemptionFlag:
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

    def signalled(self) -> bool:
        """Whether this process has received the signal (no agreement over ranks: for a stop before any step)."""
        return self._flag

    def requested(self) -> bool:
        """Whether any rank got SIGTERM or Ctrl-C (distributed: as of the previous check)."""
        if self._group is None:
            return self._flag
        agreed = self._collect()
        buf = np.array([int(self._flag)], dtype=np.int64)  # host memory the all-reduce writes into
        work = torch.distributed.all_reduce(
            torch.from_numpy(buf), op=torch.distributed.ReduceOp.MAX, group=self._group, async_op=True
        )
        self._pending = (work, buf)
        return agreed

    def agree(self) -> bool:
        """Whether any rank got SIGTERM or Ctrl-C so far (distributed: a blocking all-reduce; every rank
        calls it at the same point, before the first step)."""
        if self._group is None:
            return self._flag
        self._collect()
        flag = torch.tensor([int(self._flag)], dtype=torch.int64)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

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
