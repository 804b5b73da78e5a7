"""Supervised examples tokenized once into a cache: tokens, a per-token target mask, a train/val split.

Internals: docs/internals.md "functrain.data.examples".

Example:
    >>> spec = ExampleSpec(fmt="auto", train_on="auto", fields={}, template=chat_template_of(model_dir),
    ...                    block_size=512, too_long="drop", val_fraction=0.05)
    >>> train, val, info = load_examples("data/sft.jsonl", "runs/sft/data", tokenizer, spec)
    >>> x, y = train.pair(0)              # inputs and shifted targets (-1 where not learned)
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from functrain.data.documents import is_val, source_content
from functrain.data.errors import DataError
from functrain.data.pairs import fit_pair, render_pair
from functrain.data.supervised import IGNORE, ChatTemplate, detect_format, read_records, render, resolve_train_on
from functrain.data.token_cache import tokenizer_id
from functrain.data.token_files import atomic_write, slug

__all__ = ["TOO_LONG", "ExampleSet", "ExampleSpec", "load_examples"]

TOO_LONG = ("drop", "truncate")
"""What `data.too_long` does with an example longer than `block_size + 1` tokens (a preference pair: truncate
keeps each sequence's start, TRL's `truncation_mode="keep_start"`)."""

_FORMAT, _VERSION = "functrain-examples", 2
_COUNTS = ("dropped", "truncated", "no_target", "same")  # what is counted of the records left out or kept as they are


@dataclasses.dataclass(frozen=True)
class ExampleSpec:
    """How a source's records become examples (every field enters the cache key).

    Attributes:
      fmt: a `supervised.FORMATS` name, or "auto" (from the first record's fields).
      train_on: a `supervised.TRAIN_ON` choice, or "auto".
      fields: {format field: the records' field}.
      template: the chat template (the messages format).
      block_size: the longest example is `block_size + 1` tokens (inputs and targets of `block_size`).
      too_long: "drop" or "truncate" a longer one.
      val_fraction: the share of examples that go to validation.
      max_bad_line_fraction: jsonl lines per file that may be skipped as not JSON objects.
    """

    fmt: str
    train_on: str
    fields: tuple
    template: ChatTemplate | None
    block_size: int
    too_long: str
    val_fraction: float
    max_bad_line_fraction: float = 0.0

    def key(self, content: list, tokenizer: str) -> str:
        """The cache key of this spec over `content` ([rel, size, sha256] per file) with `tokenizer`."""
        what = {
            "content": content,
            "tokenizer": tokenizer,
            "fmt": self.fmt,
            "train_on": self.train_on,
            "fields": sorted(self.fields),
            "block_size": self.block_size,
            "too_long": self.too_long,
            "val_fraction": self.val_fraction,
            "template": None
            if self.template is None
            else [self.template.source, sorted(self.template.special.items())],
            "version": _VERSION,
        }
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass
class ExampleSet:
    """Examples as three arrays: every token, every target flag, and where each example starts.

    Attributes:
      tokens: int64 (N,) every example's tokens, concatenated.
      targets: bool (N,) whether each token is learned.
      offsets: int64 (n + 1,): example i is [offsets[i], offsets[i + 1]).
    """

    tokens: np.ndarray
    targets: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Each example's (input, target) pairs: its tokens minus one."""
        return np.diff(self.offsets) - 1

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Example i as (inputs, targets): tokens[:-1] and tokens[1:], IGNORE where not learned (the one shift)."""
        s, e = int(self.offsets[i]), int(self.offsets[i + 1])
        tok, learn = self.tokens[s:e], self.targets[s:e]
        return tok[:-1], np.where(learn[1:], tok[1:], IGNORE)

    def target_count(self) -> int:
        """Learned targets over every example, counted after the shift (a first token is never one)."""
        starts = self.offsets[:-1][self.offsets[:-1] < len(self.targets)]
        return int(self.targets.sum() - self.targets[starts].sum())


def _concat(parts: list[tuple[np.ndarray, np.ndarray]]) -> ExampleSet:
    """An `ExampleSet` of (tokens, targets) examples."""
    lengths = np.array([len(t) for t, _ in parts], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    if not parts:
        return ExampleSet(np.zeros(0, np.int64), np.zeros(0, bool), offsets)
    return ExampleSet(np.concatenate([t for t, _ in parts]), np.concatenate([m for _, m in parts]), offsets)


def _save(path: Path, ex: ExampleSet, val: np.ndarray, counts: dict) -> None:
    """One file's examples (and which go to validation) in one npz, atomically."""

    def write(f):
        buf = io.BytesIO()
        np.savez(
            buf,
            tokens=ex.tokens,
            targets=ex.targets,
            offsets=ex.offsets,
            val=val,
            counts=np.array([counts[k] for k in _COUNTS], np.int64),
        )
        f.write(buf.getvalue())

    atomic_write(path, write)


def _load(path: Path) -> tuple[ExampleSet, np.ndarray, dict]:
    """What `_save` wrote."""
    with np.load(path) as z:
        return ExampleSet(z["tokens"], z["targets"], z["offsets"]), z["val"], dict(zip(_COUNTS, z["counts"].tolist()))


def _fit(tokens: np.ndarray, targets: np.ndarray, spec: ExampleSpec, counts: dict):
    """The example cut to block_size + 1 tokens, or None (too long and dropped, or nothing left to learn)."""
    if len(tokens) > spec.block_size + 1:
        if spec.too_long == "drop":
            counts["dropped"] += 1
            return None
        tokens, targets = tokens[: spec.block_size + 1], targets[: spec.block_size + 1]
        counts["truncated"] += 1
    if not targets[1:].any():
        counts["no_target"] += 1
        return None
    return tokens, targets


def _render_file(records, spec: ExampleSpec, tokenizer):
    """(examples, val flags, counts) of one file's records (`spec`'s format and train_on resolved)."""
    parts, val = [], []
    counts = dict.fromkeys(_COUNTS, 0)
    for _, key, record in records:
        try:
            kept = _render_record(record, spec, tokenizer, counts)
        except DataError as exc:  # (TemplateError too) named with the record: "<file>:<index>: ..."
            raise type(exc)(f"{key}: {exc}") from None
        parts += kept
        val += [is_val(key, spec.val_fraction)] * len(kept)
    return _concat(parts), np.array(val, bool), counts


def _render_record(record, spec: ExampleSpec, tokenizer, counts: dict) -> list:
    """A record's examples: one, a preference pair's two (chosen, rejected), or none (left out, counted)."""
    fields = dict(spec.fields)
    if spec.fmt == "preference":
        pair = render_pair(record, tokenizer, template=spec.template, fields=fields)
        counts["same"] += int(np.array_equal(pair.chosen, pair.rejected))
        longest = spec.block_size + 1
        fitted = fit_pair(pair, longest, "keep_start" if spec.too_long == "truncate" else "drop")
        too_long = len(pair.prompt) + max(len(pair.chosen), len(pair.rejected)) > longest
        counts["dropped" if fitted is None else "truncated"] += int(too_long)
        return fitted or []
    ex = render(record, spec.fmt, tokenizer, train_on=spec.train_on, fields=fields, template=spec.template)
    kept = _fit(ex.tokens, ex.targets, spec, counts)
    return [] if kept is None else [kept]


def _first_format(source: str, spec: ExampleSpec) -> str:
    """`spec.fmt`, or the format of the source's first record."""
    if spec.fmt != "auto":
        return spec.fmt
    for _, _, record in read_records(source, spec.max_bad_line_fraction):
        return detect_format(record, dict(spec.fields))
    raise DataError(f"data.path {source!r} holds no record; add examples (one JSON object per line)")


def _build(source: str, out: Path, content: list, spec: ExampleSpec, tokenizer, log) -> None:
    """Renders every file not done yet into out/<file>.npz, then writes out/meta.json (`spec`'s format and
    train_on resolved)."""
    out.mkdir(parents=True, exist_ok=True)
    by_file: dict[str, list] = {}
    for rel, key, record in read_records(source, spec.max_bad_line_fraction):
        by_file.setdefault(rel, []).append((rel, key, record))
    t0 = time.perf_counter()
    for n, (rel, _, _) in enumerate(content):
        path = out / f"{slug(rel)}-{hashlib.sha256(rel.encode()).hexdigest()[:8]}.npz"
        if not path.exists():
            _save(path, *_render_file(by_file.get(rel, []), spec, tokenizer))
        if time.perf_counter() - t0 > 5:
            log(f"examples: {n + 1}/{len(content)} files rendered")
    meta = {
        "format": _FORMAT,
        "version": _VERSION,
        "source": source,
        "fmt": spec.fmt,
        "train_on": spec.train_on,
        "files": [[rel, f"{slug(rel)}-{hashlib.sha256(rel.encode()).hexdigest()[:8]}.npz"] for rel, _, _ in content],
    }
    atomic_write(out / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))


def _wait(out: Path, poll_s: float = 0.2) -> None:
    """Waits until rank 0 has written out/meta.json (or its error line)."""
    while not (out / "meta.json").exists():
        err = out / "error.txt"
        if err.exists():
            raise DataError(err.read_text().strip() + " (reported by rank 0)")
        time.sleep(poll_s)


def load_examples(
    source: str,
    cache_dir: str | os.PathLike,
    tokenizer,
    spec: ExampleSpec,
    *,
    rank: int = 0,
    log: Callable[[str], None] = print,
) -> tuple[ExampleSet, ExampleSet, dict[str, Any]]:
    """A source's train and validation examples, rendered and tokenized once (cached by content).

    Args:
      source: jsonl/parquet records: a file, a directory of them or a glob.
      cache_dir: where the rendered examples are kept.
      tokenizer: the functrain tokenizer to encode with.
      spec: how records become examples (`ExampleSpec`).
      rank: this process's rank (0 renders, the others wait and read).
      log: where the counts of left-out examples go.

    Returns:
      `(train, val, info)`; info holds "fmt", "train_on", "content" ([rel, size, sha256] per file, the
      data record), "examples" (train, val) and the counts "dropped", "truncated", "no_target".

    Raises:
      DataError: a record in no format, a bad field or template, or no example with a target (one line).

    Example:
      >>> train, val, info = load_examples("data/sft.jsonl", "runs/sft/data", tok, spec)
    """
    if spec.too_long not in TOO_LONG:
        raise DataError(f"data.too_long={spec.too_long!r}: use one of {', '.join(TOO_LONG)}")
    kind, _, name, content = source_content(source, cache_dir, log=log)
    if kind != "shards":
        raise DataError(
            f"data.path {source!r}: supervised examples are jsonl/parquet records (one JSON object per "
            "line); for plain text use --config.data.format=text"
        )
    fmt = _first_format(source, spec)
    train_on = resolve_train_on(spec.train_on, fmt)
    out = Path(cache_dir) / f"examples-{name}-{spec.key(content, tokenizer_id(tokenizer))}"
    if not (out / "meta.json").exists():
        if rank == 0:
            try:
                _build(source, out, content, dataclasses.replace(spec, fmt=fmt, train_on=train_on), tokenizer, log)
            except DataError as exc:
                message = str(exc).encode()
                out.mkdir(parents=True, exist_ok=True)
                atomic_write(out / "error.txt", lambda f: f.write(message))
                raise
        else:
            _wait(out)
    meta = json.loads((out / "meta.json").read_text())
    parts = [_load(out / f) for _, f in meta["files"]]
    group = 2 if fmt == "preference" else 1  # the examples of a record (a pair: chosen, rejected)
    train, val = _split(parts, group)
    counts = {k: sum(p[2][k] for p in parts) for k in _COUNTS}
    examples = (len(train) // group, len(val) // group)
    info = {"fmt": fmt, "train_on": train_on, "content": content, "examples": examples, **counts}
    _check_counts(source, spec, info, log)
    return train, val, info


def _check_counts(source: str, spec: ExampleSpec, info: dict, log: Callable[[str], None]) -> None:
    """Refuses a source with nothing to learn (one line); logs what was left out or cut."""
    what = "pairs" if info["fmt"] == "preference" else "examples"
    if info["examples"][0] == 0:
        raise DataError(
            f"data.path {source!r}: no {what} left to learn from ({info['no_target']} without a target token, "
            f"{info['dropped']} too long for block_size {spec.block_size}); check data.train_on, data.fields, "
            "data.too_long and model.block_size"
        )
    if info["same"] == sum(info["examples"]):
        raise DataError(
            f"data.path {source!r}: every pair's chosen and rejected answers are the same tokens, so there is no "
            "preference to learn; check data.fields (chosen and rejected must name different fields)"
        )
    long = f"longer than block_size + 1 = {spec.block_size + 1} tokens"
    left = [f"{info['dropped']} {what} {long} dropped (data.too_long=drop)"] if info["dropped"] else []
    left += [f"{info['truncated']} {what} {long} truncated (data.too_long=truncate)"] if info["truncated"] else []
    left += [f"{info['no_target']} with no token to learn left out (data.train_on)"] if info["no_target"] else []
    left += [f"{info['same']} pairs with the same chosen and rejected answer kept"] if info["same"] else []
    if left:
        log(f"examples: {'; '.join(left)}")


def _split(parts: list, group: int = 1) -> tuple[ExampleSet, ExampleSet]:
    """(train, val) of every file's examples, in order, a record's `group` examples together; an empty split
    takes the first record of the other."""
    examples = [_example(s, i) for s, _, _ in parts for i in range(len(s))]
    val = np.concatenate([v for _, v, _ in parts]) if parts else np.zeros(0, bool)
    if len(examples) > group and (not val.any() or val.all()):
        val = val.copy()
        val[:group] = not val[0]  # the first record moves across: both splits hold one
    return (_concat([e for e, v in zip(examples, val) if not v]), _concat([e for e, v in zip(examples, val) if v]))


def _example(s: ExampleSet, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Example i of `s` as (tokens, targets)."""
    a, b = int(s.offsets[i]), int(s.offsets[i + 1])
    return s.tokens[a:b], s.targets[a:b]
