"""What data a run trains on, as a checkpoint records it, and what changed between two records.

Internals: docs/internals.md "functrain.data.record".

Example:
    >>> changes(old, new)
    ["source 'data': 1 file removed (b.jsonl); 1 changed (a.jsonl: 1,204 -> 1,310 bytes)"]
"""

from __future__ import annotations

from typing import Any

from functrain.data.errors import DataError

__all__ = ["changes", "check_resume", "source_record"]

_NAMED = 3  # files named per kind of change; the rest are counted


def source_record(kind: str, tokenizer: str, files: list[list]) -> dict[str, Any]:
    """One source's entry of a record.

    Args:
      kind: "text", "bin" or "shards".
      tokenizer: what tokenizes it ("bytes", "tokenizers:<sha256>", or a name).
      files: [relative path, size, sha256 (or None when unknown)] per file, in the source's order.

    Returns:
      A JSON-serializable dict.

    Example:
      >>> source_record("shards", "bytes", [["a.jsonl", 1204, "5f1d..."]])
    """
    return {"kind": kind, "tokenizer": tokenizer, "files": [list(f) for f in files]}


def _names(rels: list[str]) -> str:
    """Up to _NAMED names, then a count."""
    shown = ", ".join(rels[:_NAMED])
    return shown + (f" and {len(rels) - _NAMED} more" if len(rels) > _NAMED else "")


def _source_changes(old: dict, new: dict) -> list[str]:
    """The differences of one source, in words."""
    out = []
    if old.get("tokenizer") != new.get("tokenizer"):
        out.append(f"tokenizer {old.get('tokenizer')} -> {new.get('tokenizer')}")
    before = {f[0]: f for f in old.get("files", [])}
    after = {f[0]: f for f in new.get("files", [])}
    removed = [r for r in before if r not in after]
    added = [r for r in after if r not in before]
    changed = [
        r
        for r in before
        if r in after
        and before[r][1:] != after[r][1:]
        and not (before[r][1] == after[r][1] and None in (before[r][2], after[r][2]))
    ]
    if removed:
        out.append(f"{len(removed)} file{'s' * (len(removed) > 1)} removed ({_names(removed)})")
    if added:
        out.append(f"{len(added)} file{'s' * (len(added) > 1)} added ({_names(added)})")
    if changed:

        def what(r):
            a, b = before[r][1], after[r][1]
            return f"{r}: {a:,} -> {b:,} bytes" if a != b else f"{r}: same size, other bytes"

        out.append(
            f"{len(changed)} changed ({', '.join(what(r) for r in changed[:_NAMED])}"
            f"{f' and {len(changed) - _NAMED} more' if len(changed) > _NAMED else ''})"
        )
    if not (removed or added or changed) and list(before) != list(after):
        out.append("the files are in another order")
    return out


def changes(old: dict | None, new: dict | None) -> list[str]:
    """What differs between two data records, one phrase per source (empty: the same data).

    A record that is None or lacks sources (a checkpoint written before records existed) compares
    equal to anything.

    Args:
      old: the checkpoint's record.
      new: the record of the data found now.

    Returns:
      Phrases such as "source 'data': 1 file removed (b.jsonl)".

    Example:
      >>> changes({"sources": {"data": a}}, {"sources": {"data": a}})
      []
    """
    if not old or not new or "sources" not in old or "sources" not in new:
        return []
    out = []
    for name in old["sources"]:
        if name not in new["sources"]:
            out.append(f"source {name!r} is gone")
    for name, rec in new["sources"].items():
        if name not in old["sources"]:
            out.append(f"source {name!r} is new")
            continue
        diff = _source_changes(old["sources"][name], rec)
        if diff:
            out.append(f"source {name!r}: " + "; ".join(diff))
    return out


def _batch_change(old: dict | None, new: dict | None, step: int) -> list[str]:
    """The change of the global batch, in words (the data position is row = step x batch)."""
    before, after = (old or {}).get("batch_size"), (new or {}).get("batch_size")
    if before is None or after is None or before == after:
        return []
    return [
        f"batch_size {before} -> {after} rows (the global batch; accum_steps and the data-parallel ranks only split "
        f"it), so step {step + 1} would start at row {step * after:,} of the data where the run reached row "
        f"{step * before:,}"
    ]


def check_resume(old: dict | None, new: dict | None, step: int, allow: bool) -> str | None:
    """Compares a checkpoint's data record with the data found at a resume: the sources, and the global batch
    (each step's rows follow from step x batch_size: another batch lands elsewhere in the data).

    Args:
      old: the record saved with checkpoint `step` (None: it has none).
      new: the record of the data the run has now.
      step: the checkpoint's step.
      allow: go on when the data or the batch changed (`--config.data.allow_changed`).

    Returns:
      None when the data is the same; else, with `allow`, the line to log.

    Raises:
      DataError: the data or the batch changed and `allow` is false (one line naming what changed and the flag).

    Example:
      >>> check_resume(ckpt_record, data.record(), 10, allow=False)
    """
    data, batch = changes(old, new), _batch_change(old, new, step)
    if not data + batch:
        return None
    what = "; ".join(data + batch)
    back = " and ".join(
        (["put the data back"] if data else []) + ([f"set batch_size={(old or {})['batch_size']}"] if batch else [])
    )
    if not allow:
        raise DataError(
            f"the data changed since checkpoint step {step} ({what}), so every batch after step {step} "
            f"would differ from the run's; {back}, or pass --config.data.allow_changed=True to "
            "go on with the data as it is now"
        )
    return f"the data changed since checkpoint step {step} ({what}); going on with it (data.allow_changed)"
