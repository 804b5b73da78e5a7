"""Sharded Orbax-format checkpoints written and read with TensorStore; no jax at runtime.

Internals: docs/internals.md "functrain.checkpoint".
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

if TYPE_CHECKING:  # the public names; at run time each loads on first use (functrain._lazy)
    from functrain.checkpoint.digests import digest
    from functrain.checkpoint.errors import CheckpointError, MismatchError
    from functrain.checkpoint.manager import Manager
    from functrain.checkpoint.orbax_format import read_custom_metadata
    from functrain.checkpoint.reader import ArrayInfo, metadata_tree, read_metadata, restore
    from functrain.checkpoint.sharding import ArraySpec, abstract
    from functrain.checkpoint.writer import AsyncWriter, save, save_async

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
