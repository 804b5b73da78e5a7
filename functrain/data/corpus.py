"""Token corpora: turn a source (the stdlib, text files, parquet/jsonl shards, nanoGPT `.bin` files) into
train/val tokens.

Internals: docs/internals.md "functrain.data.corpus".

Example:
    >>> ds = load_dataset("stdlib", Placement("/tmp/functrain-data"))
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
from pathlib import Path
from typing import Any

import numpy as np

from functrain.data.digests import file_digests
from functrain.data.documents import digests_memo, source_content, train_documents
from functrain.data.errors import DataError
from functrain.data.placement import Placement, TextOptions
from functrain.data.token_cache import FORMATS as TOKEN_CACHE_FORMATS
from functrain.data.token_cache import open_token_cache, tokenize, tokenizer_id
from functrain.data.token_files import DEFAULT_VAL_FRACTION, slug
from functrain.data.tokenizer import ByteTokenizer, HFTokenizer, IdTokenizer, VocabTokenizer, train_bpe
from functrain.data.tokens import ConcatTokens

__all__ = ["Dataset", "load_dataset", "train_tokenizer"]


@dataclasses.dataclass
class Dataset:
    """Train and validation token arrays with their vocabulary and tokenizer.

    Args:
      train: 1-D tokens: a `ConcatTokens` over the cache's memory-mapped units (a read-only
        `np.memmap` for `.bin` sources).
      val: 1-D token array.
      vocab_size: number of token ids.
      tokenizer: an object with `encode(str)` and `decode(tokens)`.
      info: provenance (source, files, token counts, ...).

    Returns:
      (dataclass) use `.train`, `.val`, `.vocab_size`, `.encode(text)`, `.decode(tokens)`.

    Example:
      >>> ds = load_dataset("stdlib", Placement("/tmp/data"))
      >>> ds.decode(ds.train[:40])
    """

    train: np.ndarray | ConcatTokens
    val: np.ndarray | ConcatTokens
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
    place: Placement,
    options: TextOptions = TextOptions(),
    *,
    tokenizer: Any = None,
    vocab_size: int | None = None,
    block_size: int | None = None,
) -> Dataset:
    """Loads (building and caching on first use) the train/val tokens of a data source.

    Args:
      source: "stdlib", a text file, a directory of text files, or a directory with
        train.bin/val.bin (a path to its train.bin also works). See the module docstring.
      place: where text sources are tokenized to (`cache_dir`; unused for .bin sources) and, for
        shards, this process's `rank` among the `world` processes that share the tokenizing (every one
        of them must call `load_dataset`) and where the progress lines go (`log`).
      options: how text is read and split (`TextOptions`: text field, validation fraction, bad jsonl
        lines allowed, tokenizing workers).
      tokenizer: for text sources: an `HFTokenizer` (e.g. from `train_tokenizer`, or a model's
        tokenizer.json) to tokenize with instead of bytes; the cache is keyed by its file's hash,
        and tokens are stored as uint16, or uint32 when the vocabulary needs it.
      vocab_size: vocabulary of .bin sources without meta.json/meta.pkl; ignored otherwise.
      block_size: when given, each split must hold at least block_size + 1 tokens.

    Returns:
      A `Dataset`.

    Raises:
      DataError: one line naming the path and the fix (missing path, no text, split too short, ...).

    Example:
      >>> ds = load_dataset("data/shakespeare", Placement("/tmp/data"), block_size=256)
    """
    path = Path(source).expanduser()
    if source != "stdlib" and (path / "meta.json").is_file() and _is_token_cache(source):
        ds = _load_token_cache(path, source, tokenizer)
    elif source != "stdlib" and ((path.is_file() and path.suffix == ".bin") or (path / "train.bin").exists()):
        ds = _load_bin(path.parent if path.is_file() else path, source, vocab_size, place.cache_dir)
    else:
        out = tokenize(source, place, options, tokenizer=tokenizer)
        ds = _load_token_cache(out, source, tokenizer)
    if block_size is not None:
        for split in ("train", "val"):
            n = len(getattr(ds, split))
            if n < block_size + 1:
                raise DataError(
                    f"data.path {source!r}: the {split} split has {n} tokens, fewer than "
                    f"block_size + 1 = {block_size + 1}; use more text or a smaller block_size"
                )
    return ds


def train_tokenizer(
    source: str,
    cache_dir: str | os.PathLike,
    vocab_size: int,
    *,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    text_field: str = "text",
) -> HFTokenizer:
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
      >>> ds = load_dataset("stdlib", Placement("runs/llama/data"), tokenizer=tok)
    """
    kind, root, name, content = source_content(source, cache_dir, log=lambda line: None)
    fingerprint = hashlib.sha256(
        json.dumps(
            {
                "bpe": vocab_size,
                "val_fraction": val_fraction,
                "python": sys.version if source == "stdlib" else None,
                "files": content,
                **({"text_field": text_field, "split": "per document"} if kind == "shards" else {}),
            }
        ).encode()
    ).hexdigest()
    path = Path(cache_dir) / f"{name}-bpe{vocab_size}-{fingerprint[:16]}.json"
    if path.exists():
        return HFTokenizer(path)
    return train_bpe(
        train_documents(source, text_field=text_field, val_fraction=val_fraction, cache_dir=cache_dir), vocab_size, path
    )


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
            f'or add a meta.json with {{"vocab_size": N}}'
        )
    dtype = np.dtype(meta.get("dtype", "uint16"))
    for split in ("train", "val"):
        size = (path / f"{split}.bin").stat().st_size
        if size % dtype.itemsize:
            raise DataError(
                f"data.path {source!r}: {split}.bin has {size} bytes, not a whole number of "
                f'{dtype} tokens; set "dtype" in meta.json'
            )
    tokenizer: ByteTokenizer | VocabTokenizer | IdTokenizer
    if meta.get("tokenizer") == "bytes" or ("itos" not in meta and int(vocab) <= 256):
        tokenizer = ByteTokenizer()
    elif "itos" in meta:
        tokenizer = VocabTokenizer(meta["itos"], meta.get("stoi"))
    else:
        tokenizer = IdTokenizer(int(vocab))
    bins = [path / f"{s}.bin" for s in ("train", "val")]
    stats = [p.stat() for p in bins]
    memo = digests_memo(cache_dir, slug(path.name), path)
    info = {
        "source": source,
        "kind": "bin",
        "dtype": str(dtype),
        "vocab_size": int(vocab),
        "tokenizer": tokenizer.name,
        "content": [[p.name, st.st_size, d] for p, st, d in zip(bins, stats, file_digests(bins, memo, stats))],
    }
    return Dataset(_memmap(path / "train.bin", dtype), _memmap(path / "val.bin", dtype), int(vocab), tokenizer, info)


