"""Writing a pytree of tensors/DTensors as an Orbax checkpoint, synchronously or in the background.

Internals: docs/internals.md "functrain.checkpoint.writer".
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import json
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import tensorstore as ts
import torch
from torch.distributed.tensor import DTensor

from . import _dist, orbax_format, tsspec
from .errors import CheckpointError, one_line
from .sharding import Box, check_placements, chunk_shape, full_box, mesh_boxes, writer_ranks


@dataclasses.dataclass
class _Leaf:
    """One array to save: its key, global shape/dtype/chunks, and this rank's part (if it writes one)."""

    key: orbax_format.LeafKey
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[int, ...]
    box: Box | None
    data: torch.Tensor | None
    first: int = 0  # the lowest rank of the mesh holding it (this rank for a plain tensor)


def _host_copy(t: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """A contiguous CPU copy of ``t`` into ``out`` if it fits (reused buffer), else a new one."""
    t = t.detach()
    if out is None or out.shape != t.shape or out.dtype != t.dtype:
        if t.device.type == "cpu":
            return t.clone(memory_format=torch.contiguous_format)
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    out.copy_(t, non_blocking=t.is_cuda and out.is_pinned())
    return out


def snapshot(state: Any, buffers: dict[str, torch.Tensor] | None = None) -> list[_Leaf]:
    """Plans the save of ``state`` and copies the shards this rank writes to host memory.

    Args:
      state: a pytree of torch.Tensor / DTensor leaves.
      buffers: host buffers of a previous snapshot, by leaf name, reused when shape and dtype match
        (no allocation and no page faults: the copy is a plain memcpy).

    Returns:
      One _Leaf per array leaf, in tree order, with a host copy of what this rank may write: a plain
      tensor whole (`_agree` keeps the lowest holder's), each distinct DTensor shard on the lowest
      rank holding it.

    Example:
      >>> leaves = snapshot({"w": torch.ones(3)})
    """
    keys, values, _ = orbax_format.flatten(state)
    me = _dist.rank()
    names: dict[str, orbax_format.LeafKey] = {}
    leaves = []
    for key, x in zip(keys, values):
        what = f"leaf {key.name!r}"
        if key.name in names:
            raise ValueError(f"{what}: paths {names[key.name].path} and {key.path} both join to this name")
        names[key.name] = key
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what}: {type(x).__name__} cannot be saved; leaves must be torch.Tensor or DTensor")
        if x.layout != torch.strided:
            raise TypeError(f"{what}: {x.layout} tensors cannot be saved; convert it to a dense tensor first")
        if x.device.type == "meta":
            raise ValueError(f"{what} is on the meta device and has no data to save")
        try:
            tsspec.ts_dtype_name(x.dtype)
        except TypeError as e:
            raise TypeError(f"{what}: {e}") from None
        shape = tuple(x.shape)
        if isinstance(x, DTensor):
            check_placements(x.placements, what)
            boxes = mesh_boxes(shape, x.device_mesh, x.placements)
            chunks = chunk_shape(shape, list(boxes.values()))
            mine = boxes.get(me)
            writes = mine is not None and writer_ranks(boxes).get(mine) == me
            first = min(boxes)
            local = x.to_local()
            if mine is not None and tuple(local.shape) != mine.shape:
                raise ValueError(
                    f"{what}: local shard has shape {tuple(local.shape)} but placements "
                    f"{x.placements} give {mine.shape} on rank {me}"
                )
        else:
            mine, chunks, local = full_box(shape), tuple(max(1, s) for s in shape), x
            writes, first = True, me
        box = mine if writes and mine is not None and not mine.empty else None
        data = _host_copy(local, (buffers or {}).get(key.name)) if box else None
        leaves.append(_Leaf(key, shape, x.dtype, chunks, box, data, first))
    if any(leaf.data is not None and leaf.data.is_pinned() for leaf in leaves):
        torch.cuda.synchronize()
    return leaves


