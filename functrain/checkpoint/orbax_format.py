"""On-disk layout of an Orbax v0 checkpoint: names, paths, tree keys and the JSON metadata files.

Internals: docs/internals.md "functrain.checkpoint.orbax_format".
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import optree

from .errors import CheckpointError

TMP_SUFFIX = ".orbax-checkpoint-tmp"
ITEM = "default"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
COMMIT_MARKER = "commit_success.txt"
TREE_METADATA = "_METADATA"
PROCESS_PREFIX = "ocdbt.process_"
STANDARD_HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"

# orbax's KeyType enum (orbax/checkpoint/_src/tree/utils.py): SEQUENCE = 1, DICT = 2.
KEY_SEQUENCE = 1
KEY_DICT = 2
# Value types this package can restore. Orbax writes "scalar" for Python numbers, stored as 0-d arrays.
ARRAY_VALUE_TYPES = ("np.ndarray", "jax.Array", "scalar")
# Empty subtrees, as orbax records them (orbax/checkpoint/_src/metadata/empty_values.py): an entry
# with one of these value types and skip_deserialize=true. Without rich types (orbax's default) an
# empty NamedTuple is recorded as "None".
EMPTY_TUPLE, EMPTY_LIST, EMPTY_DICT, EMPTY_NONE = "Tuple", "List", "Dict", "None"
EMPTY_VALUE_TYPES = (EMPTY_TUPLE, EMPTY_LIST, EMPTY_DICT, EMPTY_NONE, "NamedTuple")


@dataclasses.dataclass(frozen=True)
class LeafKey:
    """Where a leaf sits in the tree: its path of string keys and the orbax key type of each."""

    path: tuple[str, ...]
    key_types: tuple[int, ...]

    @property
    def name(self) -> str:
        """The '.'-joined path: the array's name inside OCDBT and in error messages."""
        return ".".join(self.path)

    @property
    def tree_key(self) -> str:
        """The tuple-repr key orbax uses in ``_METADATA``, e.g. ``"('params', 'w')"``."""
        return str(self.path)


def _entry_key(entry: optree.PyTreeEntry) -> tuple[str, int]:
    """String key and orbax key type of one optree path entry."""
    # NamedTuple fields are keyed by name, as orbax does (NamedTupleEntry is a SequenceEntry).
    if isinstance(entry, (optree.NamedTupleEntry, optree.StructSequenceEntry)):
        return str(entry.field), KEY_DICT
    if isinstance(entry, optree.SequenceEntry):
        return str(entry.index), KEY_SEQUENCE
    if isinstance(entry, optree.GetAttrEntry):  # dataclass fields and other attribute nodes
        return str(entry.name), KEY_DICT
    return str(entry.entry), KEY_DICT


def _leaf_key(accessor) -> LeafKey:
    """The LeafKey of one optree accessor."""
    pairs = [_entry_key(entry) for entry in accessor]
    return LeafKey(tuple(p for p, _ in pairs), tuple(t for _, t in pairs))


def flatten(tree: Any) -> tuple[list[LeafKey], list[Any], optree.PyTreeSpec]:
    """Flattens ``tree`` (default optree namespace) into leaf keys, leaves and the tree spec."""
    accessors, leaves, treespec = optree.tree_flatten_with_accessor(tree)
    return [_leaf_key(a) for a in accessors], leaves, treespec


def _is_empty_node(x: Any) -> bool:
    """Whether ``x`` is a container with no children (or None): a node orbax records as empty."""
    if x is None:
        return True
    if isinstance(x, (tuple, list, dict)) and not x:
        return True
    return False


def _empty_type(x: Any) -> str:
    """Orbax's value type for an empty node (empty NamedTuples as "None", orbax's default)."""
    if x is None or (isinstance(x, tuple) and hasattr(x, "_fields")):
        return EMPTY_NONE
    if isinstance(x, list):
        return EMPTY_LIST
    if isinstance(x, dict):
        return EMPTY_DICT
    return EMPTY_TUPLE


