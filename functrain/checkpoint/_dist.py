"""torch.distributed helpers: rank/world with or without a process group, and status exchange."""

from __future__ import annotations

import torch.distributed as dist


def initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without torch.distributed)."""
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    """Number of processes (1 without torch.distributed)."""
    return dist.get_world_size() if initialized() else 1


def new_group():
    """A new gloo process group over all ranks (collective), or None on a single process."""
    if not initialized():
        return None
    from functrain.parallel import gloo

    return dist.new_group(backend=gloo.backend(1))  # one collective at a time (functrain.parallel.gloo)


def exchange(group, status: str | None) -> list[str | None]:
    """All-gathers one status per rank on ``group`` (a barrier that also carries errors).

    Args:
      group: the process group, or None on a single process.
      status: None for success, else an error message.

    Returns:
      The statuses of all ranks, indexed by rank.
    """
    if group is None:
        return [status]
    out: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, status, group=group)
    return out


def first_error(statuses: list[str | None]) -> str | None:
    """The first non-None status, prefixed with its rank, or None if every rank succeeded."""
    for r, s in enumerate(statuses):
        if s is not None:
            return s if len(statuses) == 1 else f"rank {r}: {s}"
    return None
