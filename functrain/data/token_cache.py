"""Every text source tokenized in parallel into one sharded token cache, resumable after a kill.

Internals: docs/internals.md "functrain.data.token_cache".

Example:
    >>> out = tokenize("/data/web/*.parquet", "/tmp/cache", tokenizer=HFTokenizer("tok.json"))
    >>> train, val, info = open_token_cache(out)
    >>> len(train), info["tokens"]["train"]
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np

from functrain.data.documents import read_unit, shard_units, source_content, text_units
from functrain.data.errors import DataError
from functrain.data.placement import Placement, TextOptions
from functrain.data.shards import BadLines
from functrain.data.token_files import atomic_write, token_dtype
from functrain.data.tokenizer import ByteTokenizer, HFTokenizer, separator_ids
from functrain.data.tokens import ConcatTokens

__all__ = ["FORMAT", "FORMATS", "POOL_BYTES", "open_token_cache", "tokenize", "tokenizer_id"]

FORMAT = "functrain-tokens"
VERSION = 3  # 3: one format for every source, split per document
FORMATS = ((FORMAT, VERSION),)
"""The (format, version) pairs of meta.json that `open_token_cache` reads."""
_PROGRESS_EVERY_S = 5.0
POOL_BYTES = 64 << 20
"""Below this many bytes of files a rank tokenizes in its own process by default (the stdlib's 31 MB take
0.25 s there): no pool to start, and a script that loads data at import time needs no `__main__` guard."""


def tokenizer_id(tokenizer) -> str:
    """'bytes', or 'tokenizers:<sha256 of its tokenizer.json>[:<digest of its special tokens>]'."""
    return getattr(tokenizer, "identity", "bytes")


def _deal(sizes: list[int], world: int) -> list[int]:
    """The rank of each unit: largest first, each to the least loaded rank (ties: lowest rank)."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def _default_workers(nbytes: int) -> int:
    """This rank's share of the cores (torchrun's LOCAL_WORLD_SIZE ranks share a machine); 1 (this process) for
    less than `POOL_BYTES` of files, where starting a pool costs more than it saves."""
    if nbytes < POOL_BYTES:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def tokenize(
    source: str,
    place: Placement,
    options: TextOptions = TextOptions(),
    *,
    tokenizer: Any = None,
    poll_s: float = 0.2,
    chunk_bytes: int = 4 << 20,
) -> Path:
    """Tokenizes (or finds already tokenized) every unit of `source`; returns the cache directory.

    Args:
      source: "stdlib", a text file, a directory of text files, or parquet/jsonl(.gz) shards (a
        file, a directory or a glob).
      place: where the token cache directory goes (`cache_dir`, created if needed), this process's
        `rank` among the `world` processes that share the work (all must call this), and `log`.
      options: the text field, validation fraction, bad-line allowance and workers (`TextOptions`).
      tokenizer: an `HFTokenizer`, or None for bytes.
      poll_s: how often a rank that finished its share looks for the others'.
      chunk_bytes: text a worker holds (and tokenizes) at a time: its memory is a small multiple.

    Returns:
      The cache directory (`open_token_cache` reads it).

    Raises:
      DataError: a missing or empty source, a bad shard (one line naming it and the fix); nothing
        half-written is left.

    Example:
      >>> out = tokenize("/data/code", Placement("/tmp/cache"), TextOptions(workers=2))
    """
    cache_dir, rank, world, log = place.cache_dir, place.rank, place.world, place.log
    text_field, val_fraction = options.text_field, options.val_fraction
    tokenizer = tokenizer or ByteTokenizer()
    tok = tokenizer_id(tokenizer)
    kind, root, name, content = source_content(source, cache_dir, log)
    fingerprint = hashlib.sha256(
        json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "val_fraction": val_fraction,
                "tokenizer": tok,
                "source": source if source == "stdlib" else str(Path(os.path.expanduser(source)).resolve()),
                **({"text_field": text_field} if kind == "shards" else {}),
                **({"python": sys.version} if source == "stdlib" else {}),
            }
        ).encode()
    ).hexdigest()
    out = Path(cache_dir) / f"{name}-{fingerprint[:16]}"
    units = shard_units(content) if kind == "shards" else text_units(content, val_fraction)
    info = _read_meta(out)
    if info is not None and info.get("tokenizer") == tok and info["content"] == content:
        return out  # complete, and the files hold the same bytes as when they were tokenized
    try:
        for sub in ("train", "val", "done", "errors"):
            (out / sub).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(
            f"data cache {cache_dir}: cannot be created ({exc.strerror or exc}); pass a writable "
            "--workdir or --config.data.cache_dir"
        ) from None
    (out / "errors" / f"{rank}.txt").unlink(missing_ok=True)
    owner = _deal([u["size"] for u in units], world)
    done = [_marker(out, u, tok) is not None for u in units]
    mine = [u for u, r, d in zip(units, owner, done) if r == rank and not d]
    job = {
        "out": str(out),
        "root": str(root),
        "tokenizer": None if isinstance(tokenizer, ByteTokenizer) else [str(tokenizer.path), tokenizer.eos_token],
        "tok": tok,
        "text_field": text_field,
        "val_fraction": val_fraction,
        "max_bad": options.max_bad_line_fraction,
        "run": uuid.uuid4().hex[:8],
        "chunk_bytes": chunk_bytes,
        "units": "shards" if kind == "shards" else "packs of files",
        "kind": kind,
        "source": source,
    }
    label = source if len(source) <= 60 else "..." + source[-57:]
    if mine:
        how = f"rank {rank} of {world}: " if world > 1 else ""
        log(
            f"tokenizing {label}: {how}{len(mine)} of {len(units)} {job['units']}, "
            f"{sum(u['size'] for u in mine) / 1e6:.1f} MB of files on disk ({sum(done)} done earlier)"
        )
        try:
            _run_share(mine, job, options.workers or _default_workers(sum(u["size"] for u in mine)), log, label)
        except DataError as exc:
            (out / "errors" / f"{rank}.txt").write_text(str(exc))
            raise
    _wait_for_others(out, units, tok, rank, poll_s)
    if rank == 0:
        _finish(job, units, content, tokenizer, log)
    else:
        _wait_for(lambda: _read_meta(out) is not None, out, rank, poll_s)
    return out


