"""Content digests of data files: the sha256 of each file's bytes, remembered by the file's identity.

Internals: docs/internals.md "functrain.data.digests".

Example:
    >>> digests = file_digests([Path("a.jsonl"), Path("b.jsonl")], memo=Path("/tmp/cache/digests.json"))
    >>> digests[0][:12]
    '5f1d0c7e9a2b'
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from functrain.data.token_files import atomic_write

__all__ = ["file_digest", "file_digests"]


def file_digest(path: str | os.PathLike) -> str:
    """The sha256 (hex) of a file's bytes.

    Args:
      path: the file.

    Returns:
      64 hex digits.

    Example:
      >>> file_digest("data/shard-0.parquet")[:8]
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _identity(st: os.stat_result) -> list[int]:
    """What a file's digest is remembered by: size, mtime, ctime, inode, device."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def file_digests(
    paths: Iterable[str | os.PathLike],
    memo: str | os.PathLike | None = None,
    stats: Iterable[os.stat_result] | None = None,
) -> list[str]:
    """The sha256 of each file, hashing only those whose identity changed since the memo was written.

    Args:
      paths: the files.
      memo: a JSON file remembering digests (created or updated here; None: hash every file).
      stats: each file's `stat()`, when the caller has taken it (the size it records with the digest
        is then the one the digest is remembered by); None: taken here.

    Returns:
      One digest per path, in order.

    Example:
      >>> file_digests(sorted(Path("data").glob("*.jsonl")), memo="runs/x/data/digests.json")
    """
    files = [Path(p) for p in paths]
    stats = [p.stat() for p in files] if stats is None else list(stats)
    known: dict = {}
    if memo is not None:
        try:
            known = json.loads(Path(memo).read_text())
        except (OSError, ValueError):
            known = {}
    out, fresh, changed = [], {}, False
    for p, st in zip(files, stats, strict=True):
        key = str(p.resolve())
        ident = _identity(st)
        entry = known.get(key)
        if isinstance(entry, list) and len(entry) == 2 and entry[0] == ident:
            digest = entry[1]
        else:
            digest, changed = file_digest(p), True
        fresh[key] = [ident, digest]
        out.append(digest)
    if memo is not None and (changed or len(fresh) != len(known)):
        try:
            Path(memo).parent.mkdir(parents=True, exist_ok=True)
            atomic_write(Path(memo), lambda f: f.write(json.dumps(fresh).encode()))
        except OSError:
            pass  # a read-only cache: the digests are right, only the next run hashes again
    return out
