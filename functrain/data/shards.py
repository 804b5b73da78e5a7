"""Document shards: parquet and jsonl files (also `.jsonl.gz`) read one bounded batch at a time.

Internals: docs/internals.md "functrain.data.shards".

Example:
    >>> files = shard_files("/data/web/*.parquet")
    >>> for texts in read_texts(files[0], text_field="text", bad_lines=BadLines(0.001)):
    ...     ...
"""

from __future__ import annotations

import dataclasses
import glob as glob_lib
import gzip
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from functrain.data.errors import DataError

__all__ = ["BadLines", "SHARD_SUFFIXES", "is_shard_source", "read_texts", "shard_files", "shard_kind", "skipped_files"]

SHARD_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".json.gz", ".ndjson")
_CHUNK_BYTES = 4 << 20  # text handed to the tokenizer at a time
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape that can decode to a lone surrogate
_SURROGATE = re.compile("[\ud800-\udfff]")


def shard_kind(path: str | os.PathLike) -> str | None:
    """'parquet', 'jsonl' or None (not a shard) from a file name."""
    name = str(path).lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".jsonl", ".jsonl.gz", ".json.gz", ".ndjson")):
        return "jsonl"
    return None


def is_shard_source(source: str) -> bool:
    """Whether `source` names parquet/jsonl shards: such a file, a glob, or a directory holding them.

    Args:
      source: the data path.

    Returns:
      True for a shard source (read by `functrain.data.token_cache`), False for the other kinds.

    Example:
      >>> is_shard_source("/data/web/*.parquet")
      True
    """
    if glob_lib.has_magic(source):
        return True
    path = Path(source).expanduser()
    if path.is_file():
        return shard_kind(path) is not None
    return (
        path.is_dir()
        and not (path / "train.bin").exists()
        and not (path / "meta.json").exists()
        and any(shard_kind(p) for p in _walk(path))
    )


def _walk(root: Path) -> Iterator[Path]:
    """Non-hidden files under root, recursively."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            if not f.startswith("."):
                yield Path(dirpath) / f


def shard_files(source: str) -> tuple[list[Path], Path]:
    """The shard files of a source, sorted, and the root their names are relative to.

    Args:
      source: a parquet/jsonl file, a directory of them, or a glob.

    Returns:
      (files, root).

    Raises:
      DataError: nothing matches, or a named file is neither parquet nor jsonl (one line).

    Example:
      >>> files, root = shard_files("/data/code")
    """
    if glob_lib.has_magic(source):
        files = sorted(Path(p) for p in glob_lib.glob(os.path.expanduser(source), recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(f"data.path {source!r} matches no file; check the pattern")
        root = Path(os.path.commonpath([str(p.parent) for p in files]))
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(
                f"data.path {source!r} does not exist; point it at parquet/jsonl shards, a directory of them or a glob"
            )
        if path.is_file():
            files, root = [path], path.parent
        else:
            files, root = [p for p in _walk(path) if shard_kind(p)], path
            if not files:
                raise DataError(f"data.path {source!r} holds no .parquet/.jsonl/.jsonl.gz file")
    for p in files:
        if shard_kind(p) is None:
            raise DataError(
                f"{p}: not a parquet or jsonl shard (names end in {', '.join(SHARD_SUFFIXES)}); "
                "remove it from data.path or rename it"
            )
    return files, root


@dataclasses.dataclass
class BadLines:
    """The bad-record policy of shards and the tally of one shard.

    Lines that are not JSON objects are skipped, up to `max_fraction`. Text that is not valid
    Unicode (bytes that are not UTF-8, a JSON `\\ud800` lone surrogate) is kept with each bad part
    replaced by U+FFFD, as `bytes.decode(errors="replace")` does, and counted.

    Args:
      max_fraction: bad lines (not JSON, or not an object) a shard may have, as a fraction of its
        lines; they are skipped. Above it the shard stops with a `DataError`.

    Example:
      >>> policy = BadLines(0.001)
    """

    max_fraction: float = 0.0
    count: int = 0
    lines: int = 0
    first: str | None = None
    replaced: int = 0  # records whose text held bytes that are not UTF-8, or lone surrogates (-> U+FFFD)
    first_replaced: str | None = None

    def bad(self, where: str) -> None:
        """Counts one bad line at `where` (file:line)."""
        self.count += 1
        self.first = self.first or where

    def replace(self, where: str) -> None:
        """Counts one record at `where` (file:line or file:row) whose bad text was replaced by U+FFFD."""
        self.replaced += 1
        self.first_replaced = self.first_replaced or where

    def check(self, path: Path) -> None:
        """Raises the one-line DataError when the shard's bad lines pass the threshold."""
        if self.count and self.count > self.max_fraction * self.lines:
            raise DataError(
                f"{path}: {self.count} of {self.lines} lines are not JSON objects (first at {self.first}); fix or "
                f"remove them, or skip them with --config.data.max_bad_line_fraction "
                f"(now {self.max_fraction:g}, this shard needs {self.count / self.lines:.3g})"
            )