def _content(unit: dict) -> tuple:
    """What identifies a unit: its name, its files' sizes and sha256, and its split (val files, or the cut)."""
    return unit["rel"], [list(f) for f in unit["files"]], unit.get("cut"), unit.get("val")


def _read_meta(out: Path, formats: tuple = ((FORMAT, VERSION),)) -> dict | None:
    """The cache's meta.json, or None when absent or not one of `formats` ((format, version) pairs)."""
    try:
        info = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return info if (info.get("format"), info.get("version")) in formats else None


def _marker(out: Path, unit: dict, tok: str) -> dict | None:
    """A unit's done marker when it is valid: same bytes (sha256), tokenizer and complete files."""
    try:
        m = json.loads((out / "done" / f"{unit['key']}.json").read_text())
        if _content(m) != _content(unit):
            return None
        if m["tokenizer"] != tok:
            raise DataError(
                f"{out}: {unit['rel']} was tokenized by {m['tokenizer']}, this run uses {tok}; "
                "delete that cache directory or use another --config.data.cache_dir"
            )
        size = np.dtype(m["dtype"]).itemsize
        for split in ("train", "val"):
            if (out / split / f"{unit['key']}.bin").stat().st_size != size * m["tokens"][split]:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return m


def _run_share(mine, job, workers, log, label) -> None:
    """Tokenizes this rank's units on a pool of `workers` processes (in this one when 1).

    The pool is `concurrent.futures` on a spawn context: fresh interpreters, so nothing of this process
    (threads, torch's state) is forked into them. Workers report the bytes they read on a queue, for
    the progress lines. On a failure the shards already running finish (their markers are kept),
    the rest are cancelled, and this run's temporaries are removed."""
    progress = _Progress(sum(u["size"] for u in mine), len(mine), log, label, job["units"])
    tasks = [(u, job) for u in mine]
    if workers <= 1 or len(mine) == 1:
        for task in tasks:
            progress.unit_done(tokenize_unit(task, progress.add))
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
                progress.unit_done(future.result())  # a worker's DataError is raised here, as it was
    except BrokenProcessPool:
        raise DataError(
            "a tokenizing worker process died (out of memory, killed, or the script tokenizes at import "
            "time: start it under `if __name__ == '__main__':` or set data.tokenize_workers=1); see its "
            "error above"
        ) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _remove_temporaries(Path(job["out"]), job["run"])
    progress.end()


