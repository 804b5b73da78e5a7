"""Reading Orbax checkpoints (ours or stock orbax's) onto any mesh, asynchronously.

``restore`` validates the checkpoint against the template up front (commit marker, ``_METADATA``,
every leaf present with the expected shape and dtype), raising one CheckpointError if anything is
off, then issues one TensorStore read per leaf for exactly the region this rank's shard needs and
returns a Future; the caller can compile its step while the bytes stream in.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import difflib
import math
import os
import threading
from typing import Any

import optree
import tensorstore as ts
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from . import orbax_format, tsspec
from .errors import CheckpointError, MismatchError, one_line
from .sharding import ArraySpec, Box, full_box, shard_box

_FIX_TEMPLATE = "restore onto a model with the same config or start a fresh workdir"
_FIX_CORRUPT = "the checkpoint is corrupt; restore an earlier step"


class RestoreFuture(concurrent.futures.Future):
    """A restore's future: it resolves to the restored tree (or raises its CheckpointError)."""


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """Abstract metadata of one stored array.

    Attributes:
      name: the '.'-joined tree path (e.g. ``params.wte.weight``).
      path: the tree path as a tuple of string keys.
      shape: the global shape.
      dtype: the torch dtype (or the TensorStore dtype name if torch has none).
      chunks: the stored chunk shape.
    """

    name: str
    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype | str
    chunks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Target:
    """Where one leaf is restored to: global shape/dtype, this rank's box, device, mesh."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    box: Box | None
    device: torch.device
    mesh: DeviceMesh | None = None
    placements: tuple[Placement, ...] | None = None


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device a DTensor's local tensor lives on for ``mesh`` on this rank."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def _mesh_target(shape, dtype, mesh: DeviceMesh, placements, device: torch.device) -> _Target:
    """Target of a leaf restored as a DTensor on ``mesh``."""
    coord = mesh.get_coordinate()
    box = None if coord is None else shard_box(shape, tuple(mesh.mesh.shape), coord, placements)
    return _Target(tuple(shape), dtype, box, device, mesh, tuple(placements))


def _target(name: str, leaf: Any, default_device: torch.device) -> _Target:
    """Resolves one template leaf (tensor, DTensor, meta tensor or ArraySpec) to a _Target."""
    if isinstance(leaf, DTensor):
        local_device = leaf.to_local().device
        device = _mesh_device(leaf.device_mesh) if local_device.type == "meta" else local_device
        return _mesh_target(leaf.shape, leaf.dtype, leaf.device_mesh, leaf.placements, device)
    if isinstance(leaf, torch.Tensor):
        device = default_device if leaf.device.type == "meta" else leaf.device
        return _Target(tuple(leaf.shape), leaf.dtype, full_box(leaf.shape), device)
    if isinstance(leaf, ArraySpec):
        if leaf.mesh is not None:
            return _mesh_target(leaf.shape, leaf.dtype, leaf.mesh, leaf.placements, _mesh_device(leaf.mesh))
        device = torch.device(leaf.device) if leaf.device is not None else default_device
        return _Target(leaf.shape, leaf.dtype, full_box(leaf.shape), device)
    raise TypeError(
        f"template leaf {name!r} is a {type(leaf).__name__}; use a tensor, DTensor (meta is fine) or ArraySpec"
    )


def _kvstore(path: str, meta: orbax_format.TreeMetadata, name: str) -> dict[str, Any]:
    """kvstore spec of one stored array (OCDBT root database, or per-array dir without OCDBT)."""
    item = orbax_format.item_dir(path)
    return tsspec.ocdbt_kvstore(item, name) if meta.use_ocdbt else tsspec.file_kvstore(item, name)


def _open_all(path: str, meta: orbax_format.TreeMetadata, keys: list[orbax_format.LeafKey], ctx, casts=None) -> list:
    """Opens the stored arrays of ``keys`` concurrently; CheckpointError names the first failure."""
    futures = []
    for i, key in enumerate(keys):
        spec = tsspec.read_spec(_kvstore(path, meta, key.name), meta.use_zarr3)
        if casts is not None and casts[i] is not None:
            spec = tsspec.cast_spec(spec, casts[i])
        futures.append(ts.open(spec, open=True, read=True, context=ctx))
    stores = []
    for key, fut in zip(keys, futures):
        try:
            stores.append(fut.result())
        except Exception as e:
            raise CheckpointError(
                f"checkpoint {path}: leaf {key.name!r} cannot be opened ({one_line(e)}); {_FIX_CORRUPT}"
            ) from None
    return stores


def _stored_dtype(store) -> torch.dtype | str:
    """The torch dtype of an open store (its TensorStore name if torch has none)."""
    return tsspec.torch_dtype(store.dtype.name) or store.dtype.name


def _check_value_type(path: str, stored: orbax_format.StoredLeaf) -> None:
    """Raises CheckpointError if a stored leaf is not an array (e.g. an orbax string)."""
    if stored.value_type not in orbax_format.ARRAY_VALUE_TYPES:
        raise CheckpointError(
            f"checkpoint {path}: leaf {stored.key.name!r} holds a {stored.value_type}, not an array; "
            "remove it from the template"
        )


def _infos(path: str, meta: orbax_format.TreeMetadata, ctx) -> dict[str, ArrayInfo]:
    """ArrayInfo of every stored array (opens each one to read its zarr metadata)."""
    keys = [s.key for s in meta.leaves.values() if s.value_type in orbax_format.ARRAY_VALUE_TYPES]
    stores = _open_all(path, meta, keys, ctx)
    infos = {}
    for key, store in zip(keys, stores):
        chunks = tuple(store.chunk_layout.read_chunk.shape or ())
        infos[key.name] = ArrayInfo(key.name, key.path, tuple(store.shape), _stored_dtype(store), chunks)
    return infos


def read_metadata(path: str) -> dict[str, ArrayInfo]:
    """Reads the abstract metadata (shape, dtype, chunks) of every array in a checkpoint.

    Args:
      path: a checkpoint directory (``<root>/<step>``), ours or written by orbax.

    Returns:
      {'.'-joined tree path: ArrayInfo}, in the order of the checkpoint's ``_METADATA``.

    Example:
      >>> read_metadata("/ckpt/100")["params.wte.weight"].shape
      (256, 64)
    """
    path = _abspath(path)
    return _infos(path, orbax_format.read_tree_metadata(path), tsspec.new_context())


def _abspath(path) -> str:
    """Absolute path string of a path-like."""
    return os.path.abspath(os.fspath(path))


def _spec_tree(path: str, meta: orbax_format.TreeMetadata, ctx) -> Any:
    """Nested dicts/lists of ArraySpec mirroring the stored tree, empty subtrees included (as orbax)."""
    root: dict = {}

    def put(keys: tuple[str, ...], value: Any) -> None:
        """Sets ``value`` at ``keys`` under ``root``, creating dicts on the way."""
        node = root
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value

    for info in _infos(path, meta, ctx).values():
        if not isinstance(info.dtype, torch.dtype):
            raise CheckpointError(f"checkpoint {path}: leaf {info.name!r} has dtype {info.dtype}, which torch lacks")
        put(info.path, ArraySpec(info.shape, info.dtype))
    for empty in meta.empties.values():
        if empty.key.path:
            put(empty.key.path, orbax_format.empty_value(empty.value_type))
    sequences = {
        s.key.path[: i + 1]
        for s in (*meta.leaves.values(), *meta.empties.values())
        for i, t in enumerate(s.key.key_types)
        if t == orbax_format.KEY_SEQUENCE
    }

    def listify(node: Any, prefix: tuple[str, ...]) -> Any:
        """Turns dicts keyed by all the sequence indices 0..n-1 into lists (checkpoints written without
        empty-node records leave gaps where empty subtrees were: those stay dicts)."""
        if not isinstance(node, dict):
            return node
        out = {k: listify(v, prefix + (k,)) for k, v in node.items()}
        if out and all(prefix + (k,) in sequences and k.isdigit() for k in out):
            if sorted(int(k) for k in out) == list(range(len(out))):
                return [out[k] for k in sorted(out, key=int)]
        return out

    return listify(root, ())


def metadata_tree(path: str) -> Any:
    """The checkpoint's tree as nested dicts/lists of ArraySpec (plain CPU tensors), like orbax's.

    Args:
      path: a checkpoint directory.

    Returns:
      Nested dicts (and lists where orbax recorded sequence keys) with ArraySpec leaves; usable as a
      restore template (NamedTuples come back as dicts keyed by field name).

    Example:
      >>> template = metadata_tree("/ckpt/100")
      >>> everything = restore("/ckpt/100", template).result()
    """
    path = _abspath(path)
    return _spec_tree(path, orbax_format.read_tree_metadata(path), tsspec.new_context())


def _missing_error(path: str, meta: orbax_format.TreeMetadata, missing: list[orbax_format.LeafKey]) -> CheckpointError:
    """CheckpointError for template leaves the checkpoint lacks, with the closest stored name."""
    names = [s.key.name for s in meta.leaves.values()]
    first = missing[0].name
    close = difflib.get_close_matches(first, names, n=1)
    details = [f"{len(missing) - 1} more template leaves missing"] if len(missing) > 1 else []
    details.append(f"the checkpoint has {len(names)} leaves" + (f", closest: {close[0]!r}" if close else ""))
    return MismatchError(
        f"checkpoint {path}: leaf {first!r} is missing ({'; '.join(details)}); {_FIX_TEMPLATE}",
        [k.name for k in missing],
    )


def _check_no_extra(path: str, meta: orbax_format.TreeMetadata, keys: list[orbax_format.LeafKey]) -> None:
    """CheckpointError if the checkpoint holds arrays the template does not name (strict restores)."""
    wanted = {key.path for key in keys}
    extra = [s.key.name for p, s in meta.leaves.items() if p not in wanted]
    if extra:
        more = f" ({len(extra) - 1} more)" if len(extra) > 1 else ""
        raise MismatchError(
            f"checkpoint {path}: leaf {extra[0]!r}{more} is in the checkpoint but not in this program's state "
            "(a state field or optimizer state this code does not have); restore it with the code and config "
            "that wrote it, or start a fresh workdir",
            extra,
        )


def _leaf_error(path: str, name: str, e: BaseException) -> CheckpointError:
    """CheckpointError for a leaf whose bytes could not be read."""
    return CheckpointError(f"checkpoint {path}: leaf {name!r} cannot be read ({one_line(e)}); {_FIX_CORRUPT}")


def _to_target(arr, t: _Target) -> torch.Tensor:
    """Turns the numpy array read for ``t`` into the restored tensor or DTensor."""
    if t.box is None:  # this rank is not part of the target mesh
        local = torch.empty((0,) * len(t.shape), dtype=t.dtype, device=t.device)
    else:
        local = tsspec.from_numpy(arr, t.dtype) if arr is not None else torch.empty(t.box.shape, dtype=t.dtype)
        if local.device != t.device:
            local = local.to(t.device)
    if t.mesh is None:
        return local
    stride = tuple(math.prod(t.shape[i + 1 :]) for i in range(len(t.shape)))
    return DTensor.from_local(local, t.mesh, t.placements, run_check=False, shape=torch.Size(t.shape), stride=stride)


def _finish(path, names, targets, reads, treespec, future: concurrent.futures.Future) -> None:
    """Background: waits for the reads, builds the restored tree and resolves ``future``."""
    # Either way the TensorStore futures are dropped before the caller can go on: their dealloc
    # releases the GIL, and a thread that asks for it back while the interpreter is finalizing is
    # ended by a forced unwind through tensorstore's noexcept C++ frames: std::terminate, "terminate
    # called without an active exception" (measured: 13 of 20 runs of restore(...).result() then
    # exit, 400 leaves).
    try:
        tree = _build(path, names, targets, reads, treespec)
    except BaseException as e:  # delivered through the future
        reads.clear()
        future.set_exception(e)
    else:
        reads.clear()
        future.set_result(tree)


def _build(path, names, targets, reads, treespec) -> Any:
    """The restored tree, once every read has finished."""
    out = []
    for name, t, r in zip(names, targets, reads):
        try:
            arr = None if r is None else r.result()
        except Exception as e:
            raise _leaf_error(path, name, e) from None
        out.append(_to_target(arr, t))
    return optree.tree_unflatten(treespec, out)


def restore(
    path: str,
    template: Any = None,
    *,
    device: torch.device | str | None = None,
    allow_cast: bool = False,
    strict: bool = False,
) -> RestoreFuture:
    """Restores a checkpoint onto the structure, shapes, dtypes and meshes of ``template``.

    Validation (commit marker, ``_METADATA``, every template leaf present with matching shape and
    dtype) happens before this returns and raises one CheckpointError. The reads are then in flight:
    each rank reads only the region its shard needs, whatever mesh or placements wrote the checkpoint.
    Leaves are matched by tree path (NamedTuple fields and dict keys by name, sequences by index), so a
    checkpoint written by stock orbax restores too. Checkpoint leaves absent from the template are
    ignored unless ``strict``; template leaves absent from the checkpoint are a `MismatchError`.

    Args:
      path: a checkpoint directory (``<root>/<step>``).
      template: pytree whose leaves are tensors (their device is kept; meta -> ``device``), DTensors
        (restored on their mesh/placements; meta local tensors are fine) or ArraySpec. None restores
        everything as plain tensors in nested dicts/lists (see ``metadata_tree``).
      device: device for meta tensors / ArraySpecs without one (default CPU).
      allow_cast: convert stored dtypes to the template's instead of raising on a mismatch.
      strict: raise if the checkpoint holds an array the template does not name.

    Returns:
      A concurrent.futures.Future resolving to the restored pytree (same structure as the template);
      it raises CheckpointError if a chunk is missing or corrupt. A (non-daemon) thread waits for
      the reads: a program that exits without asking for the result exits once they have finished.

    Example:
      >>> with torch.device("meta"):
      ...     template = init_state(cfg)
      >>> fut = restore("/ckpt/100", template)
      >>> step_fn = compile_step(...)              # overlaps with the reads
      >>> state = fut.result()
    """
    path = _abspath(path)
    meta = orbax_format.read_tree_metadata(path)
    ctx = tsspec.new_context()
    if template is None:
        template = _spec_tree(path, meta, ctx)
    keys, leaves, treespec = orbax_format.flatten(template)
    default_device = torch.device(device) if device is not None else torch.device("cpu")
    targets = [_target(key.name, leaf, default_device) for key, leaf in zip(keys, leaves)]
    if strict:
        _check_no_extra(path, meta, keys)
    missing = [key for key in keys if key.path not in meta.leaves]
    if missing:
        raise _missing_error(path, meta, missing)
    for key in keys:
        _check_value_type(path, meta.leaves[key.path])
    stores = _open_all(path, meta, keys, ctx, [t.dtype for t in targets] if allow_cast else None)
    for key, t, store in zip(keys, targets, stores):
        if tuple(store.shape) != t.shape:
            raise MismatchError(
                f"checkpoint {path}: leaf {key.name!r} has shape {tuple(store.shape)} but the template "
                f"expects {t.shape}; {_FIX_TEMPLATE}",
                [key.name],
            )
        dtype = _stored_dtype(store)
        if dtype != t.dtype:
            raise MismatchError(
                f"checkpoint {path}: leaf {key.name!r} has dtype {str(dtype).removeprefix('torch.')} but the "
                f"template expects {str(t.dtype).removeprefix('torch.')}; make the template match or pass "
                "allow_cast=True",
                [key.name],
            )
    reads = [None if t.box is None or t.box.empty else store[t.box.index()].read() for t, store in zip(targets, stores)]
    names = [k.name for k in keys]
    future = RestoreFuture()
    future.set_running_or_notify_cancel()
    args = (path, names, targets, reads, treespec, future)
    # Not a daemon: the interpreter joins it before finalizing, so it never meets a finalizing
    # interpreter (a read left unwaited-for delays exit until it finishes; local reads do).
    threading.Thread(target=_finish, args=args, name="functrain-ckpt-restore").start()
    return future
