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
one newline byte (`SEPARATOR`), which keeps decoded samples printable. With a `tokenizer` (an
`HFTokenizer`: a model's `tokenizer.json`, or the byte-level BPE `train_tokenizer` trains on the
train split) text is tokenized with it instead, documents joined by its end-of-text token, ids
stored as uint16 (uint32 above 65,536 ids). Train/val are split by file:
a file goes to val when a stable hash of its relative path falls below `val_fraction` (so adding a
file never moves another), with at least one file in each split. A single text file (or a directory
with one file) is split by position instead: its last `val_fraction` goes to val.

Text sources are tokenized once into a cache (`<cache_dir>/<name>-<fingerprint>/train.bin, val.bin,
meta.json`), keyed by the files' relative paths and the sha256 of their bytes (`digests`). Every file is written to a temporary name
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
from pathlib import Path
from typing import Any, Callable

import numpy as np

from functrain.data.digests import file_digests
from functrain.data.errors import DataError
from functrain.data.shards import is_shard_source, shard_files
from functrain.data.token_cache import FORMAT as SHARDS_FORMAT
from functrain.data.token_cache import open_token_cache, tokenize_shards, tokenizer_id, train_documents
from functrain.data.token_files import DEFAULT_VAL_FRACTION, atomic_write, path_hash64, slug, token_dtype
from functrain.data.tokenizer import (SEPARATOR, ByteTokenizer, HFTokenizer, IdTokenizer, VocabTokenizer, separator_ids,
                                      train_bpe)

__all__ = ["Dataset", "load_dataset", "stdlib_files", "train_tokenizer", "SEPARATOR", "DEFAULT_VAL_FRACTION"]

FORMAT_VERSION = 1
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
    tokenizer: Any = None,
    text_field: str = "text",
    max_bad_line_fraction: float = 0.0,
    workers: int = 0,
    rank: int = 0,
    world: int = 1,
    log: Callable[[str], None] = print,
) -> Dataset:
    """Loads (building and caching on first use) the train/val tokens of a data source.

    Args:
      source: "stdlib", a text file, a directory of text files, or a directory with
        train.bin/val.bin (a path to its train.bin also works). See the module docstring.
      cache_dir: where text sources are tokenized to (created if needed); unused for .bin sources.
      vocab_size: vocabulary of .bin sources without meta.json/meta.pkl; ignored otherwise.
      block_size: when given, each split must hold at least block_size + 1 tokens.
      val_fraction: share of files (or, for a single file, of bytes) that goes to val.
      tokenizer: for text sources: an `HFTokenizer` (e.g. from `train_tokenizer`, or a model's
        tokenizer.json) to tokenize with instead of bytes; the cache is keyed by its file's hash,
        and tokens are stored as uint16, or uint32 when the vocabulary needs it.
      text_field: parquet/jsonl shards: the column or key holding the text.
      max_bad_line_fraction: jsonl shards: the share of lines that may be skipped as not JSON.
      workers: shards: tokenizing processes on this rank (0: its share of the cores).
      rank: shards: this process's rank among the `world` processes that share the tokenizing
        (every one of them must call `load_dataset`).
      world: shards: the number of such processes.
      log: shards: where the progress lines go.

    Returns:
      A `Dataset`.

    Raises:
      DataError: one line naming the path and the fix (missing path, no text, split too short, ...).

    Example:
      >>> ds = load_dataset("data/shakespeare", "/tmp/data", block_size=256)
    """
    if source != "stdlib" and is_shard_source(source):
        out = tokenize_shards(source, cache_dir, tokenizer=tokenizer, text_field=text_field, val_fraction=val_fraction,
                              max_bad_line_fraction=max_bad_line_fraction, workers=workers, rank=rank, world=world,
                              log=log)
        ds = _load_token_cache(out, source, tokenizer)
    elif source != "stdlib" and (Path(source).expanduser() / "meta.json").is_file() and _is_token_cache(source):
        ds = _load_token_cache(Path(source).expanduser(), source, tokenizer)
    elif source == "stdlib":
        ds = _load_text(*_text_source(source), source=source, cache_dir=cache_dir, val_fraction=val_fraction,
                        tokenizer=tokenizer)
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(f"data.path {source!r} does not exist; {_FIX}")
        if path.is_file() and path.suffix == ".bin":
            path = path.parent
        if path.is_dir() and (path / "train.bin").exists():
            ds = _load_bin(path, source, vocab_size, cache_dir)
        else:
            ds = _load_text(*_text_source(str(path)), source=source, cache_dir=cache_dir, val_fraction=val_fraction,
                            tokenizer=tokenizer)
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