_READ: Any = None  # in a worker process: the queue its bytes read go to


def _start_worker(read) -> None:
    """A worker's set-up: one thread for the tokenizer (read when it first encodes), and where its progress goes."""
    global _READ
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _READ = read


def _tokenize_in_worker(task) -> dict:
    """`tokenize_unit` in a worker process, its progress sent to the parent."""
    return tokenize_unit(task, _READ.put)


class _Progress:
    """Bytes and units done on this rank; a line with MB/s and the ETA every few seconds. The bytes are
    the files on disk (compressed parquet and .gz read so far), not the text they hold."""

    def __init__(self, total, units, log, label, noun):
        self.total, self.units, self.log, self.label, self.noun = total, units, log, label, noun
        self.done_bytes, self.done_units = 0, 0
        self.t0 = self.last = time.perf_counter()

    def add(self, nbytes: int) -> None:
        """Counts `nbytes` of input read; prints a line when one is due."""
        self.done_bytes += nbytes
        now = time.perf_counter()
        if now - self.last >= _PROGRESS_EVERY_S:
            self.last = now
            rate = self.done_bytes / max(now - self.t0, 1e-9)
            eta = (self.total - self.done_bytes) / rate if rate > 0 else math.inf
            self.log(
                f"tokenizing {self.label}: {self.done_bytes / 1e6:.1f}/{self.total / 1e6:.1f} MB of files on disk "
                f"({100 * self.done_bytes / max(self.total, 1):.0f}%), {rate / 1e6:.1f} MB/s, ETA {eta:.0f}s, "
                f"{self.done_units}/{self.units} {self.noun}"
            )

    def unit_done(self, marker: dict) -> None:
        """Counts a finished unit."""
        self.done_units += 1

    def end(self) -> None:
        """The closing line: throughput."""
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.log(
            f"tokenized {self.label}: {self.total / 1e6:.1f} MB of files on disk in {dt:.1f}s "
            f"({self.total / 1e6 / dt:.1f} MB/s), {self.units} {self.noun}"
        )


def _report_bad(markers: list[dict], log) -> None:
    """The lines skipped and the records whose text was replaced, over every unit (whichever rank made it)."""
    skipped = [m for m in markers if m["bad_lines"]]
    if skipped:
        n = sum(m["bad_lines"] for m in skipped)
        log(
            f"skipped {n} jsonl lines that are not JSON objects (first at {skipped[0]['first_bad_line']}; "
            "data.max_bad_line_fraction allows them)"
        )
    replaced = [m for m in markers if m.get("replaced")]
    if replaced:
        n = sum(m["replaced"] for m in replaced)
        log(
            f"replaced the text that is not valid UTF-8 (bytes that are not UTF-8, lone surrogates) by U+FFFD "
            f"in {n} records (first at {replaced[0]['first_replaced']}); the records are kept"
        )


_TOKENIZERS: dict = {}


def _tokenizer(spec: list | None):
    """The tokenizer of a job: None (bytes) or [tokenizer.json, eos_token] (loaded once per process)."""
    if spec is None:
        return ByteTokenizer()
    key = tuple(spec)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = HFTokenizer(*spec)
    return _TOKENIZERS[key]


def _encode(tokenizer, pieces: list, ends: np.ndarray, sep: list[int], dtype) -> tuple[np.ndarray, np.ndarray]:
    """The pieces' tokens as one `dtype` array, `sep` after each piece that ends its document; and each one's length."""
    if not pieces:
        return np.zeros(0, dtype), np.zeros(0, np.int64)
    if isinstance(tokenizer, ByteTokenizer):
        raw = [p if isinstance(p, bytes) else p.encode("utf-8") for p in pieces]
        joined = b"".join(p + bytes(sep) if end else p for p, end in zip(raw, ends))
        return np.frombuffer(joined, np.uint8).astype(dtype), np.array([len(p) for p in raw]) + len(sep) * ends
    ids = tokenizer.encode_batch(pieces)
    lengths = np.fromiter((len(x) for x in ids), np.int64, len(ids)) + len(sep) * ends
    out = np.empty(int(lengths.sum()), dtype)
    pos = 0
    for x, n, end in zip(ids, lengths, ends):
        out[pos : pos + len(x)] = x
        out[pos + len(x) : pos + n] = sep if end else []
        pos += n
    return out, lengths


