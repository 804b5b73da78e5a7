"""Every text source as documents in units, and the one rule that sends a document to validation.

Internals: docs/internals.md "functrain.data.documents".

Example:
    >>> files, root, name = text_source("stdlib")
    >>> units = text_units(files, root, digests)
    >>> is_val("json/__init__.py", 0.015)
    False
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from functrain.data.digests import file_digests
from functrain.data.errors import SOURCE_HINT, DataError
from functrain.data.placement import TextOptions
from functrain.data.shards import BadLines, is_shard_source, read_texts, shard_files, skipped_files
from functrain.data.token_files import DEFAULT_VAL_FRACTION, path_hash64, slug

__all__ = [
    "PACK_BYTES",
    "digests_memo",
    "is_val",
    "read_unit",
    "shard_units",
    "source_content",
    "stdlib_files",
    "text_source",
    "text_units",
    "train_documents",
    "validation_documents",
]

PACK_BYTES = 16 << 20  # text files per unit: about this many bytes (a few units for the stdlib's 31 MB)
_TEXT_BATCH = 64  # text files handed to the tokenizer at a time
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def is_val(key: str, val_fraction: float) -> bool:
    """Whether the document with this key goes to validation: its stable hash, in [0, 1), below val_fraction."""
    return path_hash64(key) / 2.0**64 < val_fraction


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The `.py` files of the Python standard library that make the default corpus.

    Args:
      root: the stdlib directory (default `sysconfig.get_paths()["stdlib"]`).

    Returns:
      Paths sorted by relative path, skipping site-packages, dist-packages and __pycache__.

    Example:
      >>> len(stdlib_files()) > 500
      True
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        out += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def text_source(source: str) -> tuple[list[Path], Path, str]:
    """(files, the root their names are relative to, a cache name) of "stdlib", a text file or a directory of text."""
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return stdlib_files(root), root, f"stdlib-py{sys.version.split()[0]}"
    path = Path(source).expanduser()
    if path.is_file():
        return [path], path.parent, slug(path.name)
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS]
        for f in filenames:
            p = Path(dirpath) / f
            if not f.startswith(".") and p.is_file() and not _looks_binary(p):
                out.append(p)
    return sorted(out, key=lambda p: p.relative_to(path).as_posix()), path, slug(path.name)


def _looks_binary(path: Path) -> bool:
    """True when the file's first 8 KiB contain a NUL byte."""
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def source_content(
    source: str, cache_dir: str | os.PathLike | None, log: Callable[[str], None] = print
) -> tuple[str, Path, str, list[list]]:
    """(kind "text" or "shards", root, cache name, [relative path, size, sha256] per file) of a source.

    Args:
      source: "stdlib", a text file, a directory of text files, or parquet/jsonl shards.
      cache_dir: where the files' digests are remembered (`digests.file_digests`; None: nowhere).
      log: where the line about skipped files goes.

    Returns:
      The tuple; the files in the source's order.

    Raises:
      DataError: a missing source, or one with no text (one line).

    Example:
      >>> kind, root, name, content = source_content("stdlib", "/tmp/cache")
    """
    if source != "stdlib" and not Path(source).expanduser().exists() and not is_shard_source(source):
        raise DataError(f"data.path {source!r} does not exist; {SOURCE_HINT}")
    if source != "stdlib" and is_shard_source(source):
        kind, (files, root) = "shards", shard_files(source)
        name = slug(root.name, "shards")
        skipped = skipped_files(source)
        if skipped:  # once, at the start: what the directory holds besides shards is left out
            names = ", ".join(p.relative_to(root).as_posix() for p in skipped[:8])
            more = f" and {len(skipped) - 8} more" if len(skipped) > 8 else ""
            log(
                f"data.path {source}: skipping {len(skipped)} file(s) that are not shards ({names}{more}); shards end "
                "in .parquet, .jsonl, .jsonl.gz, .json.gz or .ndjson"
            )
    else:
        kind, (files, root, name) = "text", text_source(source)
    stats = [p.stat() for p in files]  # one stat per file: its size is the one its digest is known by
    if kind == "text" and sum(st.st_size for st in stats) == 0:
        raise DataError(f"data.path {source!r} holds no text ({len(files)} files, 0 bytes); {SOURCE_HINT}")
    digests = file_digests(files, memo=None if cache_dir is None else digests_memo(cache_dir, name, root), stats=stats)
    return (
        kind,
        root,
        name,
        [[p.relative_to(root).as_posix(), st.st_size, d] for p, st, d in zip(files, stats, digests)],
    )


