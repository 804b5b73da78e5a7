"""Stable compile-cache keys for sharded steps: a DeviceMesh pickles without its process-local hash.

A compiled step over DTensors takes the DeviceMesh as a graph input (an opaque object), and both of
torch's on-disk compile caches (inductor's FX graph cache, the AOTAutograd cache) key an entry by
pickling the graph's inputs, the real DeviceMesh among them. torch 2.13's `DeviceMesh.__getstate__`
keeps `_hash`, the mesh's cached `hash(...)` of a tuple holding its axis names: a Python string hash,
salted per process (PYTHONHASHSEED). So every process computed new keys for the same sharded step,
and a restarted or resumed sharded run compiled cold every time, whatever `compile_cache` said.

The only bytes that differed between two processes' keys were `_hash` (docs/results.md has the
cache hits before and after).

`register()` (run by `compiler.maybe_compile` before each compile) installs a `copyreg` reducer for
`DeviceMesh` that is the default reduction with `_hash` left out; unpickling recomputes it lazily
as `DeviceMesh.__hash__` always does, so pickle, `copy.deepcopy` and the caches see the same mesh.
The rest of the state stays in the key, the rank's own coordinates included, so two ranks whose
traced graphs were byte-identical still get distinct entries (inductor may bake rank-specific
details into generated code).
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
