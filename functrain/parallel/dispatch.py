"""`layout_of(params)`: the params' `Layout`, `LOCAL` or the mesh's `Spmd` (see `parallel.layout`).

Plain tensors get `LOCAL`, whose methods are identities, so a single-process step runs no DTensor
code (the module `parallel.spmd` is imported with `functrain.parallel`, for its public names).
"""

from __future__ import annotations

from typing import Any

from functrain import tree as tree_lib
from functrain.parallel.layout import LOCAL, Layout, is_dtensor

__all__ = ["layout_of"]

PyTree = Any

# One Spmd per mesh object (its Python-level bookkeeping is reused by every trace), keyed by
# identity: DeviceMesh compares equal by shape and axis names, so two meshes built one after the
# other (each with its own process groups) would share one Spmd and the second mesh's params
# would run their collectives on the first mesh's groups.
_SPMD: dict = {}


def layout_of(params: PyTree) -> Layout:
    """The `Layout` of a params tree: `LOCAL` for plain tensors, the mesh's `Spmd` for DTensors.

    Args:
      params: the params pytree (all plain tensors, or all DTensors on one mesh).

    Returns:
      A `Layout`.

    Raises:
      ValueError: a mix of DTensors and plain tensors, or DTensors on different meshes.

    Example:
      >>> layout_of(state.params).dp_world
      1
    """
    first = next(iter(tree_lib.leaves(params)), None)
    if not is_dtensor(first):
        return LOCAL
    from functrain.parallel import spmd  # DTensor-only machinery, loaded on first use

    mesh = spmd.mesh_of(params)  # validates: every leaf a DTensor on one mesh
    lay = _SPMD.get(id(mesh))
    if lay is None:  # (the Spmd holds its mesh, so the id is never reused while the entry lives)
        lay = _SPMD[id(mesh)] = spmd.Spmd(mesh)
    return lay
