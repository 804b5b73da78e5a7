"""Stable compile-cache keys for sharded steps: a DeviceMesh pickles without its process-local hash.

Internals: docs/internals.md "functrain.compiler.mesh_key".
"""

from __future__ import annotations

import copyreg

import torch.distributed as dist


def _reduce_mesh(mesh):
    """DeviceMesh's default reduction without the per-process `_hash`."""
    state = mesh.__getstate__()
    state.pop("_hash", None)
    return vars(copyreg)["__newobj__"], (type(mesh),), state  # (not in copyreg's stubs)


def register() -> None:
    """Makes DeviceMesh pickle without its per-process hash, so compile-cache keys are stable.

    Idempotent; a no-op where torch has no distributed support.

    Example:
        >>> from functrain.compiler import mesh_key
        >>> mesh_key.register()  # done by `compiler.maybe_compile`
    """
    if not dist.is_available():
        return
    from torch.distributed.device_mesh import DeviceMesh

    copyreg.pickle(DeviceMesh, _reduce_mesh)


def hash_is_pickled() -> bool:
    """Whether `DeviceMesh.__getstate__` keeps `_hash` (the premise of `register`; a workaround self-test)."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.__new__(DeviceMesh)
    mesh.__dict__.update(_hash=12345, device_type="cpu")
    return "_hash" in DeviceMesh.__getstate__(mesh)