def _val_score(rel: str) -> float:
    """Stable hash of a relative path, uniform in [0, 1)."""
    return path_hash64(rel) / 2.0**64


def _split_files(rels: list[str], val_fraction: float) -> set[str]:
    """The relative paths that go to val: hash below val_fraction, at least one, never all."""
    scores = {r: _val_score(r) for r in rels}
    val = {r for r, s in scores.items() if s < val_fraction}
    if not val:
        val = {min(rels, key=scores.get)}
    if len(val) == len(rels):
        val.discard(max(val, key=scores.get))
    return val


def _plan(stats, val_fraction):
    """(train pieces, val pieces, val files, split description) of (path, rel, stat) triples."""
    if len(stats) == 1:  # one document: split by position
        path, rel, st = stats[0]
        cut = st.st_size - max(1, int(st.st_size * val_fraction))
        return [(path, 0, cut)], [(path, cut, st.st_size)], [], f"by position: last {val_fraction:g} of the bytes"
    val_set = _split_files([rel for _, rel, _ in stats], val_fraction)
    train = [(p, 0, st.st_size) for p, rel, st in stats if rel not in val_set]
    val = [(p, 0, st.st_size) for p, rel, st in stats if rel in val_set]
    return train, val, sorted(val_set), f"by file: sha256(relative path) < {val_fraction:g}"


def _text_source(source: str):
    """(files, root, cache name) of a text source ("stdlib", a file or a directory of text)."""
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return stdlib_files(root), root, f"stdlib-py{sys.version.split()[0]}"
    path = Path(source).expanduser()
    if path.is_file():
        return [path], path.parent, slug(path.name)
    return _text_files(path), path, slug(path.name)


def _load_text(files, root, name, *, source, cache_dir, val_fraction, tokenizer=None) -> Dataset:
    """Tokenizes text files (bytes, or `tokenizer`) into a cached train/val pair (or reuses the cache)."""
    stats = [(p, p.relative_to(root).as_posix(), p.stat()) for p in files]
    total = sum(st.st_size for _, _, st in stats)
    if not stats or total == 0:
        raise DataError(f"data.path {source!r} holds no text ({len(stats)} files, 0 bytes); {_FIX}")
    content = _content(stats, root, cache_dir)
    tokenizer = tokenizer or ByteTokenizer()
    hf = getattr(tokenizer, "sha256", None)  # a `tokenizers` file; None: bytes
    fingerprint = hashlib.sha256(json.dumps({
        "version": FORMAT_VERSION,
        "source": source if source == "stdlib" else str(Path(source).resolve()),
        "python": sys.version if source == "stdlib" else None,
        "val_fraction": val_fraction,
        "files": content,
        **({"tokenizer": hf} if hf else {}),
    }).encode()).hexdigest()
    out = Path(cache_dir) / f"{name}{'-tok' if hf else ''}-{fingerprint[:16]}"
    dtype = token_dtype(tokenizer.vocab_size)
    info = _read_cache_info(out, dtype)
    if info is None:
        train_pieces, val_pieces, val_files, split = _plan(stats, val_fraction)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DataError(f"data cache {cache_dir}: cannot be created ({exc.strerror or exc}); pass a writable "
                            "--workdir or --config.data.cache_dir") from None
        t0 = time.perf_counter()
        n_train = _write_tokens(out / "train.bin", train_pieces, tokenizer, dtype)
        n_val = _write_tokens(out / "val.bin", val_pieces, tokenizer, dtype)
        info = {
            "format": "functrain-tokens",
            "version": FORMAT_VERSION,
            "source": source,
            "root": str(root),
            "python": sys.version,
            "tokenizer": tokenizer.name,
            "vocab_size": tokenizer.vocab_size,
            "dtype": np.dtype(dtype).name,
            "separator": separator_ids(tokenizer),
            "split": split,
            "val_fraction": val_fraction,
            "files": {"train": len(train_pieces), "val": len(val_pieces)},
            "tokens": {"train": n_train, "val": n_val},
            "val_files": val_files,
            "fingerprint": fingerprint,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "build_seconds": round(time.perf_counter() - t0, 3),
        }
        if hf:
            info["tokenizer_file"], info["tokenizer_sha256"] = str(tokenizer.path), hf
        atomic_write(out / "meta.json", lambda f: f.write(json.dumps(info, indent=1).encode()))
    info = dict(info, cache_dir=str(out), content=content)
    return Dataset(_memmap(out / "train.bin", dtype), _memmap(out / "val.bin", dtype),
                   tokenizer.vocab_size, tokenizer, info)


