"""`layout_of(params)`: the params' `Layout`, `LOCAL` or the mesh's `Spmd` (see `parallel.layout`).

Plain tensors get `LOCAL`, whose methods are identities, so a single-process step runs no DTensor
code (the module `parallel.spmd` is imported with `functrain.parallel`, for its public names).
"""

from __future__ import annotations

from typing import Any

from functrain import tree as tree_lib
from functrain.parallel.layout import LOCAL, Layout, is_dtensor

__all__ = ["configure", "layout_of"]

PyTree = Any

# One Spmd per mesh object (its Python-level bookkeeping is reused by every trace), keyed by
# identity: DeviceMesh compares equal by shape and axis names, so two meshes built one after the
# other (each with its own process groups) would share one Spmd and the second mesh's params
# would run their collectives on the first mesh's groups.
_SPMD: dict = {}  # id(mesh) -> the mesh's Spmd now
_MADE: dict = {}  # (id(mesh), options) -> its Spmd: going back to earlier options reuses the object
_OPTIONS: dict = {}  # a mesh, by equality (its sub-meshes over the same axes alike) -> its options


def configure(mesh, **options) -> None:
    """Sets how the params on `mesh` (and on its sub-meshes) are gathered and reduced.

    The options are the `Spmd` keyword arguments that `layout_of` builds the params' layout with.
    Params sharded onto `mesh` live on its sub-mesh of the axes with more than one rank
    (`parallel.sharding.active_mesh`); both get the options. A train step picks its compiled
    function by layout, so each set of options compiles once (going back to earlier options reuses
    their layout and its graph).

    Args:
      mesh: the DeviceMesh (e.g. `ctx.mesh`).
      **options: `functrain.parallel.spmd.Spmd`'s keyword arguments (`bucket_numel`,
        `reduce_scatter`); none: the defaults.

    Raises:
      ValueError: an unknown route (one line); TypeError: an unknown option.

    Example:
      >>> parallel.configure(ctx.mesh, reduce_scatter="all_to_all")
    """
    from functrain.parallel import spmd
    from functrain.parallel.sharding import active_mesh

    key = tuple(sorted(options.items()))
    made = spmd.Spmd(mesh, **options)  # refuses a bad option before anything changes
    _MADE.setdefault((id(mesh), key), made)
    for m in (mesh, active_mesh(mesh)):
        _OPTIONS[m] = key
    _SPMD.clear()  # every mesh looks its options up again


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
        options = _OPTIONS.get(mesh, ())
        if (id(mesh), options) not in _MADE:
            _MADE[id(mesh), options] = spmd.Spmd(mesh, **dict(options))
        lay = _SPMD[id(mesh)] = _MADE[id(mesh), options]
    return lay