def digests_memo(cache_dir: str | os.PathLike, name: str, root: Path) -> Path:
    """Where the sha256 of a source's files are remembered: `<cache_dir>/digests/<name>-<hash of its root>.json`."""
    return Path(cache_dir) / "digests" / f"{name}-{hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]}.json"


def _key(rel: str) -> str:
    """A unit's file id: a hash of its name (plus a readable stem)."""
    return f"{path_hash64(rel):016x}-{slug(Path(rel).name, '')}"


def shard_units(content: list[list]) -> list[dict]:
    """One unit per parquet/jsonl shard, from its [relative path, size, sha256]."""
    return [
        {"rel": rel, "key": _key(rel), "kind": "shard", "files": [[rel, size, sha]], "size": size}
        for rel, size, sha in content
    ]


def text_units(content: list[list], val_fraction: float) -> list[dict]:
    """Text files ([relative path, size, sha256], sorted) packed into units, each with its validation
    files ("val"); one file is cut by position ("cut")."""
    if len(content) == 1:
        rel, size, _ = content[0]
        return [
            {
                "rel": rel,
                "key": _key(rel),
                "kind": "text",
                "files": [list(content[0])],
                "size": size,
                "cut": size - max(1, int(size * val_fraction)),
            }
        ]
    val = {rel for rel, _, _ in content if is_val(rel, val_fraction)}
    if not val or len(val) == len(content):
        val ^= {content[0][0]}  # the first file moves across: both splits hold one
    units, pack = [], []
    for i, (rel, size, sha) in enumerate(content):
        pack.append([rel, size, sha])
        if i == len(content) - 1 or path_hash64("pack:" + rel) / 2.0**64 < size / PACK_BYTES:
            units.append(
                {
                    "rel": pack[0][0],
                    "key": _key(pack[0][0]),
                    "kind": "text",
                    "files": pack,
                    "size": sum(f[1] for f in pack),
                    "val": [f[0] for f in pack if f[0] in val],
                }
            )
            pack = []
    return units


def read_unit(
    unit: dict, root: Path, options: TextOptions, *, bad_lines: BadLines, chunk_bytes: int, raw: bool
) -> Iterator[tuple[list, np.ndarray, np.ndarray, int]]:
    """A unit's documents in order, as (pieces, to_val, ends, bytes read) groups of about `chunk_bytes`.

    Args:
      unit: from `shard_units` or `text_units`.
      root: the directory the unit's names are relative to.
      options: the source's `val_fraction` (the share of documents that go to validation, `is_val`) and
        `text_field` (shards: the column / JSON key holding the text).
      bad_lines: shards: the jsonl bad-line policy.
      chunk_bytes: text per group.
      raw: text files: give bytes (for the byte tokenizer, never decoded, and a large file in
        pieces); else strings (invalid UTF-8 replaced).

    Returns:
      An iterator of groups: the pieces (str or bytes), whether each goes to validation, whether each
      ends its document (a separator follows it), and the bytes read from disk since the last group.

    Example:
      >>> for pieces, to_val, ends, nbytes in read_unit(u, root, TextOptions(), bad_lines=BadLines(),
      ...                                                chunk_bytes=4 << 20, raw=True): ...
    """
    if unit["kind"] == "shard":
        index = 0
        for texts, nbytes in read_texts(
            root / unit["rel"], text_field=options.text_field, bad_lines=bad_lines, chunk_bytes=chunk_bytes
        ):
            to_val = np.fromiter(
                (is_val(f"{unit['rel']}:{index + i}", options.val_fraction) for i in range(len(texts))),
                bool,
                len(texts),
            )
            index += len(texts)
            yield texts, to_val, np.ones(len(texts), bool), nbytes
        return
    if "cut" in unit:  # one file, one document: its head trains, its tail validates
        (rel, size, _), cut = unit["files"][0], unit["cut"]
        for start, stop, val in ((0, cut, False), (cut, size, True)):
            for piece, end in _pieces(root / rel, start, stop, chunk_bytes if raw else None):
                yield (
                    [piece if raw else piece.decode("utf-8", errors="replace")],
                    np.array([val]),
                    np.array([end]),
                    len(piece),
                )
        return
    group: list = []
    vals: list[bool] = []
    ends: list[bool] = []
    nbytes, val_files = 0, set(unit["val"])
    for rel, size, _ in unit["files"]:
        val = rel in val_files
        for piece, end in _pieces(root / rel, 0, size, chunk_bytes if raw else None):
            group.append(piece if raw else piece.decode("utf-8", errors="replace"))
            vals.append(val)
            ends.append(end)
            nbytes += len(piece)
            if len(group) >= _TEXT_BATCH or nbytes >= chunk_bytes:
                yield group, np.array(vals, bool), np.array(ends, bool), nbytes
                group, vals, ends, nbytes = [], [], [], 0
    if group:
        yield group, np.array(vals, bool), np.array(ends, bool), nbytes


