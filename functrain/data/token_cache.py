"""Parquet/jsonl shards tokenized in parallel into a sharded token cache, resumable after a kill.

`tokenize_shards(source, cache_dir, ...)` turns every shard of a source into two flat token files,
`train/<id>.bin` and `val/<id>.bin` (each document followed by the separator: the tokenizer's
end-of-text id, else a newline), plus a marker `done/<id>.json` written last. A document goes to
val when a draw from a generator seeded by its shard's relative path falls below `val_fraction`
(stable: adding a shard never moves another's documents).

* Parallel: shards are dealt to ranks (largest first, to the least loaded rank: every rank computes
  the same deal, none duplicates another's work), and each rank runs its share on a pool of
  `workers` processes (default: its share of the cores). Progress lines give MB/s and an ETA.
* Streaming: a worker holds one bounded group of text and its tokens at a time (`shards.read_texts`).
* Atomic and resumable: a shard's files are written under temporary names and renamed, its marker
  last; a rerun keeps every shard with a valid marker and tokenizes the rest.
* Keyed by content: a marker records the sha256 of its shard's bytes (`digests.file_digests`, which
  hashes a file again only when its size, times or inode changed); a shard whose bytes changed, even
  with its size and mtime kept, is tokenized again, and a copied or touched one is not. `meta.json` (the list
  of shards, the tokenizer, the counts) is written once all are done. A failing shard leaves no file
  of its own and an `errors/<rank>.txt` line that stops the other ranks with the same message.

The cache directory is `<cache_dir>/<name>-<hash of (source, text field, split, tokenizer)>`;
`open_token_cache(dir)` reads it (also given directly as `data.path`).

Example:
    >>> out = tokenize_shards("/data/web/*.parquet", "/tmp/cache", tokenizer=HFTokenizer("tok.json"))
    >>> train, val, info = open_token_cache(out)
    >>> len(train), info["tokens"]["train"]
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import multiprocessing
import sys
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from functrain.data.digests import file_digests
from functrain.data.errors import DataError
from functrain.data.shards import BadLines, read_texts, shard_files, skipped_files
from functrain.data.token_files import DEFAULT_VAL_FRACTION, atomic_write, path_hash64, slug, token_dtype
from functrain.data.tokenizer import SEPARATOR, ByteTokenizer, HFTokenizer, separator_ids
from functrain.data.tokens import ConcatTokens

__all__ = ["FORMAT", "open_token_cache", "tokenize_shards", "tokenizer_id", "train_documents"]

FORMAT = "functrain-token-shards"
VERSION = 2  # 2: shards keyed by the sha256 of their bytes (1: by size and mtime)
_PROGRESS_EVERY_S = 5.0


def tokenizer_id(tokenizer) -> str:
    """'bytes', or 'tokenizers:<sha256 of its tokenizer.json>'."""
    sha = getattr(tokenizer, "sha256", None)
    return f"tokenizers:{sha}" if sha else "bytes"


def _key(rel: str) -> str:
    """A shard's file id: a hash of its relative path (plus a readable stem)."""
    return f"{hashlib.sha256(rel.encode()).hexdigest()[:12]}-{slug(Path(rel).name, '')}"