def tokenize_unit(args, report: Callable[[int], None]) -> dict:
    """Writes one unit's train and val token files and then its marker; returns the marker."""
    unit, job = args
    out, root = Path(job["out"]), Path(job["root"])
    tokenizer = _tokenizer(job["tokenizer"])
    sep = separator_ids(tokenizer)
    dtype = token_dtype(tokenizer.vocab_size)
    key, run = unit["key"], job["run"]
    tmp = {s: out / s / f".{key}.bin.tmp-{run}-{os.getpid()}" for s in ("train", "val")}
    bad = BadLines(job["max_bad"])
    counts = {"train": 0, "val": 0}
    first = {"train": [0, False], "val": [0, False]}  # tokens of each split's first document, and whether it ended
    docs = 0
    t0 = time.perf_counter()
    where = root / unit["rel"]
    try:
        with open(tmp["train"], "wb") as ftrain, open(tmp["val"], "wb") as fval:
            options = TextOptions(job["text_field"], job["val_fraction"])
            raw = isinstance(tokenizer, ByteTokenizer)
            for pieces, to_val, ends, nbytes in read_unit(
                unit, root, options, bad_lines=bad, chunk_bytes=job["chunk_bytes"], raw=raw
            ):
                docs += int(ends.sum())
                for split, f, pick in (("train", ftrain, ~to_val), ("val", fval, to_val)):
                    chosen = np.flatnonzero(pick)
                    ids, lengths = _encode(tokenizer, [pieces[i] for i in chosen], ends[chosen], sep, dtype)
                    for n, end in zip(lengths, ends[chosen]):
                        if first[split][1]:
                            break
                        first[split] = [first[split][0] + int(n), bool(end)]
                    f.write(ids.tobytes())
                    counts[split] += len(ids)
                report(nbytes)
        if docs == 0:
            raise DataError(
                f"{where}: an empty shard (no documents with text in field {job['text_field']!r}); "
                "remove it from data.path"
            )
        for split in ("train", "val"):
            os.replace(tmp[split], out / split / f"{key}.bin")
    except (DataError, OSError):
        raise
    except Exception as exc:  # noqa: BLE001 - any other failure: one line naming the unit, never a traceback
        raise DataError(
            f"{where}: tokenizing failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "fix or remove this file"
        ) from None
    finally:
        for t in tmp.values():
            t.unlink(missing_ok=True)
    marker = dict(
        unit,
        tokenizer=job["tok"],
        dtype=dtype.name,
        tokens=counts,
        documents=docs,
        first_tokens={s: first[s][0] for s in first},
        bad_lines=bad.count,
        first_bad_line=bad.first,
        seconds=round(time.perf_counter() - t0, 3),
        replaced=bad.replaced,
        first_replaced=bad.first_replaced,
    )
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


def _wait_for_others(out: Path, units: list[dict], tok: str, rank: int, poll_s: float) -> None:
    """Waits until every unit has a valid marker (the other ranks' shares)."""
    left = list(units)

    def ready():
        left[:] = [u for u in left if _marker(out, u, tok) is None]
        return not left

    _wait_for(ready, out, rank, poll_s)


