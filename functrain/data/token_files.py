"""What the token cache and the readers of sources share: the token dtype, the held-out share,
file-system-safe names, stable hashes of names, atomic writes.

Example:
    >>> atomic_write(Path("out/meta.json"), lambda f: f.write(b"{}"))
    >>> token_dtype(50304)
    dtype('uint16')
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

__all__ = ["DEFAULT_VAL_FRACTION", "atomic_write", "path_hash64", "slug", "token_dtype"]

DEFAULT_VAL_FRACTION = 0.015
"""The share of a source held out for validation (files, documents or bytes, by source kind)."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def slug(name: str, default: str = "data") -> str:
    """A file-system-safe short name (40 characters at most; `default` when nothing is left)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:40] or default


def path_hash64(rel: str) -> int:
    """A stable 64-bit hash of a relative path (the first 8 bytes of its sha256)."""
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")


def atomic_write(dst: Path, write: Callable[[BinaryIO], object]) -> None:
    """Calls write(file) on a private temporary beside `dst`, then renames it onto `dst`."""
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
