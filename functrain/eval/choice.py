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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from functrain.data.errors import DataError
from functrain.eval.model import EvalModel
from functrain.eval.requests import Row, encode_pair
from functrain.eval.scorer import Scorer

__all__ = ["Example", "METRICS", "RENDERINGS", "evaluate", "load", "rows_of"]

METRICS = ("acc", "acc_norm", "acc_mean_token")
RENDERINGS = ("nanogpt", "harness")
"""How `acc_mean_token` renders an example (`eval.mean_token`): "nanogpt" as nanoGPT's hellaswag.py (the record's
raw `ctx`, then `" " + ending`, each tokenized alone), "harness" as `acc` and `acc_norm` (lm-eval's cleaned query)."""


class Example(NamedTuple):
    """One question: the context, the choices, the right one's index, where it is from, what goes between the
    context and a choice (each continuation scored is `delimiter + choice`), and the record's own text before any
    cleaning (`raw`: (context, choices), what nanoGPT's rendering scores; None: the context and choices as given)."""

    context: str
    choices: tuple[str, ...]
    label: int
    where: str  # "file:line", for error messages
    delimiter: str = ""
    raw: tuple[str, tuple[str, ...]] | None = None


def _clean(text: str) -> str:
    """The harness's HellaSwag text cleaning."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(record: dict) -> tuple[str, list[str], str]:
    """(context, endings, raw context) of an official HellaSwag record: lm-eval's cleaned query and nanoGPT's `ctx`."""
    if "ctx_a" in record:
        ctx = record["ctx_a"] + " " + record["ctx_b"].capitalize()
        context = _clean(record.get("activity_label", "") + ": " + ctx) if "activity_label" in record else _clean(ctx)
        raw = record.get("ctx", record["ctx_a"] + " " + record["ctx_b"])
    else:
        context, raw = _clean(record["ctx"]), record["ctx"]
    return context, [_clean(e) for e in record["endings"]], raw


def _label(value, n: int, where: str) -> int:
    """The right choice's index from a record's `label`: an int, or a string of one (HellaSwag's "3")."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise DataError(
            f"{where}: label {value!r} is a {type(value).__name__}, not an integer; give the right choice's "
            "0-based index (an integer, or a string of one)"
        )
    if isinstance(value, str) and not value.strip().isdigit():
        raise DataError(f"{where}: label {value!r} is not an integer; give the right choice's index (0-based)")
    label = int(value)
    if not 0 <= label < n:
        raise DataError(f"{where}: label {value!r} is out of range for {n} choices; give an index from 0 to {n - 1}")
    return label


def _example(record, where: str) -> Example:
    """An `Example` from one parsed line, or a DataError naming the line and the fix."""
    fix = (
        'a line is {"context": str, "choices": [str, ...], "label": int} or HellaSwag\'s '
        '{"ctx_a", "ctx_b", "activity_label" (or "ctx"), "endings", "label"}'
    )
    if not isinstance(record, dict):
        raise DataError(f"{where}: not a JSON object; {fix}")
    field = "endings" if "endings" in record else "choices"
    if isinstance(record.get(field), str):
        raise DataError(
            f"{where}: {field} is the string {record[field][:40]!r}, not a list; give the choices as a JSON list of "
            f'strings ("{field}": ["...", "..."])'
        )
    try:
        if field == "endings":
            context, choices, raw = _hellaswag(record)
            delimiter, original = " ", (raw, tuple(record["endings"]))
        else:
            context, choices, delimiter, original = record["context"], list(record["choices"]), "", None
        label = record["label"]
    except (KeyError, TypeError, AttributeError) as exc:
        raise DataError(f"{where}: missing or malformed field {exc}; {fix}") from None
    if not isinstance(context, str) or not all(isinstance(c, str) for c in choices) or len(choices) < 2:
        raise DataError(f"{where}: the context must be a string and the choices 2 or more strings; {fix}")
    return Example(context, tuple(choices), _label(label, len(choices), where), where, delimiter, original)


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


