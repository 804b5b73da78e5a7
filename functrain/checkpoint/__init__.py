"""Sharded Orbax-format checkpoints written and read with TensorStore; no jax at runtime.

Internals: docs/internals.md "functrain.checkpoint".
"""

from .errors import CheckpointError, MismatchError
from .manager import Manager
from .orbax_format import read_custom_metadata
from .reader import ArrayInfo, metadata_tree, read_metadata, restore
from .sharding import ArraySpec, abstract
from .writer import AsyncWriter, save, save_async

__all__ = [
    "ArrayInfo",
    "ArraySpec",
    "AsyncWriter",
    "CheckpointError",
    "Manager",
    "MismatchError",
    "abstract",
    "metadata_tree",
    "read_custom_metadata",
    "read_metadata",
    "restore",
    "save",
    "save_async",
]
