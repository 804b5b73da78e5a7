"""Digests of params: one sha256 over every tensor's name, shape, dtype and bytes, the same on any mesh.

A checkpoint records the digest of the params it was trained over (a LoRA run's frozen base, a preference run's
reference) so that a resume or an export over other params stops in one line.
"""

from __future__ import annotations

import hashlib

import torch

from functrain import parallel

__all__ = ["digest", "tensor_digests"]


def tensor_digests(params: dict) -> dict[str, tuple[str, int]]:
    """{name: (the tensor's sha256, its number of elements)} of every rank's `params`: sharded tensors gathered one at
    a time, and under torch.distributed the ranks' tables pooled (a pipeline rank holds only its stages'); a
    collective: every rank calls it.

    Args:
      params: {name: tensor or DTensor}.

    Returns:
      The table of the whole model's tensors, the same on every rank.

    Example:
      >>> tensor_digests({"w": torch.zeros(2)})["w"][1]
      2
    """
    mine = {}
    for name in sorted(params):
        t = params[name]
        whole = (t.full_tensor() if parallel.is_dtensor(t) else t).detach().to("cpu").contiguous()
        h = hashlib.sha256(f"{name}{tuple(whole.shape)}{whole.dtype}".encode())
        h.update(whole.reshape(-1).view(torch.uint8).numpy().tobytes())
        mine[name] = (h.hexdigest(), whole.numel())
        del whole
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return mine
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    return {name: value for part in every for name, value in part.items()}


def digest(params: dict | None = None, *, table: dict | None = None) -> str:
    """One sha256 (hex) over the params' tensor digests in name order, whatever the mesh (a collective).

    Args:
      params: {name: tensor or DTensor}.
      table: `tensor_digests(params)` when the caller has it already (then `params` is not read).

    Returns:
      64 hex digits.

    Example:
      >>> digest(state.frozen)[:8]
      '3f2a9c1e'
    """
    table = tensor_digests(params or {}) if table is None else table
    return hashlib.sha256("".join(f"{n}:{table[n][0]};" for n in sorted(table)).encode()).hexdigest()