def _write_process_db(leaves: list[_Leaf], tmp: str, me: int, compression: str | None) -> None:
    """Writes this rank's chunks (and, on rank 0, every array's .zarray) into its OCDBT database."""
    ctx = tsspec.new_context()
    db = orbax_format.process_db_dir(tmp, me)
    opened = []
    for leaf in leaves:
        if me != 0 and leaf.box is None:
            continue
        kv = tsspec.ocdbt_kvstore(db, leaf.key.name, write=True)
        spec = tsspec.zarr2_write_spec(kv, leaf.shape, leaf.chunks, leaf.dtype, compression)
        if me == 0:  # rank 0 writes every array's metadata; the others only their chunks
            fut = ts.open(spec, create=True, open=True, context=ctx)
        else:
            fut = ts.open(spec, open=True, assume_metadata=True, context=ctx)
        opened.append((leaf, fut))
    writes = []
    for leaf, fut in opened:
        store = fut.result()
        if leaf.box is not None and leaf.data is not None:
            # The snapshot is ours alone and never mutated: TensorStore may keep a reference.
            src = tsspec.to_numpy(leaf.data)
            writes.append(store[leaf.box.index()].write(src, can_reference_source_data_indefinitely=True))
    for w in writes:
        w.result()


def _merge_and_commit(
    entries: list[tuple[orbax_format.LeafKey, str]],
    tmp: str,
    path: str,
    init_ns: int,
    custom_metadata: dict | None = None,
) -> None:
    """Rank 0: merges the per-process databases, writes metadata and marker, renames tmp -> path."""
    ctx = tsspec.new_context()
    item = orbax_format.item_dir(tmp)
    children = sorted(glob.glob(os.path.join(item, orbax_format.PROCESS_PREFIX + "*")))
    parent = ts.KvStore.open(tsspec.ocdbt_kvstore(item, write=True), context=ctx).result()
    txn = ts.Transaction(atomic=True)
    copies = []
    for child_dir in children:
        child = ts.KvStore.open(tsspec.ocdbt_kvstore(child_dir), context=ctx).result()
        copies.append(child.experimental_copy_range_to(parent.with_transaction(txn)))
    for c in copies:
        c.result()
    txn.commit_async().result()
    orbax_format.write_json(os.path.join(item, orbax_format.TREE_METADATA), orbax_format.tree_metadata_json(entries))
    orbax_format.write_commit_files(tmp, path, init_ns, custom_metadata)
    orbax_format.fsync_dir(item)
    orbax_format.fsync_dir(tmp)
    os.rename(tmp, path)
    orbax_format.fsync_dir(os.path.dirname(path))


def _run_phase(group, me: int, fn: Callable[[], None] | None, path: str, what: str) -> None:
    """Runs ``fn`` (if given on this rank), then exchanges statuses; raises if any rank failed."""
    status = None
    if fn is not None:
        try:
            fn()
        except Exception as e:  # reported to every rank, then raised below
            status = one_line(e)
    error = _dist.first_error(_dist.exchange(group, status))
    if error is not None:
        raise CheckpointError(f"checkpoint {path}: save failed while {what} ({error})")


def _prepare_tmp(tmp: str) -> None:
    """Rank 0: creates a fresh tmp directory (removing one left by a crash)."""
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(orbax_format.item_dir(tmp))


