"""gloo process groups that run one collective at a time (a heap-corruption bug of torch's gloo).

Internals: docs/internals.md "functrain.parallel.gloo".
"""

from __future__ import annotations

import datetime
import functools
import inspect
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["backend", "is_gloo", "is_gloo_backend", "options", "premise_problem", "threads_of", "threads_of_backend"]

_PREFIX = "functrain_gloo"


def options() -> Any:
    """A new `ProcessGroupGloo` options object (torch keeps its type private: `_Options`)."""
    return getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009 (private in torch's stubs)


def _create(threads: int, opts, backend_options):
    """The backend registry's creator: a ProcessGroupGloo with `threads` worker threads."""
    gloo = dist.ProcessGroupGloo
    made = options()
    timeout = getattr(backend_options, "_timeout", None)  # a mesh axis's own (backend_override)
    made._timeout = timeout if isinstance(timeout, datetime.timedelta) else opts.timeout
    made._devices = [gloo.create_default_device()]
    made._threads = threads
    group = gloo(opts.store, opts.group_rank, opts.group_size, made)
    group.options.global_ranks_in_group = opts.global_ranks_in_group
    group.options.group_name = opts.group_id
    return group


def backend(threads: int = 1) -> str:
    """The name of a torch.distributed backend whose gloo groups get `threads` worker threads.

    Registered with torch's backend registry on first use (CPU tensors). With one thread a group
    runs its collectives one at a time, in issue order (still in the background of the caller).

    Args:
      threads: worker threads per gloo group (torch's own gloo backend uses 2; see the module docstring).

    Returns:
      The backend name, for `dist.init_process_group(backend=...)` or `dist.new_group(backend=...)`.

    Example:
      >>> dist.init_process_group(gloo.backend(1))
      >>> threads_of(dist.group.WORLD)
      1
    """
    if threads < 1:
        raise ValueError(f"gloo worker threads must be >= 1, got {threads}")
    name = f"{_PREFIX}{threads}"
    if not hasattr(dist.Backend, name.upper()):  # (registered once per process)
        dist.Backend.register_backend(name, functools.partial(_create, threads), extended_api=True, devices=["cpu"])
    return name


def is_gloo_backend(name: str) -> bool:
    """Whether backend `name` is gloo: torch's own or one from `backend`.

    Args:
      name: a backend name (`dist.get_backend()`).

    Returns:
      True for "gloo" and functrain's gloo backends.

    Example:
      >>> is_gloo_backend(dist.get_backend())
      True
    """
    return name == "gloo" or name.startswith(_PREFIX)


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
    return threads_of_backend(_cpu_backend(group))


def threads_of_backend(backend) -> int | None:
    """The worker threads of a gloo backend object (None for anything else)."""
    return getattr(getattr(backend, "options", None), "_threads", None)


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


def premise_problem() -> str | None:
    """What no longer holds of this module's premises on the installed torch (None: all hold).

    torch's gloo groups default to two worker threads (the bug's condition), the backend registry
    takes a creator with `extended_api` and `devices`, and a 1-rank group made through
    `backend(1)`'s creator has one worker thread. A self-test of `functrain.compiler.workarounds`.

    Returns:
      None, or one line naming what changed.

    Example:
      >>> assert premise_problem() is None
    """
    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch has no gloo"
    threads = options()._threads
    if threads != 2:
        return f"gloo's default is {threads} worker threads, not 2"
    if not {"extended_api", "devices"} <= set(inspect.signature(dist.Backend.register_backend).parameters):
        return "Backend.register_backend takes no extended_api/devices"
    name = backend(1)
    opts = dist.distributed_c10d._DistributedBackendOptions()
    opts.store, opts.group_rank, opts.group_size = dist.HashStore(), 0, 1
    opts.timeout, opts.group_id, opts.global_ranks_in_group = datetime.timedelta(seconds=30), "check", [0]
    group = dist.Backend._plugins[name.upper()].creator_fn(opts, None)
    got = threads_of_backend(group)
    return None if got == 1 else f"a group of backend {name} got {got} worker threads"