def _deal(sizes: list[int], world: int) -> list[int]:
    """The rank of each shard: largest first, each to the least loaded rank (ties: lowest rank)."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def _default_workers() -> int:
    """This rank's share of the cores (torchrun's LOCAL_WORLD_SIZE ranks share a machine)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def tokenize_shards(
    source: str,
    cache_dir: str | os.PathLike,
    *,
    tokenizer: Any = None,
    text_field: str = "text",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    max_bad_line_fraction: float = 0.0,
    workers: int = 0,
    rank: int = 0,
    world: int = 1,
    log: Callable[[str], None] = print,
    poll_s: float = 0.2,
    chunk_bytes: int = 4 << 20,
) -> Path:
    """Tokenizes (or finds already tokenized) every shard of `source`; returns the cache directory.

    Args:
      source: parquet/jsonl(.gz) shards: a file, a directory or a glob.
      cache_dir: where the token cache directory goes (created if needed).
      tokenizer: an `HFTokenizer`, or None for bytes.
      text_field: the column / JSON key holding each document's text.
      val_fraction: the share of documents that go to the validation split.
      max_bad_line_fraction: jsonl lines that are not JSON objects a shard may have (skipped, and
        reported); above it the run stops with a `DataError`.
      workers: tokenizing processes on this rank; 0 = this rank's share of the cores.
      rank: this process's rank among `world` processes that share the work (all must call this).
      world: how many processes share it.
      log: where progress lines go (pass a no-op on ranks that should not print).
      poll_s: how often a rank that finished its share looks for the others'.
      chunk_bytes: text a worker holds (and tokenizes) at a time: its memory is a small multiple.

    Returns:
      The cache directory (`open_token_cache` reads it).

    Raises:
      DataError: a bad shard (one line naming it and the fix); nothing half-written is left.

    Example:
      >>> out = tokenize_shards("/data/code", "/tmp/cache", workers=2)
    """
    tokenizer = tokenizer or ByteTokenizer()
    files, root = shard_files(source)
    skipped = skipped_files(source)
    if skipped:  # once, at the start: what the directory holds besides shards is left out
        names = ", ".join(p.relative_to(root).as_posix() for p in skipped[:8])
        more = f" and {len(skipped) - 8} more" if len(skipped) > 8 else ""
        log(f"data.path {source}: skipping {len(skipped)} file(s) that are not shards ({names}{more}); shards end in "
            ".parquet, .jsonl, .jsonl.gz, .json.gz or .ndjson")
    tok = tokenizer_id(tokenizer)
    fingerprint = hashlib.sha256(json.dumps({
        "format": FORMAT, "version": VERSION, "source": str(Path(os.path.expanduser(source)).resolve()),
        "text_field": text_field, "val_fraction": val_fraction, "tokenizer": tok,
    }).encode()).hexdigest()
    out = Path(cache_dir) / f"{slug(root.name, 'shards')}-{fingerprint[:16]}"
    stats = [p.stat() for p in files]  # one stat per shard: its size is the one its digest is known by
    digests = file_digests(files, memo=out / "digests.json", stats=stats)
    shards = [{"rel": p.relative_to(root).as_posix(), "size": st.st_size, "sha256": d,
               "key": _key(p.relative_to(root).as_posix())} for p, st, d in zip(files, stats, digests)]
    info = _read_meta(out)
    if info is not None and info.get("tokenizer") == tok and [_content(s) for s in info["shards"]] == [_content(s) for s in shards]:
        return out  # complete, and the shards hold the same bytes as when they were tokenized
    try:
        for sub in ("train", "val", "done", "errors"):
            (out / sub).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"data cache {cache_dir}: cannot be created ({exc.strerror or exc}); pass a writable "
                        "--workdir or --config.data.cache_dir") from None
    (out / "errors" / f"{rank}.txt").unlink(missing_ok=True)
    owner = _deal([s["size"] for s in shards], world)
    done = [_marker(out, s, tok) is not None for s in shards]
    mine = [(p, s) for p, s, r, d in zip(files, shards, owner, done) if r == rank and not d]
    job = {"out": str(out), "tokenizer": None if isinstance(tokenizer, ByteTokenizer) else str(tokenizer.path),
           "tok": tok, "text_field": text_field, "val_fraction": val_fraction,
           "max_bad": max_bad_line_fraction, "run": uuid.uuid4().hex[:8], "chunk_bytes": chunk_bytes}
    label = source if len(source) <= 60 else "..." + source[-57:]
    if mine:
        how = f"rank {rank} of {world}: " if world > 1 else ""
        log(f"tokenizing {label}: {how}{len(mine)} of {len(shards)} shards, "
            f"{sum(s['size'] for _, s in mine) / 1e6:.1f} MB of files on disk ({sum(done)} done earlier)")
        try:
            _run_share(mine, job, workers or _default_workers(), log, label)
        except DataError as exc:
            (out / "errors" / f"{rank}.txt").write_text(str(exc))
            raise
    _wait_for_others(out, shards, tok, rank, poll_s)
    if rank == 0:
        _finish(out, shards, tok, tokenizer, text_field, val_fraction, source, log)
    else:
        _wait_for(lambda: _read_meta(out) is not None, out, rank, poll_s)
    return out