def _agree(group, leaves: list[_Leaf], entries: list) -> tuple[list[_Leaf], list]:
    """Makes every rank's part of one checkpoint of the union of the ranks' trees.

    Ranks may hold different trees (pipeline stages hold their own stages' params). Each array is
    written by the mesh of its lowest holder (a plain tensor: by its lowest holding rank); rank 0
    gets every array's description (it writes their metadata) and the union of the entries.
    """
    if group is None:
        return leaves, entries
    mine = [(leaf.key, leaf.shape, leaf.dtype, leaf.chunks, leaf.first) for leaf in leaves]
    every: list = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(every, (mine, entries), group=group)
    owner: dict[str, tuple] = {}  # name -> the description from the lowest holder
    for descs, _ in every:
        for d in descs:
            if d[0].name not in owner or d[4] < owner[d[0].name][4]:
                owner[d[0].name] = d
    kept = [
        leaf if leaf.first == owner[leaf.key.name][4] else dataclasses.replace(leaf, box=None, data=None)
        for leaf in leaves
    ]
    if _dist.rank() != 0:
        return kept, entries
    have = {leaf.key.name for leaf in kept}
    kept += [
        _Leaf(k, shape, dtype, chunks, None, None, first)
        for k, shape, dtype, chunks, first in owner.values()
        if k.name not in have
    ]
    union, seen = [], set()
    for _, rank_entries in every:
        for key, value_type in rank_entries:
            if key.tree_key not in seen:
                seen.add(key.tree_key)
                union.append((key, value_type))
    return kept, union


def _write_and_commit(
    leaves: list[_Leaf],
    entries: list[tuple[orbax_format.LeafKey, str]],
    path: str,
    group,
    compression: str | None,
    init_ns: int,
    on_commit: Callable[[], None] | None,
    custom_metadata: dict | None = None,
) -> None:
    """The background part of a save: write all ranks' chunks, then commit atomically."""
    me = _dist.rank()
    tmp = orbax_format.tmp_path(path)
    try:
        agreed: list = []
        _run_phase(group, me, lambda: agreed.extend(_agree(group, leaves, entries)), path, "agreeing on the tree")
        leaves[:], entries = agreed
        _run_phase(group, me, (lambda: _prepare_tmp(tmp)) if me == 0 else None, path, "creating the tmp dir")
        _run_phase(group, me, lambda: _write_process_db(leaves, tmp, me, compression), path, "writing chunks")
    finally:
        leaves.clear()  # drop the host copies as soon as they are written (or the save failed)
    commit = (lambda: _merge_and_commit(entries, tmp, path, init_ns, custom_metadata)) if me == 0 else None
    _run_phase(group, me, commit, path, "committing")
    if on_commit is not None:
        on_commit()


