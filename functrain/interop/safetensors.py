"""Read and write Hugging Face safetensors files.

Internals: docs/internals.md "functrain.interop.safetensors".

Example:
    >>> save_safetensors(state.params, "model.safetensors", metadata={"step": "1000"})
    >>> params = load_safetensors("model.safetensors", template=state.params)
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors
import torch

from functrain import tree as tree_lib
from functrain.errors import FunctrainError

__all__ = ["SafetensorsError", "save_safetensors", "load_safetensors", "safetensors_metadata", "open_safetensors"]


class SafetensorsError(FunctrainError, ValueError):
    """A file is not valid safetensors, or does not fit the template it is loaded into."""


def _named_tensors(params: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs: a flat dict's own items in order, else the tree's dotted paths."""
    if isinstance(params, Mapping) and all(isinstance(v, torch.Tensor) for v in params.values()):
        items = list(params.items())
    else:
        items = [(n, v) for n, v in tree_lib.named_leaves(params) if v is not None]
    for name, value in items:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be strings, got {name!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: only tensors can be saved, got {type(value).__name__}")
    return items


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a (D)Tensor on the CPU, contiguous (a collective for a DTensor)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to("cpu").contiguous()


def rank_and_world() -> tuple[int, bool]:
    """(this process's rank, whether torch.distributed is initialized)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), True
    return 0, False


_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _header(items: list[tuple[str, torch.Tensor]], metadata: Mapping[str, str] | None) -> bytes:
    """The 8-byte little-endian length and the JSON header (padded to 8 bytes, as the package does)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in items:
        size = t.numel() * t.element_size()  # a DTensor's global numel: the gathered size
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def save_safetensors(params: Any, path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> Path:  # noqa: C901
    """Writes tensors to a `.safetensors` file, streaming: one whole tensor in memory at a time.

    Tensors are written in the dict's order (a nested tree: flattening order, names are dotted
    paths). The header comes from shapes and dtypes alone, then each tensor is made whole
    (`full_tensor()` for a DTensor, so every rank must call this), written by rank 0 and dropped:
    sharded params are exported without any rank holding the whole model. All ranks wait for the
    file. The write goes to `<path>.tmp` and is renamed, so a crash never leaves a truncated file
    under `path`; a failed write on rank 0 still takes part in every gather (no rank hangs), then raises.

    Args:
      params: {name: tensor} (or any pytree of tensors), any device, any dtype in the format.
      path: the file to write.
      metadata: optional {str: str} stored under `__metadata__` (e.g. {"format": "pt"}).

    Returns:
      The path written.

    Example:
      >>> save_safetensors(params, "runs/gpt/model.safetensors", metadata={"step": "3000"})
    """
    path = Path(path)
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError(f"safetensors metadata must map str to str, got {dict(metadata)!r}")
    items = _named_tensors(params)
    for name, t in items:
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"{name}: dtype {t.dtype} has no safetensors code; cast it to one of {sorted(_DTYPES.values())}"
            )
    rank, distributed = rank_and_world()
    tmp = path.with_name(path.name + ".tmp")
    failed: BaseException | None = None
    out = None
    try:
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            out = open(tmp, "wb")
            out.write(_header(items, metadata))
    except OSError as exc:
        failed = exc
    for _, t in items:
        whole = _full(t)  # a collective for a DTensor: every rank, even after a failed write
        if out is not None and failed is None:
            try:
                out.write(whole.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # (a buffer) little-endian
            except OSError as exc:
                failed = exc
        del whole
    if out is not None:
        out.close()
        if failed is None:
            os.replace(tmp, path)
        tmp.unlink(missing_ok=True)
    if distributed:
        import torch.distributed as dist

        dist.barrier()
    if failed is not None:
        fix = (
            "free space on that disk"
            if getattr(failed, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
            else "pick a path where a file can be written"
        )
        raise SafetensorsError(f"{path}: could not write ({failed}); {fix}") from None
    return path


def open_safetensors(path: str | os.PathLike):
    """The package's reader of `path` (`safe_open`, framework "pt"), with failures as `SafetensorsError`.

    Args:
      path: a safetensors file.

    Returns:
      An open `safe_open` handle (a context manager): `keys()`, `get_tensor(name)`,
      `get_slice(name)[rows, cols]` (reads only those bytes), `metadata()`.

    Raises:
      SafetensorsError: the file is missing, truncated or not safetensors (one line naming it).

    Example:
      >>> with open_safetensors("model.safetensors") as f:
      ...     rows = f.get_slice("embed_tokens.weight")[0:128]
    """
    try:
        return safetensors.safe_open(str(path), framework="pt")
    except FileNotFoundError:
        raise SafetensorsError(f"{path}: no such file") from None
    except Exception as exc:  # noqa: BLE001 - the package's SafetensorError and OS errors alike
        raise SafetensorsError(f"{path}: not a valid safetensors file ({exc}); write it again") from None


def safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The `__metadata__` of a safetensors file (empty when it has none).

    Args:
      path: the file.

    Returns:
      {str: str}.

    Example:
      >>> safetensors_metadata("model.safetensors").get("step")
    """
    with open_safetensors(path) as f:
        return dict(f.metadata() or {})


def _like(t: torch.Tensor, ref: Any, name: str, path: Path) -> Any:
    """`t` with `ref`'s shape check, dtype, device and (for a DTensor template) placements."""
    if not isinstance(ref, torch.Tensor):
        raise SafetensorsError(f"{name}: template leaf is {type(ref).__name__}, not a tensor")
    if tuple(t.shape) != tuple(ref.shape):
        raise SafetensorsError(f"{path}: {name} has shape {tuple(t.shape)}, template expects {tuple(ref.shape)}")
    t = t.to(ref.dtype)
    if hasattr(ref, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        dt: Any = ref  # a DTensor
        # Every rank read the same bytes: take the local shard without communication.
        return distribute_tensor(t.to(dt.device_mesh.device_type), dt.device_mesh, dt.placements, src_data_rank=None)
    return t if ref.device.type == "meta" else t.to(ref.device)


def load_safetensors(path: str | os.PathLike, template: Any = None) -> dict[str, torch.Tensor] | Any:
    """Reads a `.safetensors` file.

    Args:
      path: the file (ours or any other writer's).
      template: optional tree of tensors (e.g. the current params, or a meta-device copy). When
        given, the result has the template's structure and order, each leaf is checked against the
        template's shape and cast to its dtype, moved to its device (meta: stays on the CPU) and,
        for DTensor leaves, sharded with its mesh and placements (every rank reads the file).
        Names missing from the file, or file entries the template lacks, raise `SafetensorsError`.

    Returns:
      Without template: {name: CPU tensor} in the file's order. With one: the template's tree.

    Example:
      >>> params = load_safetensors("model.safetensors")
      >>> params = load_safetensors("model.safetensors", template=state.params)   # same placement
    """
    path = Path(path)
    with open_safetensors(path) as f:
        names = list(f.keys())
        if template is None:
            return {name: f.get_tensor(name) for name in names}
        if isinstance(template, Mapping) and all(isinstance(v, torch.Tensor) for v in template.values()):
            wanted = list(template.items())
        else:
            wanted = list(tree_lib.named_leaves(template))
        missing = [n for n, _ in wanted if n not in names]
        extra = sorted(set(names) - {n for n, _ in wanted})
        if missing or extra:
            raise SafetensorsError(
                f"{path} does not match the template: missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                f"unexpected {extra[:8]}{'...' if len(extra) > 8 else ''}"
            )
        leaves = [_like(f.get_tensor(n), ref, n, path) for n, ref in wanted]
    if isinstance(template, Mapping) and all(isinstance(v, torch.Tensor) for v in template.values()):
        return dict(zip(template.keys(), leaves))
    return tree_lib.unflatten(tree_lib.structure(template), leaves)