def metadata_entries(tree: Any) -> list[tuple[LeafKey, str]]:
    """Every entry ``_METADATA`` records for ``tree``, in tree order: (key, value type).

    Array leaves are "np.ndarray"; empty subtrees (``()``, ``[]``, ``{}``, None) get orbax's empty
    value type ("Tuple", "List", "Dict", "None"), so that a restore without a template rebuilds the
    whole tree: an optimizer state ``(clip_state, adam_state, ...)`` keeps its empty ``()`` entries
    and its sequence indices stay contiguous.
    """
    if _is_empty_node(tree):
        return []  # a whole empty tree has no path to record
    accessors, nodes, _ = optree.tree_flatten_with_accessor(tree, is_leaf=_is_empty_node, none_is_leaf=True)
    return [(_leaf_key(a), _empty_type(x) if _is_empty_node(x) else "np.ndarray") for a, x in zip(accessors, nodes)]


def empty_value(value_type: str) -> Any:
    """The Python value of an empty node recorded with ``value_type`` (as orbax restores it)."""
    return {EMPTY_TUPLE: (), EMPTY_LIST: [], EMPTY_DICT: {}}.get(value_type)


# ----------------------------------------------------------------------------------------------
# Paths


def tmp_path(path: str) -> str:
    """The temporary directory a checkpoint at ``path`` is written to before the commit rename."""
    return os.fspath(path).rstrip("/") + TMP_SUFFIX


def item_dir(path: str) -> str:
    """The "default" item directory inside a checkpoint directory."""
    return os.path.join(path, ITEM)


def process_db_dir(path: str, process: int) -> str:
    """The per-process OCDBT database directory of ``process`` inside a checkpoint directory."""
    return os.path.join(item_dir(path), f"{PROCESS_PREFIX}{process}")


def is_tmp_name(name: str) -> bool:
    """Whether a directory name belongs to an unfinished (or being deleted) checkpoint."""
    return TMP_SUFFIX in name


def step_dirs(root: str) -> dict[int, str]:
    """Committed-looking step directories under ``root`` (integer names), by step."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return {}
    steps = {}
    for name in names:
        if name.isdigit() and os.path.isdir(os.path.join(root, name)):
            steps[int(name)] = os.path.join(root, name)
    return steps


def tmp_dirs(root: str) -> list[str]:
    """Directories under ``root`` left by a save or a deletion that did not finish."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(os.path.join(root, n) for n in names if is_tmp_name(n))


# ----------------------------------------------------------------------------------------------
# Metadata files


def tree_metadata_json(entries: list[tuple[LeafKey, str]]) -> dict[str, Any]:
    """The content of ``default/_METADATA`` for ``entries`` (see ``metadata_entries``).

    Arrays are recorded as np.ndarray, what orbax records for host arrays: stock orbax restores them
    without needing a sharding file, keeps int64 as int64 with jax x64 off, and a jax program that
    passes its own abstract jax.Array target gets sharded jax Arrays. Empty subtrees are recorded as
    orbax does (value type "Tuple"/"List"/"Dict"/"None", skip_deserialize), so a restore with no
    template gets the whole tree back.
    """
    tree = {}
    for key, value_type in entries:
        tree[key.tree_key] = {
            "key_metadata": [{"key": k, "key_type": t} for k, t in zip(key.path, key.key_types)],
            "value_metadata": {"value_type": value_type, "skip_deserialize": value_type in EMPTY_VALUE_TYPES},
        }
    return {
        "tree_metadata": tree,
        "use_ocdbt": True,
        "use_zarr3": False,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }


def checkpoint_metadata_json(init_ns: int, commit_ns: int, custom_metadata: dict | None = None) -> dict[str, Any]:
    """The content of ``_CHECKPOINT_METADATA`` (``custom_metadata``: JSON the user attaches, as orbax's)."""
    return {
        "item_handlers": {ITEM: STANDARD_HANDLER},
        "metrics": {},
        "performance_metrics": {},
        "init_timestamp_nsecs": init_ns,
        "commit_timestamp_nsecs": commit_ns,
        "custom_metadata": dict(custom_metadata or {}),
    }