class AsyncWriter:
    """Runs checkpoint writes one at a time in a background thread, on a dedicated process group.

    Construct it on every rank at the same point (creating the gloo group is collective).

    Args:
      group: process group for the background barriers; default: a new gloo group over all ranks
        (None on a single process without torch.distributed).
      reuse_buffers: keep the host snapshot buffers between saves and copy into them next time.
        Makes the blocking part a plain memcpy (fresh memory costs page faults: ~5x slower here),
        at the price of holding one host copy of this rank's shards while the writer lives.

    Example:
      >>> writer = AsyncWriter()
      >>> fut = writer.save("/ckpt/100", state)   # returns after the host snapshot
      >>> writer.wait()                           # or fut.result()
      >>> writer.close()
    """

    def __init__(self, group=None, *, reuse_buffers: bool = False):
        self._reuse_buffers = reuse_buffers
        self._buffers: dict[str, torch.Tensor] = {}
        self._owns_group = group is None and _dist.initialized()
        self._group = group if group is not None else _dist.new_group()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="functrain-ckpt-save")
        self._pending: concurrent.futures.Future | None = None
        self._closed = False

    @property
    def group(self):
        """The process group the background work synchronizes on (None on a single process)."""
        return self._group

    def save(
        self,
        path: str,
        state: Any,
        *,
        compression: str | None = "zstd",
        on_commit: Callable[[], None] | None = None,
        custom_metadata: dict | None = None,
    ) -> concurrent.futures.Future:
        """Waits for the previous save, snapshots ``state`` and writes it to ``path`` in the background.

        Args:
          path: the checkpoint directory to create (e.g. ``<root>/<step>``); must not exist.
          state: pytree of tensors/DTensors; free to mutate once this returns.
          compression: "zstd" (default) or None.
          on_commit: called in the background thread on every rank after the commit.
          custom_metadata: JSON-serializable dict stored in ``_CHECKPOINT_METADATA`` (rank 0's is kept),
            where orbax keeps its ``custom_metadata``.

        Returns:
          A Future that resolves to None once the checkpoint is committed on every rank, or raises
          CheckpointError.

        Example:
          >>> writer.save("/ckpt/100", state).result()
        """
        if self._closed:
            raise RuntimeError("AsyncWriter is closed")
        if compression not in tsspec.COMPRESSIONS:
            raise ValueError(f"compression must be one of {tsspec.COMPRESSIONS}, got {compression!r}")
        self.wait()
        path = os.path.abspath(os.fspath(path))
        if os.path.exists(path):
            raise CheckpointError(f"checkpoint {path} already exists; delete it or save under another step")
        init_ns = time.time_ns()
        if custom_metadata is not None:
            custom_metadata = json.loads(json.dumps(custom_metadata))  # a copy, and unserializable fails here
        leaves = snapshot(state, self._buffers)
        entries = orbax_format.metadata_entries(state)  # the arrays and the empty subtrees, in tree order
        if self._reuse_buffers:  # safe to reuse: the next snapshot only happens after wait()
            self._buffers = {leaf.key.name: leaf.data for leaf in leaves if leaf.data is not None}
        self._pending = self._executor.submit(
            _write_and_commit, leaves, entries, path, self._group, compression, init_ns, on_commit, custom_metadata
        )
        return self._pending

    def wait(self) -> None:
        """Blocks until the pending save (if any) committed; re-raises its error once."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Waits for the pending save and stops the background thread (collective if it owns a group)."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._buffers = {}
            self._executor.shutdown(wait=True)
            if self._owns_group and _dist.initialized():
                torch.distributed.destroy_process_group(self._group)

    def __enter__(self) -> AsyncWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_DEFAULT_WRITER: AsyncWriter | None = None


def _default_writer() -> AsyncWriter:
    """The module-level writer used by save/save_async (created on first use, collectively)."""
    global _DEFAULT_WRITER
    if _DEFAULT_WRITER is None or _DEFAULT_WRITER._closed:
        _DEFAULT_WRITER = AsyncWriter()
    return _DEFAULT_WRITER


def save_async(
    path: str, state: Any, *, compression: str | None = "zstd", custom_metadata: dict | None = None
) -> concurrent.futures.Future:
    """Saves ``state`` to the checkpoint directory ``path`` in the background.

    Blocks only for the previous save (if still running) and the host snapshot of the local shards.
    Call on every rank; the first call creates a gloo process group (collective).

    Args:
      path: the checkpoint directory to create, e.g. ``/ckpt/100``; written as
        ``/ckpt/100.orbax-checkpoint-tmp`` and renamed on commit.
      state: a pytree of torch.Tensor / DTensor leaves (any Shard/Replicate placements).
      compression: "zstd" (default) or None.
      custom_metadata: a JSON-serializable dict kept in ``_CHECKPOINT_METADATA``.

    Returns:
      A concurrent.futures.Future resolving to None once committed (raises CheckpointError on failure).

    Example:
      >>> fut = save_async("/ckpt/100", state)
      >>> state = train_step(state, batch)   # safe: the snapshot is already taken
      >>> fut.result()
    """
    return _default_writer().save(path, state, compression=compression, custom_metadata=custom_metadata)


def save(path: str, state: Any, *, compression: str | None = "zstd", custom_metadata: dict | None = None) -> None:
    """Saves ``state`` to the checkpoint directory ``path`` and returns once it is committed.

    Args:
      path: the checkpoint directory to create, e.g. ``/ckpt/100``.
      state: a pytree of torch.Tensor / DTensor leaves.
      compression: "zstd" (default) or None.
      custom_metadata: a JSON-serializable dict kept in ``_CHECKPOINT_METADATA``.

    Returns:
      None.

    Example:
      >>> save("/ckpt/100", {"params": params, "step": torch.tensor(100)})
    """
    save_async(path, state, compression=compression, custom_metadata=custom_metadata).result()