def read_texts(
    path: Path, *, text_field: str, bad_lines: BadLines, chunk_bytes: int = _CHUNK_BYTES
) -> Iterator[tuple[list[str], int]]:
    """The texts of one shard, in order, as (texts, bytes read) groups of about `chunk_bytes`.

    Args:
      path: a parquet or jsonl(.gz) file.
      text_field: the column / JSON key holding the text.
      bad_lines: jsonl bad-line policy; updated with this shard's tally (checked at its end).
      chunk_bytes: text per group.

    Returns:
      An iterator of (list of strings, compressed/on-disk bytes consumed since the last group).

    Raises:
      DataError: a missing text field, a non-string text, an unreadable parquet file, too many bad
        lines (one line, naming the file and the fix).

    Example:
      >>> for texts, nbytes in read_texts(p, text_field="text", bad_lines=BadLines()): ...
    """
    if shard_kind(path) == "parquet":
        yield from _read_parquet(path, text_field, chunk_bytes, bad_lines)
    else:
        yield from _read_jsonl(path, text_field, bad_lines, chunk_bytes)
        bad_lines.check(path)


def _pyarrow_parquet():
    """pyarrow.parquet, or the one-line DataError naming the extra to install."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading parquet shards needs pyarrow; pip install 'functrain[parquet]' (or pyarrow)") from None
    return pq


def _column_texts(column, path: Path, row: int, bad_lines: BadLines) -> list:
    """A text column's Python strings; values whose bytes are not UTF-8 decoded with U+FFFD and counted."""
    try:
        return column.to_pylist()
    except (UnicodeDecodeError, ValueError):  # (pyarrow: ArrowInvalid is a ValueError)
        import pyarrow as pa

        raw = column.cast(pa.large_binary()).to_pylist()
    out: list = []
    for i, value in enumerate(raw):
        if value is None:
            out.append(None)
            continue
        try:
            out.append(value.decode("utf-8"))
        except UnicodeDecodeError:
            bad_lines.replace(f"{path}: row {row + i}")
            out.append(value.decode("utf-8", "replace"))
    return out