def train_tokenizer(source: str, cache_dir: str | os.PathLike, vocab_size: int, *,
                    val_fraction: float = DEFAULT_VAL_FRACTION, text_field: str = "text") -> HFTokenizer:
    """The byte-level BPE of `source`'s training split (trained once, then read from `cache_dir`).

    Only the files (or bytes) of the train split are read, so the validation text stays unseen.
    The file is `<cache_dir>/bpe<vocab_size>-<fingerprint>.json`; delete it to retrain.

    Args:
      source: a text source as `load_dataset` reads it ("stdlib", a text file, a directory of text).
      cache_dir: where the tokenizer file goes (the run's data directory by default).
      vocab_size: ids in the tokenizer (>= 257).
      val_fraction: as `load_dataset`'s (the same split).
      text_field: parquet/jsonl shards: the column or key holding the text (their train documents
        are read, streamed).

    Returns:
      The `HFTokenizer`; pass it to `load_dataset(..., tokenizer=)`.

    Raises:
      DataError: a missing or empty source (one line).

    Example:
      >>> tok = train_tokenizer("stdlib", "runs/llama/data", 4096)
      >>> ds = load_dataset("stdlib", "runs/llama/data", tokenizer=tok)
    """
    if source != "stdlib" and not Path(source).expanduser().exists():
        raise DataError(f"data.path {source!r} does not exist; {_FIX}")
    if source != "stdlib" and is_shard_source(source):
        files, root = shard_files(source)
        stats = [(p, p.relative_to(root).as_posix(), p.stat()) for p in files]
        fingerprint = hashlib.sha256(json.dumps({
            "bpe": vocab_size, "val_fraction": val_fraction, "text_field": text_field,
            "files": _content(stats, root, cache_dir)}).encode()).hexdigest()
        path = Path(cache_dir) / f"{slug(root.name)}-bpe{vocab_size}-{fingerprint[:16]}.json"
        if path.exists():
            return HFTokenizer(path)
        return train_bpe(train_documents(source, text_field=text_field, val_fraction=val_fraction), vocab_size, path)
    files, root, name = _text_source(source)
    stats = [(p, p.relative_to(root).as_posix(), p.stat()) for p in files]
    if not stats or sum(st.st_size for _, _, st in stats) == 0:
        raise DataError(f"data.path {source!r} holds no text to train a tokenizer on; {_FIX}")
    train_pieces, _, _, _ = _plan(stats, val_fraction)
    fingerprint = hashlib.sha256(json.dumps({
        "bpe": vocab_size, "val_fraction": val_fraction, "python": sys.version if source == "stdlib" else None,
        "files": _content(stats, root, cache_dir),
    }).encode()).hexdigest()
    path = Path(cache_dir) / f"{name}-bpe{vocab_size}-{fingerprint[:16]}.json"
    if path.exists():
        return HFTokenizer(path)
    return train_bpe((_read_piece(*piece) for piece in train_pieces), vocab_size, path)


def _read_cache_info(out: Path, dtype) -> dict | None:
    """The meta.json of a complete cache directory, or None when it must be (re)built."""
    size = np.dtype(dtype).itemsize
    try:
        info = json.loads((out / "meta.json").read_text())
        complete = info.get("version") == FORMAT_VERSION and all(
            (out / f"{s}.bin").stat().st_size == size * info["tokens"][s] for s in ("train", "val"))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info if complete else None


def _read_piece(path: Path, start: int, stop: int) -> str:
    """The text of bytes [start, stop) of a file (invalid UTF-8 replaced)."""
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(stop - start).decode("utf-8", errors="replace")


