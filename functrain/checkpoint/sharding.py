"""Which part of a global array each rank holds: boxes, chunk shapes, writers, and ArraySpec.

Everything here is pure arithmetic on (global shape, mesh shape, coordinate, placements) with
torch's ``Shard`` semantics (``torch.chunk``: ceil-sized pieces, the last ones smaller or empty), so
every rank can compute every other rank's shard without communicating.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard


@dataclasses.dataclass(frozen=True)
class Box:
    """A rectangular region ``[offset, offset + shape)`` of a global array."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def empty(self) -> bool:
        """Whether the box holds no element."""
        return any(s == 0 for s in self.shape)

    def index(self) -> tuple[slice, ...]:
        """The box as a tuple of slices (a TensorStore / numpy index)."""
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))


def full_box(shape: Sequence[int]) -> Box:
    """The box covering a whole array of ``shape``."""
    return Box((0,) * len(shape), tuple(shape))


def check_placements(placements: Sequence[Placement], what: str) -> None:
    """Raises ValueError for placements a checkpoint cannot describe (Partial, _StridedShard)."""
    for p in placements:
        if not isinstance(p, (Shard, Replicate)):
            raise ValueError(
                f"{what}: placement {p} is not supported in checkpoints (only Shard and Replicate); "
                "redistribute the DTensor to Shard/Replicate placements first"
            )


def shard_box(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> Box:
    """The box of the global array held at ``coordinate`` of a mesh with ``placements``.

    Args:
      global_shape: shape of the whole array.
      mesh_shape: shape of the DeviceMesh.
      coordinate: the rank's coordinate in the mesh.
      placements: one Shard/Replicate per mesh dimension.

    Returns:
      The Box, identical to the DTensor local shard torch computes (uneven shards included).

    Example:
      >>> shard_box((7, 3), (2,), (1,), [Shard(0)])
      Box(offset=(4, 0), shape=(3, 3))
    """
    offset = [0] * len(global_shape)
    size = list(global_shape)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            d = placement.dim % len(global_shape)
            n, k = size[d], mesh_shape[mesh_dim]
            chunk = -(-n // k)
            start = min(coordinate[mesh_dim] * chunk, n)
            stop = min(start + chunk, n)
            offset[d] += start
            size[d] = stop - start
        elif not isinstance(placement, Replicate):
            check_placements([placement], "shard_box")
    return Box(tuple(offset), tuple(size))


def mesh_boxes(global_shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> dict[int, Box]:
    """The box of every global rank of ``mesh``."""
    ranks = mesh.mesh.tolist()
    boxes = {}
    for coord in itertools.product(*(range(s) for s in mesh.mesh.shape)):
        rank: Any = ranks
        for c in coord:
            rank = rank[c]
        boxes[int(rank)] = shard_box(global_shape, tuple(mesh.mesh.shape), coord, placements)
    return boxes


def writer_ranks(boxes: dict[int, Box]) -> dict[Box, int]:
    """For each distinct non-empty box, the lowest rank holding it: the one that writes it."""
    owners: dict[Box, int] = {}
    for rank in sorted(boxes):
        box = boxes[rank]
        if not box.empty and box not in owners:
            owners[box] = rank
    return owners


def chunk_shape(global_shape: Sequence[int], boxes: Sequence[Box]) -> tuple[int, ...]:
    """The largest zarr chunk shape such that every box is a union of whole chunks.

    With plain ``Shard(d)`` this is the ceil-sized local shard; no two ranks ever write one chunk.
    """
    chunks = []
    for d, n in enumerate(global_shape):
        cuts: set[int] = set()
        for box in boxes:
            if not box.empty:
                cuts.update((box.offset[d], box.offset[d] + box.shape[d]))
        cuts -= {0, n}
        chunks.append(max(1, math.gcd(*cuts) if cuts else n))
    return tuple(chunks)


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """An abstract array: what to restore a leaf as, without allocating it.

    Attributes:
      shape: the global shape.
      dtype: the torch dtype.
      mesh: a DeviceMesh to restore onto as a DTensor, or None for a plain tensor.
      placements: one Shard/Replicate per mesh dimension (default: all Replicate).
      device: device of a plain tensor (default: the ``device`` passed to restore, else CPU).

    Example:
      >>> ArraySpec((512, 64), torch.bfloat16, mesh=mesh, placements=(Shard(0),))
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh: DeviceMesh | None = None
    placements: tuple[Placement, ...] | None = None
    device: torch.device | str | None = None

    def __post_init__(self):
        """Normalizes the shape and checks/defaults the placements."""
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.mesh is None:
            if self.placements is not None:
                raise ValueError("ArraySpec: placements need a mesh")
            return
        placements = self.placements or tuple(Replicate() for _ in range(self.mesh.ndim))
        if len(placements) != self.mesh.ndim:
            raise ValueError(f"ArraySpec: {len(placements)} placements for a {self.mesh.ndim}-d mesh")
        check_placements(placements, "ArraySpec")
        object.__setattr__(self, "placements", tuple(placements))

    @classmethod
    def like(cls, x: torch.Tensor) -> ArraySpec:
        """The ArraySpec of a tensor or DTensor (on any device, meta included)."""
        if isinstance(x, DTensor):
            return cls(tuple(x.shape), x.dtype, x.device_mesh, tuple(x.placements))
        return cls(tuple(x.shape), x.dtype, device=x.device)


def abstract(tree: Any) -> Any:
    """Replaces every tensor/DTensor leaf of ``tree`` by its ArraySpec (a restore template).

    Args:
      tree: a pytree of tensors and DTensors.

    Returns:
      The same tree with ArraySpec leaves.

    Example:
      >>> template = abstract(state)   # or any tree with the target shapes, dtypes and meshes
      >>> state = restore("/ckpt/100", template).result()
    """
    return optree.tree_map(ArraySpec.like, tree)