def _content(shard: dict) -> tuple:
    """What identifies a shard: its relative path and the size and sha256 of its bytes."""
    return shard["rel"], shard["size"], shard.get("sha256")


def _read_meta(out: Path, versions: tuple[int, ...] = (VERSION,)) -> dict | None:
    """The cache's meta.json, or None when absent or not this format (of one of `versions`)."""
    try:
        info = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return info if info.get("format") == FORMAT and info.get("version") in versions else None


def _marker(out: Path, shard: dict, tok: str) -> dict | None:
    """A shard's done marker when it is valid: same bytes (sha256), tokenizer and complete files."""
    try:
        m = json.loads((out / "done" / f"{shard['key']}.json").read_text())
        if _content(m) != _content(shard):
            return None
        if m["tokenizer"] != tok:
            raise DataError(f"{out}: shard {shard['rel']} was tokenized by {m['tokenizer']}, this run uses {tok}; "
                            "delete that cache directory or use another --config.data.cache_dir")
        size = np.dtype(m["dtype"]).itemsize
        for split in ("train", "val"):
            if (out / split / f"{shard['key']}.bin").stat().st_size != size * m["tokens"][split]:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return m


def _run_share(mine, job, workers, log, label) -> None:
    """Tokenizes this rank's shards on a pool of `workers` processes (in this one when 1).

    The pool is `concurrent.futures` on a spawn context: fresh interpreters, so nothing of this process
    (threads, torch's state) is forked into them. Workers report the bytes they read on a queue, for
    the progress lines. On a failure the shards already running finish (their markers are kept),
    the rest are cancelled, and this run's temporaries are removed."""
    total = sum(s["size"] for _, s in mine)
    progress = _Progress(total, len(mine), log, label)
    tasks = [(str(p), s, job) for p, s in mine]
    if workers <= 1 or len(mine) == 1:
        for task in tasks:
            progress.shard_done(tokenize_shard(task, progress.add))
        progress.end()
        return
    spawn = multiprocessing.get_context("spawn")
    read = spawn.SimpleQueue()  # bytes read, from every worker
    pool = ProcessPoolExecutor(min(workers, len(tasks)), mp_context=spawn, initializer=_start_worker, initargs=(read,))
    try:
        pending = {pool.submit(_tokenize_in_worker, task) for task in tasks}
        while pending:
            finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            while not read.empty():
                progress.add(read.get())
            for future in finished:
                progress.shard_done(future.result())  # a worker's DataError is raised here, as it was
    except BrokenProcessPool:
        raise DataError("a tokenizing worker process died (out of memory, or killed); see its error above") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _remove_temporaries(Path(job["out"]), job["run"])
    progress.end()


_READ = None  # in a worker process: the queue its bytes read go to