def _write_tokens(dst: Path, pieces, tokenizer, dtype) -> int:
    """Writes the tokens of (path, start, stop) pieces, separator-joined, as `dtype`; returns the count."""
    count = 0
    sep = np.asarray(separator_ids(tokenizer), dtype=dtype).tobytes()

    def write_bytes(f):
        nonlocal count
        for i, (path, start, stop) in enumerate(pieces):
            if i:
                f.write(sep)
                count += len(SEPARATOR)
            with open(path, "rb") as src:
                src.seek(start)
                left = stop - start
                while left > 0:
                    buf = src.read(min(_CHUNK, left))
                    if not buf:
                        break
                    f.write(np.frombuffer(buf, np.uint8).astype(dtype).tobytes())
                    count += len(buf)
                    left -= len(buf)

    def write_tokenized(f):
        nonlocal count
        batch = 64  # documents per encode_batch call (parallel in the tokenizers library)
        for b in range(0, len(pieces), batch):
            texts = [_read_piece(*piece) for piece in pieces[b:b + batch]]
            for i, ids in enumerate(tokenizer.encode_batch(texts)):
                if b + i:
                    f.write(sep)
                    count += len(sep) // np.dtype(dtype).itemsize
                f.write(np.asarray(ids, dtype=dtype).tobytes())
                count += len(ids)

    atomic_write(dst, write_bytes if isinstance(tokenizer, ByteTokenizer) else write_tokenized)
    return count


def _memmap(path: Path, dtype) -> np.ndarray:
    """A read-only memmap of a flat token file (an empty array for an empty file)."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _content(stats, root: Path, cache_dir) -> list[list]:
    """[relative path, size, sha256] of each file (digests remembered under `<cache_dir>/digests/`)."""
    memo = Path(cache_dir) / "digests" / f"{slug(root.name, 'data')}-{hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]}.json"
    digests = file_digests([p for p, _, _ in stats], memo=memo, stats=[st for _, _, st in stats])
    return [[rel, st.st_size, d] for (_, rel, st), d in zip(stats, digests)]


def _load_bin(path: Path, source: str, vocab_size: int | None, cache_dir) -> Dataset:
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
    bins = [(path / f"{s}.bin", f"{s}.bin", (path / f"{s}.bin").stat()) for s in ("train", "val")]
    info = {"source": source, "kind": "bin", "dtype": str(dtype), "vocab_size": int(vocab),
            "tokenizer": tokenizer.name, "content": _content(bins, path, cache_dir)}
    return Dataset(_memmap(path / "train.bin", dtype), _memmap(path / "val.bin", dtype),
                   int(vocab), tokenizer, info)


def _is_token_cache(source: str) -> bool:
    """Whether `source` is a directory `tokenize_shards` wrote (its meta.json names the format)."""
    try:
        return json.loads((Path(source).expanduser() / "meta.json").read_text()).get("format") == SHARDS_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _load_token_cache(out: Path, source: str, tokenizer: Any) -> Dataset:
    """A token cache directory as a Dataset; `tokenizer`, when given, must be the one that wrote it."""
    train, val, info = open_token_cache(out)
    if tokenizer is not None and tokenizer_id(tokenizer) != info["tokenizer"]:
        raise DataError(f"{out}: its tokens were written by {info['tokenizer_name']} ({info['tokenizer']}), this run "
                        f"tokenizes with {tokenizer.name} ({tokenizer_id(tokenizer)}); point data.path at the shards "
                        "themselves (they are tokenized again) or use the tokenizer that wrote it")
    if tokenizer is None:
        if info["tokenizer"] == "bytes":
            tokenizer = ByteTokenizer()
        elif info.get("tokenizer_file") and Path(info["tokenizer_file"]).is_file():
            tokenizer = HFTokenizer(info["tokenizer_file"])
        else:
            tokenizer = IdTokenizer(info["vocab_size"])
    meta = {k: info[k] for k in ("source", "text_field", "tokenizer", "dtype", "tokens", "documents", "bad_lines")}
    return Dataset(train, val, tokenizer.vocab_size, tokenizer,
                   dict(meta, kind="shards", shards=len(info["shards"]), cache_dir=str(out), requested=source,
                        content=[[s["rel"], s["size"], s.get("sha256")] for s in info["shards"]]))
