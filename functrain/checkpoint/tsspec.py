"""TensorStore specs (OCDBT kvstores, zarr arrays), contexts and torch <-> numpy dtype bridging.

The kvstore specs mirror what orbax-checkpoint 0.12 builds (``tensorstore_utils.build_kvstore_tspec``)
so that the per-process databases can be merged into the root one with ``experimental_copy_range_to``
(the merge requires the child and parent base specs to agree exactly) and so that orbax reads the
result as its own.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import tensorstore as ts
import torch

# OCDBT options as orbax sets them for writing: .zarray metadata inline, large chunks in data files.
_OCDBT_WRITE_CONFIG = {
    "max_inline_value_bytes": 1024,
    "max_decoded_node_bytes": 100000000,
    "manifest_kind": "single",
}
_TARGET_DATA_FILE_SIZE = 2**31
ZSTD_LEVEL = 1  # orbax's zarr2 default
COMPRESSIONS = ("zstd", None)


def new_context() -> ts.Context:
    """A fresh TensorStore context; use exactly one per save or restore (stale manifests otherwise)."""
    return ts.Context(
        {
            "file_io_concurrency": {"limit": 128},
            "cache_pool#ocdbt": {"total_bytes_limit": 100000000},
        }
    )


def _file_base(directory: str) -> dict[str, Any]:
    """The file kvstore spec of ``directory`` (trailing slash, as orbax writes it)."""
    return {"driver": "file", "path": os.path.normpath(os.path.abspath(directory)) + "/"}


def ocdbt_kvstore(directory: str, name: str | None = None, *, write: bool = False) -> dict[str, Any]:
    """OCDBT kvstore spec rooted at ``directory``; ``name`` selects one array's key prefix.

    Args:
      directory: the database directory (``default/`` or ``default/ocdbt.process_<i>/``).
      name: the array name ('.'-joined tree path), or None for the whole database.
      write: add orbax's write options (used for per-process writes and for the merge target).
    """
    base = _file_base(directory)
    spec: dict[str, Any] = {
        "driver": "ocdbt",
        "base": {**base, "file_io_locking": {"mode": "non_atomic"}},
        "manifest": base,
    }
    if write:
        spec["target_data_file_size"] = _TARGET_DATA_FILE_SIZE
        spec["config"] = dict(_OCDBT_WRITE_CONFIG)
        spec["assume_config"] = True
    if name is not None:
        spec["path"] = name
    spec["cache_pool"] = "cache_pool#ocdbt"
    return spec


def file_kvstore(directory: str, name: str) -> dict[str, Any]:
    """Plain file kvstore spec of one array of a checkpoint written without OCDBT."""
    return {"driver": "file", "path": os.path.join(os.path.abspath(directory), name)}


def zarr2_write_spec(
    kvstore: dict[str, Any],
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    dtype: torch.dtype,
    compression: str | None,
) -> dict[str, Any]:
    """zarr v2 array spec for writing, with the metadata orbax writes (zstd level 1 or none)."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    compressor = {"id": "zstd", "level": ZSTD_LEVEL} if compression == "zstd" else None
    return {
        "driver": "zarr",
        "kvstore": kvstore,
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
        "store_data_equal_to_fill_value": True,
        "dtype": ts_dtype_name(dtype),
        "metadata": {"shape": list(shape), "chunks": list(chunks), "compressor": compressor},
    }


def read_spec(kvstore: dict[str, Any], use_zarr3: bool) -> dict[str, Any]:
    """zarr (v2 or v3) array spec for reading; missing chunks are an error, never zeros."""
    return {
        "driver": "zarr3" if use_zarr3 else "zarr",
        "kvstore": kvstore,
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
        "fill_missing_data_reads": False,
    }


def cast_spec(spec: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """Wraps an array spec in TensorStore's cast driver so reads come back as ``dtype``."""
    return {"driver": "cast", "base": spec, "dtype": ts_dtype_name(dtype)}


# ----------------------------------------------------------------------------------------------
# dtypes

_SUPPORTED = [
    "bool",
    "uint8",
    "int8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
]
TORCH_DTYPES = {name: getattr(torch, name) for name in _SUPPORTED if hasattr(torch, name)}
# dtypes numpy has natively; the others (bfloat16, float8) go through a same-width integer view.
_NUMPY_NATIVE = {n for n in TORCH_DTYPES if not (n == "bfloat16" or n.startswith("float8"))}
_VIEW_INT = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16)}


def ts_dtype_name(dtype: torch.dtype) -> str:
    """TensorStore/zarr dtype name of a torch dtype (raises TypeError if unsupported)."""
    name = str(dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise TypeError(f"dtype {dtype} cannot be stored in a checkpoint (supported: {sorted(TORCH_DTYPES)})")
    return name


def torch_dtype(ts_name: str) -> torch.dtype | None:
    """torch dtype of a TensorStore dtype name, or None if torch has no such dtype."""
    return TORCH_DTYPES.get(ts_name)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of a contiguous CPU tensor (bfloat16/float8 via ml_dtypes dtypes)."""
    name = ts_dtype_name(t.dtype)
    if name in _NUMPY_NATIVE:
        return t.numpy()
    torch_int, _ = _VIEW_INT[t.element_size()]
    return t.view(torch_int).numpy().view(getattr(ts, name).numpy_dtype)


def from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Zero-copy torch tensor over a numpy array read by TensorStore, as ``dtype``."""
    if ts_dtype_name(dtype) in _NUMPY_NATIVE:
        return torch.from_numpy(a)
    torch_int, np_int = _VIEW_INT[a.dtype.itemsize]
    return torch.from_numpy(a.view(np_int)).view(dtype)
