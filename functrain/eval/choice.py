"""Multiple-choice benchmarks: files in HellaSwag's or a plain format, scored three ways.

Internals: docs/internals.md "functrain.eval.choice".

Example:
    >>> examples = load("data/hellaswag_val.jsonl", limit=1000)
    >>> evaluate(model, params, examples, scorer=Scorer(model, batch_size=32))
    {'acc': 0.2851, 'acc_norm': 0.2942, 'acc_mean_token': 0.2947, 'examples': 1000}
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from functrain.data.errors import DataError
from functrain.eval.model import EvalModel
from functrain.eval.requests import Row, encode_pair
from functrain.eval.scorer import Scorer

__all__ = ["Example", "METRICS", "evaluate", "load", "rows_of"]

METRICS = ("acc", "acc_norm", "acc_mean_token")


class Example(NamedTuple):
    """One question: the context, the choices, the right one's index, where it is from, and what goes
    between the context and a choice (each continuation scored is `delimiter + choice`)."""

    context: str
    choices: tuple[str, ...]
    label: int
    where: str  # "file:line", for error messages
    delimiter: str = ""


def _clean(text: str) -> str:
    """The harness's HellaSwag text cleaning."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(record: dict) -> tuple[str, list[str]]:
    """(context, endings) of an official HellaSwag record."""
    if "ctx_a" in record:
        ctx = record["ctx_a"] + " " + record["ctx_b"].capitalize()
        context = _clean(record.get("activity_label", "") + ": " + ctx) if "activity_label" in record else _clean(ctx)
    else:
        context = _clean(record["ctx"])
    return context, [_clean(e) for e in record["endings"]]


def _example(record, where: str) -> Example:
    """An `Example` from one parsed line, or a DataError naming the line and the fix."""
    fix = (
        'a line is {"context": str, "choices": [str, ...], "label": int} or HellaSwag\'s '
        '{"ctx_a", "ctx_b", "activity_label" (or "ctx"), "endings", "label"}'
    )
    if not isinstance(record, dict):
        raise DataError(f"{where}: not a JSON object; {fix}")
    try:
        if "endings" in record:
            (context, choices), delimiter = _hellaswag(record), " "
        else:
            context, choices, delimiter = record["context"], list(record["choices"]), ""
        label = record["label"]
    except (KeyError, TypeError, AttributeError) as exc:
        raise DataError(f"{where}: missing or malformed field {exc}; {fix}") from None
    if not isinstance(context, str) or not all(isinstance(c, str) for c in choices) or len(choices) < 2:
        raise DataError(f"{where}: the context must be a string and the choices 2 or more strings; {fix}")
    try:
        label = int(label)
    except (TypeError, ValueError):
        raise DataError(
            f"{where}: label {label!r} is not an integer; give the right choice's index (0-based)"
        ) from None
    if not 0 <= label < len(choices) or str(label) != str(record["label"]).strip():
        raise DataError(
            f"{where}: label {record['label']!r} is out of range for {len(choices)} choices; give an "
            f"index from 0 to {len(choices) - 1}"
        )
    return Example(context, tuple(choices), label, where, delimiter)


def load(path: str | Path, *, limit: int = 0) -> list[Example]:
    """The examples of a multiple-choice jsonl file (either format, see the module docstring).

    Args:
      path: the file.
      limit: read at most this many examples (0: all).

    Returns:
      The examples in file order (blank lines skipped).

    Raises:
      DataError: a missing file, a line that is not JSON, a missing field, or a label out of range:
        one line naming the file, the line and the fix.

    Example:
      >>> load("hellaswag_val.jsonl", limit=10)[0].choices[0]
      ' is then shown ...'
    """
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: no such multiple-choice file; give a jsonl file (--config.eval.tasks)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read it as UTF-8 text ({exc}); give a jsonl file") from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); fix or delete the line"
            ) from None
        out.append(_example(record, where))
        if limit and len(out) == limit:
            break
    if not out:
        raise DataError(f"{path}: no examples; give a jsonl file with one question per line")
    return out


def rows_of(examples: Sequence[Example], model: EvalModel, *, truncate: bool = False) -> list[Row]:
    """One row per (example, choice), example-major, each within the model's block.

    Args:
      examples: the questions.
      model: the `EvalModel` (tokenizer, prefix token, block size).
      truncate: cut a too-long context's head (as the harness does) instead of refusing it.

    Returns:
      The rows (`sum(len(e.choices))` of them).

    Raises:
      DataError: an example longer than the block without `truncate`, or a choice that has no tokens or alone
        exceeds the block (one line naming the example and the fix).

    Example:
      >>> rows = rows_of(load("mc.jsonl"), model)
    """
    rows = []
    for ex in examples:
        for choice in ex.choices:
            ctx, cont = encode_pair(model.tokenizer, ex.context, ex.delimiter + choice, model.prefix_id)
            n = len(ctx) + len(cont) - 1  # the model's input length
            if not cont or len(cont) > model.block_size:
                raise DataError(
                    f"{ex.where}: the choice {choice[:40]!r} has {len(cont)} tokens; a choice needs "
                    f"1 to {model.block_size} (the block): shorten or drop the example"
                )
            if n > model.block_size and not truncate:
                raise DataError(
                    f"{ex.where}: the example is {n} tokens, longer than the block of {model.block_size}; "
                    "shorten or drop it, or set --config.eval.truncate=True (its context's head is cut)"
                )
            rows.append(Row((ctx + cont)[-(model.block_size + 1) :], len(cont)))
    return rows


def evaluate(
    model: EvalModel, params, examples: Sequence[Example], *, scorer: Scorer, model_state=None, truncate: bool = False
) -> dict[str, float]:
    """Accuracy of the model on multiple-choice examples, three ways (see the module docstring).

    Args:
      model: the `EvalModel`.
      params: its params (DTensors: every rank calls this; the rows are split over the dp ranks).
      examples: the questions (the same list on every rank).
      scorer: the `Scorer` (batch, buckets, compiled graphs).
      model_state: the model's buffers, or None.
      truncate: see `rows_of`.

    Returns:
      {"acc", "acc_norm", "acc_mean_token": fractions in [0, 1], "examples": N}, equal on every rank.

    Example:
      >>> evaluate(model, params, load("mc.jsonl"), scorer=Scorer(model))["acc"]
      0.5
    """
    rows = rows_of(examples, model, truncate=truncate)
    logprob, _ = scorer.score(params, rows, model_state)
    right = dict.fromkeys(METRICS, 0)
    k = 0
    for ex in examples:
        scores = {
            "acc": [float(logprob[k + j]) for j in range(len(ex.choices))],
            "acc_norm": [float(logprob[k + j]) / max(1, len(c)) for j, c in enumerate(ex.choices)],
            "acc_mean_token": [float(logprob[k + j]) / rows[k + j].scored for j in range(len(ex.choices))],
        }
        for name, s in scores.items():
            right[name] += int(max(range(len(s)), key=lambda j: (s[j], -j)) == ex.label)
        k += len(ex.choices)
    return {**{name: right[name] / len(examples) for name in METRICS}, "examples": len(examples)}