def _read_parquet(path: Path, field: str, chunk_bytes: int, bad_lines: BadLines):
    """(texts, bytes) groups of a parquet file's `field` column, a record batch at a time."""
    pq = _pyarrow_parquet()
    try:
        f = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid and OSError subclasses
        raise DataError(
            f"{path}: not a readable parquet file ({str(exc).splitlines()[0]}); remove or replace it"
        ) from None
    names = f.schema_arrow.names
    if field not in names:
        raise DataError(f"{path}: no column {field!r} (columns: {', '.join(names[:12])}); set --config.data.text_field")
    size = path.stat().st_size
    rows = max(1, f.metadata.num_rows)
    batch_rows = 1024
    done_rows = 0
    texts: list[str] = []
    held = 0
    batches = f.iter_batches(batch_size=batch_rows, columns=[field])
    row = 0  # rows of the file read so far
    while True:
        try:
            batch = next(batches, None)
        except Exception as exc:  # noqa: BLE001 - pyarrow's ArrowInvalid / OSError: a corrupt page
            raise DataError(
                f"{path}: rows after {row} cannot be read ({str(exc).splitlines()[0]}): the file is "
                "corrupt; replace it or remove it from data.path"
            ) from None
        if batch is None:
            break
        column = _text_column(batch.column(0), path, field)
        for value in _column_texts(column, path, row, bad_lines):
            if value:
                texts.append(value)
                held += len(value)
        done_rows += len(batch)
        row += len(batch)
        if held >= chunk_bytes:
            yield texts, size * done_rows // rows
            texts, held = [], 0
            size, rows = size - size * done_rows // rows, max(1, rows - done_rows)
            done_rows = 0
    if texts or done_rows:
        yield texts, size


_TEXT_TYPES = ("string", "large_string", "string_view")


def _text_column(column, path: Path, field: str):
    """A parquet column as text: string, large_string or string_view as they are; a dictionary-encoded
    column of strings (pandas' categoricals) decoded; anything else the one-line DataError."""
    if str(column.type) in _TEXT_TYPES:
        return column
    if str(getattr(column.type, "value_type", "")) in _TEXT_TYPES and hasattr(column, "dictionary_decode"):
        return column.dictionary_decode()
    raise DataError(
        f"{path}: column {field!r} holds {column.type}, not text; set --config.data.text_field to a string column"
    )


def skipped_files(source: str) -> list[Path]:
    """The files of a data directory that are not shards (a README, a .json), which `shard_files` leaves out.

    Args:
      source: the data path (only a directory has any).

    Returns:
      Their paths, sorted (empty for a file or a glob).

    Example:
      >>> skipped_files("/data/web")
      [PosixPath('/data/web/README.md')]
    """
    path = Path(source).expanduser()
    if glob_lib.has_magic(source) or not path.is_dir():
        return []
    return [p for p in _walk(path) if shard_kind(p) is None]


def _read_jsonl(path: Path, field: str, bad_lines: BadLines, chunk_bytes: int):  # noqa: C901
    """(texts, bytes) groups of a jsonl file's `field` values, a line at a time."""
    texts: list[str] = []
    held = 0
    with open(path, "rb") as raw:
        f = gzip.GzipFile(fileobj=raw) if str(path).endswith(".gz") else raw
        last = 0
        try:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                bad_lines.lines += 1
                try:
                    record = json.loads(line)
                except UnicodeDecodeError:  # bytes that are not UTF-8: replaced, the record kept
                    bad_lines.replace(f"{path}:{number}")
                    try:
                        record = json.loads(line.decode("utf-8", "replace"))
                    except ValueError:
                        bad_lines.bad(f"{path}:{number}")
                        continue
                except ValueError:
                    bad_lines.bad(f"{path}:{number}")
                    continue
                if not isinstance(record, dict):
                    bad_lines.bad(f"{path}:{number}")
                    continue
                if field not in record:
                    raise DataError(
                        f"{path}:{number}: no field {field!r} (fields: {', '.join(list(record)[:12])}); "
                        "set --config.data.text_field"
                    )
                text = record[field]
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise DataError(
                        f"{path}:{number}: field {field!r} is a {type(text).__name__}, not text; set "
                        "--config.data.text_field to a string field"
                    )
                if _ESCAPED_SURROGATE.search(line) and _SURROGATE.search(text):  # "\ud800" alone: not Unicode
                    bad_lines.replace(f"{path}:{number}")
                    text = _SURROGATE.sub("\ufffd", text)
                if text:
                    texts.append(text)
                    held += len(text)
                if held >= chunk_bytes:
                    pos = raw.tell()
                    yield texts, pos - last
                    texts, held, last = [], 0, pos
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise DataError(f"{path}: cannot be read ({exc}); replace the file") from None
        yield texts, raw.tell() - last
