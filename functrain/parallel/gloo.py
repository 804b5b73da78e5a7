"""gloo process groups that run one collective at a time (a heap-corruption bug of torch's gloo).

torch's `ProcessGroupGloo` runs each group's collectives on a pool of two worker threads sharing
the group's one gloo context. When two collectives of one group are in flight at once (an
all-gather started and not yet waited while the next one is issued: FSDP's prefetch, a bucketed
gather beside DTensor redistributes, a compiled graph that waits late), the process's heap is
sometimes corrupted: a later malloc in a gloo worker thread aborts with "malloc(): unaligned tcache
chunk detected" or segfaults, in `AsyncAllgatherCoalescedWork::allgather_coalesced` (core dumps,
gdb), or a rank is left waiting in a collective forever.

Measured (2-core AMD EPYC, torch 2.13.0+cpu, 4 gloo ranks on a 2 x 2 mesh, OMP_NUM_THREADS=1):
- `bench/gloo_threads.py` (plain torch.distributed: per iteration one all-gather started on the
  dp group, four small all-gathers issued and waited on the same group meanwhile, then the first
  waited): with torch's two threads per group 7 of 7 launches of that loop and its variants died
  within 19-60 s (segfault, "malloc(): unaligned tcache chunk detected", "malloc_consolidate():
  unaligned fastbin chunk detected"); with one thread 3 of 3 launches finished their 6000
  iterations; with two threads but the first all-gather waited before the others (never two in
  flight) 2 of 2 finished.
- The eager per-block sharded step of the 4-rank tests (dp_shard 2 x tp 2, remat full, where
  `Spmd.gather_start` starts a stage's bucketed all-gather and DTensor redistributes its
  tp-sharded weights on the same group meanwhile), 300 steps per launch: 2 of 6 launches died
  with two threads, 0 of 12 with one. In the test suite it was ~1 of 64 launches of the 4-rank
  suite here and 2 of the last 5 CI runs (a rank dead or stuck in scenario stages_fsdp_tp).

gloo's python constructor takes no thread count, and torch.distributed does not pass a gloo
group's options on (only its timeout), so `worker_threads(n)` swaps the class torch.distributed builds
gloo groups with, for the duration of the `with`, for a subclass that asks for n worker threads
(`parallel.setup` creates the default group and the mesh's groups inside `worker_threads(1)`, the
checkpoint writer its barrier group). A group's collectives then run one after the other in
issue order, still asynchronously to the caller: a started all-gather still overlaps the compute
that follows it; two collectives of one group no longer overlap each other (those of different
groups still do: each group has its own context, device and threads). `threads_of(group)` reads a
group's thread count back (tests check it is 1 on every group of a mesh); `is_gloo(group)` tells
whether a group is gloo at all (`parallel.spmd` picks its gradient route by it).
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["worker_threads", "threads_of", "is_gloo"]


def _gloo_class(threads: int):
    """A ProcessGroupGloo subclass built with `threads` worker threads (None without gloo)."""
    base = getattr(dist, "ProcessGroupGloo", None)
    if base is None:
        return None

    class Gloo(base):
        """ProcessGroupGloo(store, rank, size, timeout) with a fixed number of worker threads."""

        def __init__(self, store, rank, size, timeout=datetime.timedelta(minutes=30)):
            if isinstance(timeout, base._Options):  # the constructor's other form: (..., options)
                opts = timeout
            else:
                opts = base._Options()
                opts._timeout = timeout
                opts._devices = [base.create_default_device()]
            opts._threads = threads
            super().__init__(store, rank, size, opts)

    return Gloo


@contextlib.contextmanager
def worker_threads(threads: int = 1):
    """Within it, the gloo process groups torch.distributed creates get `threads` worker threads.

    With one thread a group runs its collectives one at a time, in issue order (still in the
    background of the caller). Nothing else changes: nccl groups, groups created outside it.

    Args:
      threads: worker threads per gloo group (torch's default is 2; see the module docstring).

    Returns:
      A context manager.

    Example:
      >>> with worker_threads(1):
      ...     dist.init_process_group("gloo")
      >>> threads_of(dist.group.WORLD)
      1
    """
    cls = _gloo_class(threads)
    if cls is None or not hasattr(c10d, "ProcessGroupGloo"):
        yield
        return
    real = c10d.ProcessGroupGloo
    c10d.ProcessGroupGloo = cls
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = real


def threads_of(group) -> int | None:
    """The number of worker threads of `group`'s gloo backend (None when it has none).

    Args:
      group: a ProcessGroup (e.g. `mesh.get_group(i)`).

    Returns:
      The thread count, or None for a group without a gloo backend on CPU.

    Example:
      >>> threads_of(ctx.mesh.get_group(0))
      1
    """
    opts = getattr(_cpu_backend(group), "options", None)
    return getattr(opts, "_threads", None)


def is_gloo(group) -> bool:
    """Whether `group` runs the collectives of CPU tensors on gloo.

    Args:
      group: a ProcessGroup (e.g. `mesh.get_group(i)`).

    Returns:
      True when its backend for CPU tensors is a `ProcessGroupGloo`.

    Example:
      >>> is_gloo(ctx.mesh.get_group(0))   # a CPU run under torchrun
      True
    """
    cls = getattr(dist, "ProcessGroupGloo", None)
    return cls is not None and isinstance(_cpu_backend(group), cls)


def _cpu_backend(group):
    """`group`'s backend for CPU tensors, or None where it has none."""
    try:
        return group._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError, AttributeError):
        return None