def _memmap(path: Path, dtype) -> np.ndarray:
    """A read-only memmap of a flat token file (an empty array for an empty file)."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _is_token_cache(source: str) -> bool:
    """Whether `source` is a directory `tokenize` wrote (its meta.json names the format)."""
    try:
        meta = json.loads((Path(source).expanduser() / "meta.json").read_text())
        return (meta.get("format"), meta.get("version")) in TOKEN_CACHE_FORMATS
    except (OSError, ValueError, AttributeError):
        return False


def _load_token_cache(out: Path, source: str, tokenizer: Any) -> Dataset:
    """A token cache directory as a Dataset; `tokenizer`, when given, must be the one that wrote it."""
    train, val, info = open_token_cache(out)
    if tokenizer is not None and tokenizer_id(tokenizer) != info["tokenizer"]:
        raise DataError(
            f"{out}: its tokens were written by {info['tokenizer_name']} ({info['tokenizer']}), this run "
            f"tokenizes with {tokenizer.name} ({tokenizer_id(tokenizer)}); point data.path at the source "
            "itself (it is tokenized again) or use the tokenizer that wrote it"
        )
    if tokenizer is None:
        if info["tokenizer"] == "bytes":
            tokenizer = ByteTokenizer()
        elif info.get("tokenizer_file") and Path(info["tokenizer_file"]).is_file():
            tokenizer = HFTokenizer(info["tokenizer_file"])
        else:
            tokenizer = IdTokenizer(info["vocab_size"])
    meta = {
        k: info[k]
        for k in ("kind", "source", "text_field", "tokenizer", "dtype", "tokens", "documents", "bad_lines", "content")
    }
    return Dataset(
        train,
        val,
        tokenizer.vocab_size,
        tokenizer,
        dict(meta, units=len(info["units"]), cache_dir=str(out), requested=source, val_files=info.get("val_files", [])),
    )