def _finish(job: dict, units: list[dict], content: list, tokenizer, log) -> None:
    """Rank 0, once every unit is done: both splits non-empty, temporaries removed, meta.json written (last)."""
    out, tok, kind, source = Path(job["out"]), job["tok"], job["kind"], job["source"]
    _remove_temporaries(out)
    found = [_marker(out, u, tok) for u in units]
    markers = [m for m in found if m is not None]
    if len(markers) != len(units):  # every unit was done when this started
        raise DataError(
            f"{out}: a unit's done marker went missing while the cache was finished; delete {out} and run again"
        )
    _report_bad(markers, log)
    for empty, full in (("val", "train"), ("train", "val")):
        if not sum(m["tokens"][empty] for m in markers):
            _move_first_document(job, markers, full, empty, log)
    info = {
        "format": FORMAT,
        "version": VERSION,
        "kind": kind,
        "source": source,
        "text_field": job["text_field"],
        "val_fraction": job["val_fraction"],
        "tokenizer": tok,
        "tokenizer_name": tokenizer.name,
        "tokenizer_file": str(getattr(tokenizer, "path", "")) or None,
        "vocab_size": tokenizer.vocab_size,
        "dtype": markers[0]["dtype"],
        "separator": separator_ids(tokenizer),
        "tokens": {s: sum(m["tokens"][s] for m in markers) for s in ("train", "val")},
        "documents": sum(m["documents"] for m in markers),
        "bad_lines": sum(m["bad_lines"] for m in markers),
        "units": [{k: m[k] for k in ("rel", "key", "tokens")} for m in markers],
        "content": content,
        "python": sys.version.split()[0],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if kind == "text":
        info["val_files"] = [rel for m in markers for rel in m.get("val", ())]
    _atomic_json(out / "meta.json", info)


def _move_first_document(job: dict, markers: list[dict], src: str, dst: str, log) -> None:
    """No shard's document drew into `dst`: the first `src` document of the first unit that can spare it moves
    there (text files were given both splits when packed)."""
    out, source = Path(job["out"]), job["source"]
    total = sum(m["tokens"][src] for m in markers)
    if sum(m["documents"] for m in markers) < 2:
        if dst == "train":
            return  # one short document: the block_size check says what is missing
        raise DataError(
            f"data.path {source}: {sum(m['documents'] for m in markers)} document: a validation split "
            "needs a second one; add text"
        )
    for m in markers:
        n = m["first_tokens"][src]
        if n and total > n:
            break
    else:
        raise DataError(
            f"data.path {source}: no document went to the {dst} split; change "
            f"--config.data.val_fraction (now {job['val_fraction']:g})"
        )
    dtype = np.dtype(m["dtype"])
    tokens = np.fromfile(out / src / f"{m['key']}.bin", dtype=dtype)
    atomic_write(out / dst / f"{m['key']}.bin", lambda f: f.write(tokens[:n].tobytes()))
    atomic_write(out / src / f"{m['key']}.bin", lambda f: f.write(tokens[n:].tobytes()))
    m["tokens"] = {src: int(len(tokens) - n), dst: int(n)}
    m["first_tokens"] = {src: 0, dst: n}  # (moved: a rerun's _finish finds both splits)
    _atomic_json(out / "done" / f"{m['key']}.json", m)
    log(
        f"no document of {source} drew into the {dst} split (val_fraction={job['val_fraction']:g}): the first {src} "
        f"document of {m['rel']} ({n} tokens) moved there"
    )


def open_token_cache(out: str | os.PathLike) -> tuple[ConcatTokens, ConcatTokens, dict]:
    """The train and val tokens of a complete token cache directory, as memory-mapped units.

    Args:
      out: a directory `tokenize` returned.

    Returns:
      (train, val, info): two `ConcatTokens` (the units in order, less the separator after the last
      document) and its meta.json.

    Raises:
      DataError: not a complete cache (one line).

    Example:
      >>> train, val, info = open_token_cache(out)
    """
    out = Path(out)
    info = _read_meta(out, formats=FORMATS)
    if info is None:
        raise DataError(
            f"{out}: not a complete token cache (no valid meta.json); point data.path at the source "
            "to tokenize it again"
        )
    dtype = np.dtype(info["dtype"])
    splits = []
    for split in ("train", "val"):
        arrays: list = []
        for u in info["units"]:
            path = out / split / f"{u['key']}.bin"
            n = u["tokens"][split]
            if not path.exists() or path.stat().st_size != n * dtype.itemsize:
                raise DataError(
                    f"{path}: missing or truncated ({n} tokens expected); delete {out} and run again to "
                    "tokenize the source anew"
                )
            if n:
                arrays.append(np.memmap(path, dtype=dtype, mode="r"))
        if arrays and info["separator"]:
            arrays[-1] = arrays[-1][: len(arrays[-1]) - len(info["separator"])]
        splits.append(ConcatTokens(arrays, dtype))
    return splits[0], splits[1], info
