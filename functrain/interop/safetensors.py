"""Read and write Hugging Face safetensors files, through the `safetensors` package.

The format (https://github.com/huggingface/safetensors) is an 8-byte header length, a JSON header
(name -> dtype, shape, data offsets; optional `__metadata__` of str -> str) and the tensors' bytes.
The `safetensors` package writes and reads it (memory-mapped, checked against truncation and
overlap); this module adds what training needs around it:

`save_safetensors` writes a params dict (or any pytree of tensors, named by its dotted paths;
DTensor leaves are gathered with `full_tensor()`, and only rank 0 writes when torch.distributed is
initialized), atomically (a temporary file renamed into place). `load_safetensors` reads one back,
optionally shaped, typed, placed (device, DTensor placements) and ordered like a template. Every
failure is a `SafetensorsError` naming the file. (Until issue 13 this was a hand-written reader and
writer; the package replaced it: same files, less code to keep.)

Note on order: the package lays tensors out by dtype alignment, then name, so a file read without a
template comes back in the file's order, not the saving dict's; a template restores any order.

Example:
    >>> save_safetensors(state.params, "model.safetensors", metadata={"step": "1000"})
    >>> params = load_safetensors("model.safetensors", template=state.params)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import safetensors
import safetensors.torch
import torch

from functrain import tree as tree_lib

__all__ = ["SafetensorsError", "save_safetensors", "load_safetensors", "safetensors_metadata", "open_safetensors"]


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


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a (D)Tensor on the CPU, contiguous (a collective for a DTensor)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to("cpu").contiguous()


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
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError(f"safetensors metadata must map str to str, got {dict(metadata)!r}")
    items = {name: _full(t) for name, t in _named_tensors(params)}
    rank, distributed = _rank_and_world()
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        try:
            safetensors.torch.save_file(items, str(tmp), metadata=dict(metadata) if metadata else None)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    if distributed:
        import torch.distributed as dist

        dist.barrier()
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
