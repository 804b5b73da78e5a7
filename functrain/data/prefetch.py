"""The next batches made on a background thread while the step runs.

Internals: docs/internals.md "functrain.data.prefetch".

Example:
    >>> with Prefetcher(task.train_batch, start=state_step) as batches:
    ...     for step in range(state_step, steps):
    ...         state, metrics = train_step(state, batches.get(step))
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import optree
import torch

__all__ = ["Prefetcher"]


class Prefetcher:
    """Makes `batch_at(step)` for the coming steps on a background thread.

    Args:
      batch_at: `step -> batch` (a pytree of tensors), a pure function of the step.
      start: the first step `get` will be asked for.
      depth: how many batches may wait made (2: one in use, one ready).
      device: the batches' device; on CUDA the copies run on a side stream.

    Attributes:
      wait_s: seconds `get` spent waiting for the thread (the loader time the loop sees).
      make_s: seconds the thread spent making batches.

    Example:
      >>> batches = Prefetcher(lambda s: get_batch(tokens, Batching(8, 64), s), 0)
      >>> x, y = batches.get(0)
    """

    def __init__(
        self, batch_at: Callable[[int], Any], start: int, *, depth: int = 2, device: torch.device | str | None = None
    ):
        self.batch_at, self.depth = batch_at, max(1, depth)
        self.device = torch.device(device) if device is not None else None
        cuda = self.device is not None and self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if cuda else None
        self.wait_s = self.make_s = 0.0
        self._start(start)

    def _start(self, step: int) -> None:
        """A fresh thread making step, step + 1, ..."""
        self._next = step
        self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._work, args=(step, self._queue, self._stop), name="functrain-prefetch", daemon=True
        )
        self._thread.start()

    def _work(self, step: int, q: queue.Queue, stop: threading.Event) -> None:
        """The thread: makes batches in step order until stopped (an exception goes to `get`)."""
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        batch = self.batch_at(step)
                        event = torch.cuda.Event()
                        event.record(self._stream)
                else:
                    batch, event = self.batch_at(step), None
                item: tuple[int, Any, Any, BaseException | None] = (step, batch, event, None)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the loop's thread by `get`
                item = (step, None, None, exc)
            self.make_s += time.perf_counter() - t0
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[3] is not None:
                return
            step += 1

    def get(self, step: int) -> Any:
        """The batch of `step` (made ahead when `step` follows the previous one).

        Args:
          step: the step about to run.

        Returns:
          `batch_at(step)`.

        Raises:
          Whatever `batch_at(step)` raised.

        Example:
          >>> batch = batches.get(step)
        """
        step = int(step)
        if step != self._next:
            self.close()
            self._start(step)
        t0 = time.perf_counter()
        got, batch, event, exc = self._queue.get()
        self.wait_s += time.perf_counter() - t0
        self._next = step + 1
        if exc is not None:
            raise exc
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in optree.tree_leaves(batch):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(current)
        return batch

    def close(self) -> None:
        """Stops the thread (a batch it is making is finished and dropped)."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