def _pieces(path: Path, start: int, stop: int, chunk: int | None) -> Iterator[tuple[bytes, bool]]:
    """Bytes [start, stop) of a file, whole or in pieces of `chunk`, each with whether it is the last."""
    with open(path, "rb") as f:
        f.seek(start)
        left = stop - start
        while True:
            piece = f.read(left if chunk is None else min(chunk, left))
            left -= len(piece)
            yield piece, left <= 0 or not piece
            if left <= 0 or not piece:
                return


def train_documents(
    source: str,
    *,
    text_field: str = "text",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    cache_dir: str | os.PathLike | None = None,
) -> Iterator[str]:
    """The documents of a source that `tokenize` puts in the train split, streamed.

    Args:
      source: as `tokenize`'s.
      text_field: shards: the column / JSON key holding the text.
      val_fraction: as `tokenize`'s (the same documents are left out).
      cache_dir: where the files' digests are remembered (None: not remembered).

    Returns:
      An iterator of strings (e.g. to train a tokenizer on without seeing the validation text).

    Example:
      >>> tok = train_bpe(train_documents("/data/web"), 4096, "bpe.json")
    """
    return _split_documents(source, False, text_field, val_fraction, cache_dir)


def validation_documents(
    source: str,
    *,
    text_field: str = "text",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    cache_dir: str | os.PathLike | None = None,
) -> Iterator[str]:
    """The documents of a source that `tokenize` puts in the validation split, streamed in the source's order.

    Args:
      source: as `tokenize`'s.
      text_field: shards: the column / JSON key holding the text.
      val_fraction: as `tokenize`'s (the same documents are held out).
      cache_dir: where the files' digests are remembered (None: not remembered).

    Returns:
      An iterator of strings (e.g. to build `functrain.eval.next_lines` questions that training never saw).

    Example:
      >>> docs = list(validation_documents("stdlib"))
    """
    return _split_documents(source, True, text_field, val_fraction, cache_dir)


def _split_documents(source: str, val: bool, text_field: str, val_fraction: float, cache_dir) -> Iterator[str]:
    """The documents of one split of a source (`val`: validation, else train), streamed."""
    kind, root, _, content = source_content(source, cache_dir, log=lambda line: None)
    for unit in shard_units(content) if kind == "shards" else text_units(content, val_fraction):
        options = TextOptions(text_field, val_fraction)
        for pieces, to_val, _, _ in read_unit(
            unit, root, options, bad_lines=BadLines(1.0), chunk_bytes=4 << 20, raw=False
        ):
            yield from (t for t, v in zip(pieces, to_val) if v == val)
