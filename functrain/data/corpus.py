"""Token corpora: turn a source (the stdlib, text files, nanoGPT `.bin` files) into train/val tokens.

Sources, as `load_dataset(source, cache_dir)` reads them:

* `"stdlib"`: the default corpus, available offline everywhere: every `.py` file under
  `sysconfig.get_paths()["stdlib"]` (test packages included; `site-packages`, `dist-packages` and
  `__pycache__` skipped), in sorted relative-path order.
* a directory of text files: every non-hidden file under it whose first 8 KiB hold no NUL byte.
* a single text file.
* a directory holding nanoGPT-style `train.bin` and `val.bin` (flat token arrays, uint16 unless a
  `meta.json` says `"dtype"`), with the vocabulary from `meta.json` / `meta.pkl` (`vocab_size`, and
  optionally `itos`/`stoi`) or else from the `vocab_size` argument. Read with `np.memmap`.

Text is tokenized to bytes (vocabulary 256, one token per UTF-8 byte) and documents are joined with
one newline byte (`SEPARATOR`), which keeps decoded samples printable. Train/val are split by file:
a file goes to val when a stable hash of its relative path falls below `val_fraction` (so adding a
file never moves another), with at least one file in each split. A single text file (or a directory
with one file) is split by position instead: its last `val_fraction` goes to val.

Text sources are tokenized once into a cache (`<cache_dir>/<name>-<fingerprint>/train.bin, val.bin,
meta.json`), keyed by the files' paths, sizes and mtimes. Every file is written to a temporary name
and renamed into place, and `meta.json` (the provenance record) is written last, so a killed run
never leaves a cache that looks complete; concurrent builders (several ranks) each write their own
temporaries and the renames are atomic.

Example:
    >>> ds = load_dataset("stdlib", "/tmp/functrain-data")
    >>> ds.vocab_size, len(ds.train) > len(ds.val) > 0
    (256, True)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import sys
import sysconfig
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from functrain.data.errors import DataError
from functrain.data.tokenizer import ByteTokenizer, IdTokenizer, VocabTokenizer

__all__ = ["Dataset", "load_dataset", "stdlib_files", "SEPARATOR", "DEFAULT_VAL_FRACTION"]

FORMAT_VERSION = 1
SEPARATOR = b"\n"
DEFAULT_VAL_FRACTION = 0.015
_CHUNK = 1 << 24  # bytes read at a time when tokenizing
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_FIX = (
    "point --config.data.path at a text file, a directory of text files, "
    "a directory with train.bin/val.bin, or 'stdlib'"
)


@dataclasses.dataclass
class Dataset:
    """Train and validation token arrays with their vocabulary and tokenizer.

    Args:
      train: 1-D token array (usually a read-only `np.memmap`).
      val: 1-D token array.
      vocab_size: number of token ids.
      tokenizer: an object with `encode(str)` and `decode(tokens)`.
      info: provenance (source, files, token counts, ...).

    Returns:
      (dataclass) use `.train`, `.val`, `.vocab_size`, `.encode(text)`, `.decode(tokens)`.

    Example:
      >>> ds = load_dataset("stdlib", "/tmp/data")
      >>> ds.decode(ds.train[:40])
    """

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    tokenizer: Any
    info: dict

    def encode(self, text: str) -> np.ndarray:
        """Encodes text with the dataset's tokenizer.

        Args:
          text: a string.

        Returns:
          A 1-D int64 numpy array of token ids.

        Example:
          >>> prompt = torch.from_numpy(ds.encode("def "))[None]  # (1, T0) for generate()
        """
        return self.tokenizer.encode(text)

    def decode(self, tokens) -> str:
        """Decodes token ids with the dataset's tokenizer.

        Args:
          tokens: ids as a list, numpy array or torch tensor.

        Returns:
          The text.

        Example:
          >>> print(ds.decode(generated[0]))
        """
        return self.tokenizer.decode(tokens)

    def __repr__(self) -> str:
        return (
            f"Dataset(source={self.info.get('source')!r}, vocab_size={self.vocab_size}, "
            f"train={len(self.train):,} tokens, val={len(self.val):,} tokens)"
        )


def load_dataset(
    source: str,
    cache_dir: str | os.PathLike,
    *,
    vocab_size: int | None = None,
    block_size: int | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> Dataset:
    """Loads (building and caching on first use) the train/val tokens of a data source.

    Args:
      source: "stdlib", a text file, a directory of text files, or a directory with
        train.bin/val.bin (a path to its train.bin also works). See the module docstring.
      cache_dir: where text sources are tokenized to (created if needed); unused for .bin sources.
      vocab_size: vocabulary of .bin sources without meta.json/meta.pkl; ignored otherwise.
      block_size: when given, each split must hold at least block_size + 1 tokens.
      val_fraction: share of files (or, for a single file, of bytes) that goes to val.

    Returns:
      A `Dataset`.

    Raises:
      DataError: one line naming the path and the fix (missing path, no text, split too short, ...).

    Example:
      >>> ds = load_dataset("data/shakespeare", "/tmp/data", block_size=256)
    """
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        ds = _load_text(stdlib_files(root), root, source, f"stdlib-py{sys.version.split()[0]}",
                        cache_dir, val_fraction)
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(f"data.path {source!r} does not exist; {_FIX}")
        if path.is_file() and path.suffix == ".bin":
            path = path.parent
        if path.is_dir() and (path / "train.bin").exists():
            ds = _load_bin(path, source, vocab_size)
        elif path.is_file():
            ds = _load_text([path], path.parent, source, _slug(path.name), cache_dir, val_fraction)
        else:
            ds = _load_text(_text_files(path), path, source, _slug(path.name), cache_dir, val_fraction)
    if block_size is not None:
        for split in ("train", "val"):
            n = len(getattr(ds, split))
            if n < block_size + 1:
                raise DataError(
                    f"data.path {source!r}: the {split} split has {n} tokens, fewer than "
                    f"block_size + 1 = {block_size + 1}; use more text or a smaller block_size"
                )
    return ds


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


def _text_files(root: Path) -> list[Path]:
    """Non-hidden files under `root` that look like text (no NUL in their first 8 KiB), sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS]
        for f in filenames:
            p = Path(dirpath) / f
            if not f.startswith(".") and p.is_file() and not _looks_binary(p):
                out.append(p)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def _looks_binary(path: Path) -> bool:
    """True when the file's first 8 KiB contain a NUL byte."""
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def _slug(name: str) -> str:
    """A file-system-safe short name for a cache directory."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:40] or "data"


def _val_score(rel: str) -> float:
    """Stable hash of a relative path, uniform in [0, 1)."""
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") / 2.0**64


def _split_files(rels: list[str], val_fraction: float) -> set[str]:
    """The relative paths that go to val: hash below val_fraction, at least one, never all."""
    scores = {r: _val_score(r) for r in rels}
    val = {r for r, s in scores.items() if s < val_fraction}
    if not val:
        val = {min(rels, key=scores.get)}
    if len(val) == len(rels):
        val.discard(max(val, key=scores.get))
    return val


def _load_text(files, root, source, name, cache_dir, val_fraction) -> Dataset:
    """Byte-tokenizes text files into a cached train/val pair (or reuses the cache)."""
    stats = [(p, p.relative_to(root).as_posix(), p.stat()) for p in files]
    total = sum(st.st_size for _, _, st in stats)
    if not stats or total == 0:
        raise DataError(f"data.path {source!r} holds no text ({len(stats)} files, 0 bytes); {_FIX}")
    fingerprint = hashlib.sha256(json.dumps({
        "version": FORMAT_VERSION,
        "source": source if source == "stdlib" else str(Path(source).resolve()),
        "python": sys.version if source == "stdlib" else None,
        "val_fraction": val_fraction,
        "files": [[rel, st.st_size, st.st_mtime_ns] for _, rel, st in stats],
    }).encode()).hexdigest()
    out = Path(cache_dir) / f"{name}-{fingerprint[:16]}"
    info = _read_cache_info(out)
    if info is None:
        if len(stats) == 1:  # one document: split by position
            path, rel, st = stats[0]
            cut = st.st_size - max(1, int(st.st_size * val_fraction))
            train_pieces, val_pieces = [(path, 0, cut)], [(path, cut, st.st_size)]
            val_files = []
            split = f"by position: last {val_fraction:g} of the bytes"
        else:
            val_set = _split_files([rel for _, rel, _ in stats], val_fraction)
            train_pieces = [(p, 0, st.st_size) for p, rel, st in stats if rel not in val_set]
            val_pieces = [(p, 0, st.st_size) for p, rel, st in stats if rel in val_set]
            val_files = sorted(val_set)
            split = f"by file: sha256(relative path) < {val_fraction:g}"
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        n_train = _write_tokens(out / "train.bin", train_pieces)
        n_val = _write_tokens(out / "val.bin", val_pieces)
        info = {
            "format": "functrain-tokens",
            "version": FORMAT_VERSION,
            "source": source,
            "root": str(root),
            "python": sys.version,
            "tokenizer": "bytes",
            "vocab_size": 256,
            "dtype": "uint16",
            "separator": list(SEPARATOR),
            "split": split,
            "val_fraction": val_fraction,
            "files": {"train": len(train_pieces), "val": len(val_pieces)},
            "tokens": {"train": n_train, "val": n_val},
            "val_files": val_files,
            "fingerprint": fingerprint,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "build_seconds": round(time.perf_counter() - t0, 3),
        }
        _atomic_write(out / "meta.json", lambda f: f.write(json.dumps(info, indent=1).encode()))
    info = dict(info, cache_dir=str(out))
    return Dataset(_memmap(out / "train.bin", np.uint16), _memmap(out / "val.bin", np.uint16),
                   256, ByteTokenizer(), info)


def _read_cache_info(out: Path) -> dict | None:
    """The meta.json of a complete cache directory, or None when it must be (re)built."""
    try:
        info = json.loads((out / "meta.json").read_text())
        complete = info.get("version") == FORMAT_VERSION and all(
            (out / f"{s}.bin").stat().st_size == 2 * info["tokens"][s] for s in ("train", "val"))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info if complete else None


def _write_tokens(dst: Path, pieces) -> int:
    """Writes byte tokens of (path, start, stop) pieces, SEPARATOR-joined, as uint16; returns the count."""
    count = 0

    def write(f):
        nonlocal count
        for i, (path, start, stop) in enumerate(pieces):
            if i:
                f.write(np.frombuffer(SEPARATOR, np.uint8).astype(np.uint16).tobytes())
                count += len(SEPARATOR)
            with open(path, "rb") as src:
                src.seek(start)
                left = stop - start
                while left > 0:
                    buf = src.read(min(_CHUNK, left))
                    if not buf:
                        break
                    f.write(np.frombuffer(buf, np.uint8).astype(np.uint16).tobytes())
                    count += len(buf)
                    left -= len(buf)

    _atomic_write(dst, write)
    return count


def _atomic_write(dst: Path, write) -> None:
    """Calls write(file) on a private temporary beside `dst`, then renames it onto `dst`."""
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()


def _memmap(path: Path, dtype) -> np.ndarray:
    """A read-only memmap of a flat token file (an empty array for an empty file)."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _load_bin(path: Path, source: str, vocab_size: int | None) -> Dataset:
    """Opens a nanoGPT-style directory with train.bin / val.bin (+ optional meta.json / meta.pkl)."""
    if not (path / "val.bin").exists():
        raise DataError(f"data.path {source!r} has train.bin but no val.bin; add a val.bin next to it")
    meta: dict = {}
    if (path / "meta.json").exists():
        meta = json.loads((path / "meta.json").read_text())
    elif (path / "meta.pkl").exists():
        with open(path / "meta.pkl", "rb") as f:  # nanoGPT's format; only open data you trust
            meta = pickle.load(f)
    vocab = meta.get("vocab_size") or vocab_size
    if vocab is None:
        raise DataError(
            f"data.path {source!r}: no vocab_size in meta.json/meta.pkl; set --config.model.vocab_size "
            f"or add a meta.json with {{\"vocab_size\": N}}"
        )
    dtype = np.dtype(meta.get("dtype", "uint16"))
    for split in ("train", "val"):
        size = (path / f"{split}.bin").stat().st_size
        if size % dtype.itemsize:
            raise DataError(
                f"data.path {source!r}: {split}.bin has {size} bytes, not a whole number of "
                f"{dtype} tokens; set \"dtype\" in meta.json"
            )
    if meta.get("tokenizer") == "bytes" or ("itos" not in meta and int(vocab) <= 256):
        tokenizer = ByteTokenizer()
    elif "itos" in meta:
        tokenizer = VocabTokenizer(meta["itos"], meta.get("stoi"))
    else:
        tokenizer = IdTokenizer(int(vocab))
    info = {"source": source, "kind": "bin", "dtype": str(dtype), "vocab_size": int(vocab),
            "tokenizer": tokenizer.name}
    return Dataset(_memmap(path / "train.bin", dtype), _memmap(path / "val.bin", dtype),
                   int(vocab), tokenizer, info)
