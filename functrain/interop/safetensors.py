"""Read and write the Hugging Face safetensors format, with no dependency beyond torch.

The format (https://github.com/huggingface/safetensors, "Format" section) is:

    8 bytes        N, the header length, unsigned little-endian
    N bytes        a JSON object: {"__metadata__": {str: str}, name: {"dtype": "F32",
                   "shape": [...], "data_offsets": [begin, end]}, ...}, padded with spaces
    the rest       the tensors' bytes, little-endian, row-major, back to back; offsets are
                   relative to the start of this buffer

`save_safetensors` writes a params dict (or any pytree of tensors, named by its dotted paths; DTensor
leaves are gathered with `full_tensor()`, and only rank 0 writes when torch.distributed is
initialized). `load_safetensors` reads one back, optionally shaped, typed, placed (device, DTensor
placements) and ordered like a template. Files are interchangeable with `safetensors.torch`'s.

Example:
    >>> save_safetensors(state.params, "model.safetensors", metadata={"step": "1000"})
    >>> params = load_safetensors("model.safetensors", template=state.params)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping

import torch

from functrain import tree as tree_lib

__all__ = ["SafetensorsError", "save_safetensors", "load_safetensors", "safetensors_metadata"]

# safetensors dtype names <-> torch dtypes (those torch can hold).
_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
_NAMES = {dt: name for name, dt in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit


class SafetensorsError(ValueError):
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


def _le_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's raw bytes in little-endian order (a view where the host is little-endian)."""
    raw = t.reshape(-1).view(torch.uint8)
    if sys.byteorder == "big" and t.element_size() > 1:  # swap each element's bytes
        raw = raw.reshape(-1, t.element_size()).flip(1).reshape(-1)
    return memoryview(raw.numpy())


def _rank_and_world() -> tuple[int, bool]:
    """(this process's rank, whether torch.distributed is initialized)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), True
    return 0, False


def save_safetensors(params: Any, path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> Path:
    """Writes tensors to a `.safetensors` file.

    Tensors are written in the dict's order (a nested tree: flattening order, names are dotted
    paths). DTensors are gathered first (`full_tensor()`, so every rank must call this); with
    torch.distributed initialized only rank 0 writes, and all ranks wait for the file. The write
    goes to `<path>.tmp` and is renamed, so a crash never leaves a truncated file under `path`.

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
    items = [(name, _full(t)) for name, t in _named_tensors(params)]
    rank, distributed = _rank_and_world()
    if rank == 0:
        _write(items, path, metadata)
    if distributed:
        import torch.distributed as dist

        dist.barrier()
    return path


def _write(items: list[tuple[str, torch.Tensor]], path: Path, metadata: Mapping[str, str] | None) -> None:
    """Writes the header and the tensors' bytes to `path` (via a temporary file)."""
    header: dict[str, Any] = {}
    if metadata:
        bad = {k: v for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
        if bad:
            raise TypeError(f"safetensors metadata must map str to str; convert these first: {bad!r}")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, t in items:
        if name == "__metadata__" or name in header:
            raise ValueError(f"duplicate or reserved tensor name {name!r}")
        if t.dtype not in _NAMES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors name")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # pad so the data starts 8-byte aligned, as the reference writer does
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for _, t in items:
            if t.numel():
                f.write(_le_bytes(t))
    os.replace(tmp, path)


def _read_header(f, path: Path) -> tuple[dict, int]:
    """(parsed header, byte offset of the data buffer) of an open safetensors file."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) != 8:
        raise SafetensorsError(f"{path}: too short to be a safetensors file ({size} bytes)")
    n = int.from_bytes(head, "little")
    if n > _MAX_HEADER or 8 + n > size:
        raise SafetensorsError(f"{path}: header length {n} is invalid for a {size}-byte file")
    try:
        header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    _check_layout(header, size - 8 - n, path)
    return header, 8 + n


def _check_layout(header: dict, data_len: int, path: Path) -> None:
    """Raises unless the entries' byte ranges match their dtype/shape and tile the data buffer."""
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise SafetensorsError(f"{path}: bad header entry {name!r}: {info!r} ({e!r})") from None
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * torch.empty((), dtype=dtype).element_size() or begin < 0:
            raise SafetensorsError(f"{path}: {name}: data_offsets {[begin, end]} do not fit {info['dtype']} {shape}")
        spans.append((begin, end, name))
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            raise SafetensorsError(f"{path}: {name}: data starts at {begin}, expected {pos} (gap or overlap)")
        pos = end
    if pos != data_len:
        raise SafetensorsError(f"{path}: tensors cover {pos} bytes but the data buffer has {data_len}")


def safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The `__metadata__` of a safetensors file (empty when it has none).

    Args:
      path: the file.

    Returns:
      {str: str}.

    Example:
      >>> safetensors_metadata("model.safetensors").get("step")
    """
    path = Path(path)
    with open(path, "rb") as f:
        header, _ = _read_header(f, path)
    return dict(header.get("__metadata__") or {})


def _read_tensor(f, start: int, info: dict) -> torch.Tensor:
    """One tensor (on the CPU, owning its memory) from its header entry."""
    dtype = _DTYPES[info["dtype"]]
    shape = [int(d) for d in info["shape"]]
    begin, end = info["data_offsets"]
    if end == begin:
        return torch.empty(shape, dtype=dtype)
    buf = bytearray(end - begin)
    f.seek(start + begin)
    f.readinto(buf)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    if sys.byteorder == "big" and t.element_size() > 1:
        size = torch.empty((), dtype=dtype).element_size()
        t = t.reshape(-1, size).flip(1).reshape(-1).clone()
    return t.view(dtype).reshape(shape)


def _like(t: torch.Tensor, ref: Any, name: str, path: Path) -> Any:
    """`t` with `ref`'s shape check, dtype, device and (for a DTensor template) placements."""
    if not isinstance(ref, torch.Tensor):
        raise SafetensorsError(f"{name}: template leaf is {type(ref).__name__}, not a tensor")
    if tuple(t.shape) != tuple(ref.shape):
        raise SafetensorsError(f"{path}: {name} has shape {tuple(t.shape)}, template expects {tuple(ref.shape)}")
    t = t.to(ref.dtype)
    if hasattr(ref, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        mesh = ref.device_mesh
        # Every rank read the same bytes: take the local shard without communication.
        return distribute_tensor(t.to(mesh.device_type), mesh, ref.placements, src_data_rank=None)
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
    with open(path, "rb") as f:
        header, start = _read_header(f, path)
        names = [k for k in header if k != "__metadata__"]
        if template is None:
            return {name: _read_tensor(f, start, header[name]) for name in names}
        if isinstance(template, Mapping) and all(isinstance(v, torch.Tensor) for v in template.values()):
            wanted = list(template.items())
        else:
            wanted = list(tree_lib.named_leaves(template))
        missing = [n for n, _ in wanted if n not in header]
        extra = sorted(set(names) - {n for n, _ in wanted})
        if missing or extra:
            raise SafetensorsError(
                f"{path} does not match the template: missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                f"unexpected {extra[:8]}{'...' if len(extra) > 8 else ''}"
            )
        leaves = [_like(_read_tensor(f, start, header[n]), ref, n, path) for n, ref in wanted]
    if isinstance(template, Mapping) and all(isinstance(v, torch.Tensor) for v in template.values()):
        return dict(zip(template.keys(), leaves))
    return tree_lib.unflatten(tree_lib.structure(template), leaves)
