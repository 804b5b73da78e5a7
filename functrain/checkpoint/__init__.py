"""Sharded Orbax-format checkpoints written and read with TensorStore; no jax at runtime.

Public API:
  save / save_async      write a pytree of tensors/DTensors to ``<root>/<step>`` (async: Future)
  restore                read a checkpoint onto a template (any mesh/placements) -> Future
  read_metadata          shapes/dtypes/chunks per array of a checkpoint
  read_custom_metadata   the JSON a save kept with the checkpoint (``custom_metadata``)
  metadata_tree          the checkpoint's tree of ArraySpec (a restore template)
  Manager                steps, async save, retention, crash-safe commit, validation
  ArraySpec, abstract    abstract leaves for templates
  CheckpointError        the one error for bad/unusable checkpoints (MismatchError: does not fit the template)
"""

from .errors import CheckpointError, MismatchError
from .layout import read_custom_metadata
from .manager import Manager
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