def _start_worker(read) -> None:
    """A worker's set-up: one thread for the tokenizer, and where its progress goes."""
    global _READ
    os.environ.update(TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    _READ = read


def _tokenize_in_worker(task) -> dict:
    """`tokenize_shard` in a worker process, its progress sent to the parent."""
    return tokenize_shard(task, _READ.put)


class _Progress:
    """Bytes and shards done on this rank; a line with MB/s and the ETA every few seconds. The bytes are
    the shards' files on disk (compressed parquet and .gz read so far), not the text they hold."""

    def __init__(self, total, shards, log, label):
        self.total, self.shards, self.log, self.label = total, shards, log, label
        self.done_bytes, self.done_shards, self.bad = 0, 0, []
        self.t0 = self.last = time.perf_counter()

    def add(self, nbytes: int) -> None:
        """Counts `nbytes` of input read; prints a line when one is due."""
        self.done_bytes += nbytes
        now = time.perf_counter()
        if now - self.last >= _PROGRESS_EVERY_S:
            self.last = now
            rate = self.done_bytes / max(now - self.t0, 1e-9)
            eta = (self.total - self.done_bytes) / rate if rate > 0 else math.inf
            self.log(f"tokenizing {self.label}: {self.done_bytes / 1e6:.1f}/{self.total / 1e6:.1f} MB of files on disk "
                     f"({100 * self.done_bytes / max(self.total, 1):.0f}%), {rate / 1e6:.1f} MB/s, ETA {eta:.0f}s, "
                     f"{self.done_shards}/{self.shards} shards")

    def shard_done(self, marker: dict) -> None:
        """Counts a finished shard (and its skipped lines)."""
        self.done_shards += 1
        if marker["bad_lines"] or marker.get("replaced"):
            self.bad.append(marker)

    def end(self) -> None:
        """The closing line: throughput and skipped lines."""
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.log(f"tokenized {self.label}: {self.total / 1e6:.1f} MB of files on disk in {dt:.1f}s "
                 f"({self.total / 1e6 / dt:.1f} MB/s), {self.shards} shards")
        skipped = [m for m in self.bad if m["bad_lines"]]
        if skipped:
            n = sum(m["bad_lines"] for m in skipped)
            self.log(f"skipped {n} jsonl lines that are not JSON objects (first at {skipped[0]['first_bad_line']}; "
                     "data.max_bad_line_fraction allows them)")
        replaced = [m for m in self.bad if m.get("replaced")]
        if replaced:
            n = sum(m["replaced"] for m in replaced)
            self.log(f"replaced the text that is not valid UTF-8 (bytes that are not UTF-8, lone surrogates) by U+FFFD "
                     f"in {n} records (first at {replaced[0]['first_replaced']}); the records are kept")


_TOKENIZERS: dict = {}


def _tokenizer(path: str | None):
    """The tokenizer of a job (loaded once per process)."""
    if path is None:
        return ByteTokenizer()
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = HFTokenizer(path)
    return _TOKENIZERS[path]


def _encode(tokenizer, texts: list[str], sep: list[int], dtype) -> np.ndarray:
    """The texts' tokens, each document followed by `sep`, as one `dtype` array."""
    if not texts:
        return np.zeros(0, dtype)
    if isinstance(tokenizer, ByteTokenizer):
        joined = SEPARATOR.join(t.encode("utf-8") for t in texts) + SEPARATOR
        return np.frombuffer(joined, np.uint8).astype(dtype)
    ids = tokenizer.encode_batch(texts)
    lengths = np.fromiter((len(x) + len(sep) for x in ids), np.int64, len(ids))
    out = np.empty(int(lengths.sum()), dtype)
    pos = 0
    for x, n in zip(ids, lengths):
        out[pos:pos + n - len(sep)] = x
        out[pos + n - len(sep):pos + n] = sep
        pos += n
    return out


def train_documents(source: str, *, text_field: str = "text",
                    val_fraction: float = DEFAULT_VAL_FRACTION) -> Iterator[str]:
    """The documents of a shard source that `tokenize_shards` puts in the train split, streamed.

    Args:
      source: parquet/jsonl shards (a file, a directory or a glob).
      text_field: the column / JSON key holding the text.
      val_fraction: as `tokenize_shards`'s (the same documents are left out).

    Returns:
      An iterator of strings (e.g. to train a tokenizer on without seeing the validation text).

    Example:
      >>> tok = train_bpe(train_documents("/data/web"), 4096, "bpe.json")
    """
    files, root = shard_files(source)
    for path in files:
        draws = np.random.default_rng(path_hash64(path.relative_to(root).as_posix()))
        for texts, _ in read_texts(path, text_field=text_field, bad_lines=BadLines(1.0)):
            to_val = draws.random(len(texts)) < val_fraction
            yield from (t for t, v in zip(texts, to_val) if not v)


def tokenize_shard(args, report: Callable[[int], None]) -> dict:
    """Writes one shard's train and val token files and then its marker; returns the marker."""
    path, shard, job = args
    path, out = Path(path), Path(job["out"])
    tokenizer = _tokenizer(job["tokenizer"])
    sep = separator_ids(tokenizer)
    dtype = token_dtype(tokenizer.vocab_size)
    key, run = shard["key"], job["run"]
    tmp = {s: out / s / f".{key}.bin.tmp-{run}-{os.getpid()}" for s in ("train", "val")}
    draws = np.random.default_rng(path_hash64(shard["rel"]))
    bad = BadLines(job["max_bad"])
    counts = {"train": 0, "val": 0}
    docs = 0
    first_train = 0  # tokens of the shard's first train document (with its separator)
    t0 = time.perf_counter()
    try:
        with open(tmp["train"], "wb") as ftrain, open(tmp["val"], "wb") as fval:
            for texts, nbytes in read_texts(path, text_field=job["text_field"], bad_lines=bad,
                                            chunk_bytes=job["chunk_bytes"]):
                to_val = draws.random(len(texts)) < job["val_fraction"]
                docs += len(texts)
                if not first_train and not to_val.all():
                    first_train = len(_encode(tokenizer, [texts[int((~to_val).argmax())]], sep, dtype))
                for split, f, pick in (("train", ftrain, ~to_val), ("val", fval, to_val)):
                    ids = _encode(tokenizer, [t for t, keep in zip(texts, pick) if keep], sep, dtype)
                    f.write(ids.tobytes())
                    counts[split] += len(ids)
                report(nbytes)
        if docs == 0:
            raise DataError(f"{path}: an empty shard (no documents with text in field {job['text_field']!r}); "
                            "remove it from data.path")
        for split in ("train", "val"):
            os.replace(tmp[split], out / split / f"{key}.bin")
    except (DataError, OSError):
        raise
    except Exception as exc:  # noqa: BLE001 - any other failure: one line naming the shard, never a traceback
        raise DataError(f"{path}: tokenizing failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                        "fix or remove this shard") from None
    finally:
        for t in tmp.values():
            t.unlink(missing_ok=True)
    marker = dict(shard, tokenizer=job["tok"], dtype=dtype.name, tokens=counts, documents=docs,
                  bad_lines=bad.count, first_bad_line=bad.first, seconds=round(time.perf_counter() - t0, 3),
                  first_train_tokens=first_train, replaced=bad.replaced, first_replaced=bad.first_replaced)
    _atomic_json(out / "done" / f"{key}.json", marker)
    return marker


def _atomic_json(dst: Path, obj) -> None:
    """Writes `obj` as JSON onto dst atomically."""
    atomic_write(dst, lambda f: f.write(json.dumps(obj, indent=1).encode()))


def _remove_temporaries(out: Path, run: str | None = None) -> None:
    """Deletes temporaries left under out (only run `run`'s when given)."""
    for split in ("train", "val", "done"):
        for t in (out / split).glob(".*.tmp-*"):
            if run is None or f".tmp-{run}-" in t.name:
                t.unlink(missing_ok=True)


def _wait_for(ready: Callable[[], bool], out: Path, rank: int, poll_s: float) -> None:
    """Polls `ready` until true; another rank's error line stops this one with the same message."""
    while not ready():
        for err in (out / "errors").glob("*.txt"):
            if err.stem != str(rank):
                try:
                    raise DataError(err.read_text().strip() + f" (reported by rank {err.stem})")
                except FileNotFoundError:
                    continue
        time.sleep(poll_s)


def _wait_for_others(out: Path, shards: list[dict], tok: str, rank: int, poll_s: float) -> None:
    """Waits until every shard has a valid marker (the other ranks' shares)."""
    left = list(shards)

    def ready():
        left[:] = [s for s in left if _marker(out, s, tok) is None]
        return not left

    _wait_for(ready, out, rank, poll_s)


def _finish(out, shards, tok, tokenizer, text_field, val_fraction, source, log) -> None:
    """Rank 0, once every shard is done: temporaries removed, meta.json written (last)."""
    _remove_temporaries(out)
    markers = [_marker(out, s, tok) for s in shards]
    if not sum(m["tokens"]["val"] for m in markers):
        _guarantee_val(out, markers, source, val_fraction, log)
    info = {
        "format": FORMAT, "version": VERSION, "source": source, "text_field": text_field,
        "val_fraction": val_fraction, "tokenizer": tok, "tokenizer_name": tokenizer.name,
        "tokenizer_file": str(getattr(tokenizer, "path", "")) or None,
        "vocab_size": tokenizer.vocab_size, "dtype": markers[0]["dtype"],
        "tokens": {s: sum(m["tokens"][s] for m in markers) for s in ("train", "val")},
        "documents": sum(m["documents"] for m in markers),
        "bad_lines": sum(m["bad_lines"] for m in markers),
        "shards": [{k: m[k] for k in ("rel", "size", "sha256", "key", "tokens")} for m in markers],
        "python": sys.version.split()[0], "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _atomic_json(out / "meta.json", info)


def _guarantee_val(out: Path, markers: list[dict], source: str, val_fraction: float, log) -> None:
    """No document drew into val: the first train document of the first shard that has one moves there
    (its train file loses that prefix), as a text source always keeps a validation file."""
    if sum(m["documents"] for m in markers) < 2:
        raise DataError(f"data.path {source}: {sum(m['documents'] for m in markers)} document: a validation split "
                        "needs a second one; add text")
    for m in markers:
        n = m.get("first_train_tokens", 0)
        if n and m["tokens"]["train"] > n:
            break
    else:
        raise DataError(f"data.path {source}: no document went to the validation split; raise "
                        f"--config.data.val_fraction (now {val_fraction:g})")
    dtype = np.dtype(m["dtype"])
    train = np.fromfile(out / "train" / f"{m['key']}.bin", dtype=dtype)
    atomic_write(out / "val" / f"{m['key']}.bin", lambda f: f.write(train[:n].tobytes()))
    atomic_write(out / "train" / f"{m['key']}.bin", lambda f: f.write(train[n:].tobytes()))
    m["tokens"] = {"train": int(len(train) - n), "val": int(n)}
    m["first_train_tokens"] = 0  # (moved: a rerun's _finish finds a validation split)
    _atomic_json(out / "done" / f"{m['key']}.json", m)
    log(f"no document of {source} drew into the validation split (val_fraction={val_fraction:g}): the first document "
        f"of {m['rel']} ({n} tokens) is the validation split")


def open_token_cache(out: str | os.PathLike) -> tuple[ConcatTokens, ConcatTokens, dict]:
    """The train and val tokens of a complete token cache directory, as memory-mapped shards.

    Args:
      out: a directory `tokenize_shards` returned.

    Returns:
      (train, val, info): two `ConcatTokens` (shards in relative-path order) and its meta.json.

    Raises:
      DataError: not a complete cache (one line).

    Example:
      >>> train, val, info = open_token_cache(out)
    """
    out = Path(out)
    info = _read_meta(out, versions=(1, VERSION))  # a version 1 cache reads alike (its shards carry no digest)
    if info is None:
        raise DataError(f"{out}: not a complete token cache (no valid meta.json); point data.path at the shards "
                        "to tokenize them again")
    dtype = np.dtype(info["dtype"])
    splits = []
    for split in ("train", "val"):
        arrays = []
        for s in info["shards"]:
            path = out / split / f"{s['key']}.bin"
            n = s["tokens"][split]
            if not path.exists() or path.stat().st_size != n * dtype.itemsize:
                raise DataError(f"{path}: missing or truncated ({n} tokens expected); delete {out} and run again to "
                                "tokenize the shards anew")
            if n:
                arrays.append(np.memmap(path, dtype=dtype, mode="r"))
        splits.append(ConcatTokens(arrays, dtype))
    return splits[0], splits[1], info