def write_json(path: str, obj: Any) -> None:
    """Writes ``obj`` as JSON to ``path`` and fsyncs it."""
    write_text(path, json.dumps(obj))


def write_text(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` and fsyncs it."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    """Fsyncs a directory so a rename or new entry in it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_commit_files(path: str, final_path: str, init_ns: int, custom_metadata: dict | None = None) -> None:
    """Writes ``_CHECKPOINT_METADATA`` and the commit marker into the directory ``path``."""
    write_json(
        os.path.join(path, CHECKPOINT_METADATA), checkpoint_metadata_json(init_ns, time.time_ns(), custom_metadata)
    )
    write_text(os.path.join(path, COMMIT_MARKER), f"Checkpoint commit was successful to {final_path}")


@dataclasses.dataclass(frozen=True)
class StoredLeaf:
    """One array entry of a checkpoint's ``_METADATA``."""

    key: LeafKey
    value_type: str


@dataclasses.dataclass(frozen=True)
class TreeMetadata:
    """A parsed ``default/_METADATA``: the stored leaves and empty nodes (by path), storage format."""

    leaves: dict[tuple[str, ...], StoredLeaf]
    use_ocdbt: bool
    use_zarr3: bool
    empties: dict[tuple[str, ...], StoredLeaf] = dataclasses.field(default_factory=dict)


def read_custom_metadata(path: str) -> dict[str, Any]:
    """The ``custom_metadata`` of the committed checkpoint at ``path`` ({} when it has none).

    Raises CheckpointError (naming ``path``) if ``_CHECKPOINT_METADATA`` is unreadable.
    """
    try:
        with open(os.path.join(path, CHECKPOINT_METADATA)) as f:
            custom = json.load(f).get("custom_metadata")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(
            f"checkpoint {path}: {CHECKPOINT_METADATA} is unreadable ({e}); restore an earlier step"
        ) from None
    return custom if isinstance(custom, dict) else {}


def read_tree_metadata(path: str) -> TreeMetadata:
    """Checks the commit marker of the checkpoint at ``path`` and parses its ``default/_METADATA``.

    Raises CheckpointError (naming ``path``) if the checkpoint is not committed or the metadata is
    missing or unreadable.
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path}: directory does not exist")
    if not os.path.exists(os.path.join(path, COMMIT_MARKER)):
        raise CheckpointError(
            f"checkpoint {path}: no {COMMIT_MARKER}, so the save never committed (crashed or still "
            "running); restore an earlier step or delete this directory"
        )
    meta_path = os.path.join(item_dir(path), TREE_METADATA)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        tree = meta["tree_metadata"]
        leaves, empties = {}, {}
        for entry in tree.values():
            key = LeafKey(
                tuple(str(k["key"]) for k in entry["key_metadata"]),
                tuple(int(k["key_type"]) for k in entry["key_metadata"]),
            )
            value = entry.get("value_metadata") or {}
            stored = StoredLeaf(key, str(value.get("value_type", "np.ndarray")))
            if stored.value_type in EMPTY_VALUE_TYPES:
                empties[key.path] = stored
            elif not value.get("skip_deserialize"):
                leaves[key.path] = stored
        return TreeMetadata(leaves, bool(meta.get("use_ocdbt", True)), bool(meta.get("use_zarr3", False)), empties)
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {path}: {ITEM}/{TREE_METADATA} is missing, so its tree is unknown; the "
            "checkpoint is incomplete, restore an earlier step"
        ) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"checkpoint {path}: {ITEM}/{TREE_METADATA} cannot be parsed ({type(e).__name__}: {e}); "
            "the checkpoint is corrupt, restore an earlier step"
        ) from None