def _apart(tokenizer, context: str, continuation: str, prefix_id: int) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) each tokenized alone, as nanoGPT's hellaswag.py `render_example` does."""
    ctx = [int(t) for t in tokenizer.encode(context)] or [prefix_id]
    return ctx, [int(t) for t in tokenizer.encode(continuation)]


def rows_of(
    examples: Sequence[Example], model: EvalModel, *, truncate: bool = False, rendering: str = "harness"
) -> list[Row]:
    """One row per (example, choice), example-major, each within the model's block.

    Args:
      examples: the questions.
      model: the `EvalModel` (tokenizer, prefix token, block size).
      truncate: cut a too-long context's head (as the harness does) instead of refusing it.
      rendering: "harness" (lm-eval's: the cleaned context, its trailing spaces moved into the continuation,
        the pair tokenized together) or "nanogpt" (the record's raw text, context and continuation tokenized
        alone: `RENDERINGS`).

    Returns:
      The rows (`sum(len(e.choices))` of them).

    Raises:
      DataError: an example longer than the block without `truncate`, or a choice that has no tokens or alone
        exceeds the block (one line naming the example and the fix).

    Example:
      >>> rows = rows_of(load("mc.jsonl"), model)
    """
    if rendering not in RENDERINGS:
        raise ValueError(f"rendering={rendering!r}: use one of {', '.join(RENDERINGS)}")
    encode = encode_pair if rendering == "harness" else _apart
    rows = []
    for ex in examples:
        context, choices = ex.raw if rendering == "nanogpt" and ex.raw is not None else (ex.context, ex.choices)
        for choice in choices:
            ctx, cont = encode(model.tokenizer, context, ex.delimiter + choice, model.prefix_id)
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
    model: EvalModel,
    params,
    examples: Sequence[Example],
    *,
    scorer: Scorer,
    model_state=None,
    truncate: bool = False,
    mean_token: str = "nanogpt",
    interrupt: Callable[[], bool] | None = None,
) -> dict[str, float]:
    """Accuracy of the model on multiple-choice examples, three ways (see the module docstring).

    Args:
      model: the `EvalModel`.
      params: its params (DTensors: every rank calls this; the rows are split over the dp ranks).
      examples: the questions (the same list on every rank).
      scorer: the `Scorer` (batch, buckets, compiled graphs).
      model_state: the model's buffers, or None.
      truncate: see `rows_of`.
      mean_token: how `acc_mean_token` renders the examples (`RENDERINGS`; rows that come out the same as
        the harness's are scored once).
      interrupt: asked between batches (`Scorer.score`); True stops with `Interrupted`.

    Returns:
      {"acc", "acc_norm", "acc_mean_token": fractions in [0, 1], "examples": N}, equal on every rank.

    Example:
      >>> evaluate(model, params, load("mc.jsonl"), scorer=Scorer(model))["acc"]
      0.5
    """
    rows = rows_of(examples, model, truncate=truncate)
    token_rows = rows_of(examples, model, truncate=truncate, rendering=mean_token)
    unique = {(tuple(r.tokens), r.scored): r for r in rows + token_rows}  # (insertion order: the same on every rank)
    scored, _ = scorer.score(params, list(unique.values()), model_state, interrupt)
    logprob = dict(zip(unique, (float(s) for s in scored)))
    right = dict.fromkeys(METRICS, 0)
    k = 0
    for ex in examples:
        lp = [logprob[(tuple(r.tokens), r.scored)] for r in rows[k : k + len(ex.choices)]]
        tokens = token_rows[k : k + len(ex.choices)]
        scores = {
            "acc": lp,
            "acc_norm": [lp[j] / max(1, len(c)) for j, c in enumerate(ex.choices)],
            "acc_mean_token": [logprob[(tuple(r.tokens), r.scored)] / r.scored for r in tokens],
        }
        for name, s in scores.items():
            right[name] += int(max(range(len(s)), key=lambda j: (s[j], -j)) == ex.label)
        k += len(ex.choices)
    return {**{name: right[name] / len(examples) for name in METRICS}, "examples": len(examples)}
