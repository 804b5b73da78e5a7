"""Preference pairs as data: a `{prompt, chosen, rejected}` record rendered as TRL's `DPOTrainer` renders it, and
a batch of pairs as the (B, 2, T) rows `functrain.preference.make_loss_fn` reads.

Internals: docs/internals.md "functrain.data.pairs".

Example:
    >>> pair = render_pair({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, tokenizer)
    >>> x, y, dropped = pair_rows([pair], max_length=513)        # (1, 2, T) each
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from functrain.data.errors import DataError
from functrain.data.supervised import IGNORE, ChatTemplate

__all__ = ["TRUNCATION", "Pair", "fit_pair", "pair_rows", "render_pair"]

TRUNCATION = ("keep_start", "keep_end")
"""How a sequence longer than `max_length` is cut (TRL's `truncation_mode`): its start kept (a pair whose prompt
alone fills `max_length` is dropped, counted), or its end."""


class Pair(NamedTuple):
    """One preference pair's tokens: the shared prompt, and each completion (int64 arrays)."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray


def _fields(record: Mapping, fields: Mapping[str, str]) -> tuple:
    """(prompt, chosen, rejected) of a record (renamed by `fields`); the prompt extracted as TRL's `extract_prompt`
    where the record has none (the longest common start of the two)."""
    get = {name: fields.get(name, name) for name in ("prompt", "chosen", "rejected")}
    missing = [get[n] for n in ("chosen", "rejected") if get[n] not in record]
    if missing:
        raise DataError(
            f"a preference record needs fields {get['chosen']!r} and {get['rejected']!r} (missing {missing}; fields: "
            f"{', '.join(list(record)[:12])}); map them with --config.data.fields"
        )
    chosen, rejected = record[get["chosen"]], record[get["rejected"]]
    if get["prompt"] in record or chosen == rejected:  # (the same text twice: a pair that teaches nothing, counted)
        return _completions(record.get(get["prompt"], type(chosen)()), chosen, rejected)
    if isinstance(chosen, list) and isinstance(rejected, list) and chosen[:1] != rejected[:1]:
        raise DataError(
            "the chosen and rejected conversations share no first turn, so no prompt can be found: give the prompt "
            "as its own field (prompt: the messages before the answers)"
        )
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):  # (TRL's loop, its ends included)
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # the space before a completion goes with it
                idx -= 1
            break
    return _completions(chosen[:idx], chosen[idx:], rejected[idx:])


def _completions(prompt, chosen, rejected) -> tuple:
    """(prompt, chosen, rejected), refused in one line where a completion is empty."""
    for name, c in (("chosen", chosen), ("rejected", rejected)):
        if not c or (isinstance(c, list) and not any(m.get("content") for m in c if isinstance(m, dict))):
            raise DataError(f"the {name} completion is empty: every pair needs two answers to compare")
    return prompt, chosen, rejected


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The number of leading ids `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _chat_ids(tokenizer, template: ChatTemplate, messages: list, generation: bool = False) -> np.ndarray:
    """A conversation's ids: the template's text tokenized whole (its special tokens in the text)."""
    return np.asarray(tokenizer.encode(template.render(messages, add_generation_prompt=generation)), np.int64)


def _text_ids(tokenizer, text: str) -> np.ndarray:
    """A text's ids with what the tokenizer adds around it (`add_special_tokens=True`: Llama-3's BOS)."""
    special = tokenizer.special
    return np.asarray(list(special.prefix) + tokenizer.encode(text).tolist() + list(special.suffix), np.int64)


def render_pair(
    record: Mapping, tokenizer, *, template: ChatTemplate | None = None, fields: Mapping[str, str] | None = None
) -> Pair:
    """A preference record's tokens, as TRL's `DPOTrainer` makes them.

    Text (`prompt`, `chosen`, `rejected` strings): each completion ends with EOS (added where it does not), the
    prompt and prompt + completion are tokenized whole with the tokenizer's own additions (Llama-3's BOS).
    Conversations (`prompt` a message list, `chosen`/`rejected` the assistant's messages; or no `prompt` and
    `chosen`/`rejected` whole conversations, the prompt their common turns): the chat template renders the prompt
    with the generation prompt, and prompt + completion, each tokenized whole. A completion starts where its
    tokens leave the prompt's (a template or a merge at the boundary can make that earlier than the prompt's end).

    Args:
      record: `{prompt, chosen, rejected}` (renamed by `fields`).
      tokenizer: a functrain tokenizer (`encode`, `special`).
      template: the chat template (conversations).
      fields: {"prompt" | "chosen" | "rejected": the record's field}.

    Returns:
      The `Pair`.

    Raises:
      DataError: a missing field, a conversation without a template, or a completion that is not text or messages.

    Example:
      >>> render_pair({"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant",
      ...              "content": "hello"}], "rejected": [{"role": "assistant", "content": "go"}]}, tok, template=t)
    """
    prompt, chosen, rejected = _fields(record, dict(fields or {}))
    if isinstance(prompt, list):
        if template is None:
            raise DataError("a conversational preference record is rendered by a chat template, and none was given")
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise DataError("a conversational prompt needs chosen and rejected message lists")
        first = _chat_ids(tokenizer, template, prompt, generation=True)
        with_chosen, with_rejected = (_chat_ids(tokenizer, template, prompt + c) for c in (chosen, rejected))
    else:
        if not all(isinstance(v, str) for v in (prompt, chosen, rejected)):
            raise DataError("prompt, chosen and rejected must all be text, or all messages")
        eos = tokenizer.special.eos or ""
        ends = [c if c.endswith(eos) else c + eos for c in (chosen, rejected)]
        first, with_chosen, with_rejected = (_text_ids(tokenizer, prompt + c) for c in ("", *ends))
    n = min(_common(first, with_chosen), _common(first, with_rejected))
    return Pair(first[:n], with_chosen[n:], with_rejected[n:])


def pair_rows(
    pairs: Sequence[Pair], *, max_length: int, truncation: str = "keep_start", pad_id: int = 0, length: int = 0
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A batch of pairs as rows: inputs and next-token targets, the completion's tokens the only targets.

    Args:
      pairs: the pairs (`render_pair`).
      max_length: the longest sequence (prompt + completion) in tokens; a longer one is cut by `truncation`
        (TRL's `max_length`: rows then hold up to `max_length - 1` inputs).
      truncation: "keep_start" (a pair whose prompt alone fills `max_length` is dropped) or "keep_end".
      pad_id: the input id of padding.
      length: the rows' length T (0: the batch's longest sequence minus one).

    Returns:
      `(x, y, dropped)`: x, y (B', 2, T) int64, pair i's chosen sequence at [i, 0] and its rejected one at [i, 1],
      y the next token where it is the completion's and `IGNORE` (-1) elsewhere; `dropped` the pairs left out.

    Raises:
      ValueError: an unknown truncation, or a `length` shorter than a kept sequence.

    Example:
      >>> x, y, dropped = pair_rows(pairs, max_length=1025, truncation="keep_start", pad_id=tok.special.pad_id)
    """
    if truncation not in TRUNCATION:
        raise ValueError(f"truncation {truncation!r} is not one of {', '.join(TRUNCATION)}")
    fitted = [fit_pair(p, max_length, truncation) for p in pairs]
    seqs = [seq for f in fitted if f is not None for seq in f]  # (tokens, learned): chosen, rejected of each pair
    longest = max((len(t) - 1 for t, _ in seqs), default=1)
    t = length or longest
    if t < longest:
        raise ValueError(f"length={t} is shorter than the batch's longest sequence ({longest} inputs)")
    x = np.full((len(seqs), t), pad_id, np.int64)
    y = np.full((len(seqs), t), IGNORE, np.int64)
    for i, (tokens, learned) in enumerate(seqs):
        n = len(tokens) - 1
        x[i, :n] = tokens[:-1]
        y[i, :n] = np.where(learned[1:], tokens[1:], IGNORE)
    shape = (len(seqs) // 2, 2, t)  # (2B', T) -> (B', 2, T): rows 2i and 2i + 1 are pair i's
    return torch.from_numpy(x).view(shape), torch.from_numpy(y).view(shape), len(pairs) - len(seqs) // 2


def fit_pair(pair: Pair, max_length: int, too_long: str) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """A pair's two sequences, chosen then rejected, as (tokens, learned) of at most `max_length` tokens, or None.

    Args:
      pair: the `Pair`.
      max_length: the longest sequence (prompt + completion).
      too_long: for a longer sequence, "drop" the pair, or cut it: "keep_start" (None when the prompt alone fills
        `max_length`: nothing of the completion is left, TRL's `truncation_mode`) or "keep_end".

    Returns:
      `[(tokens, learned), (tokens, learned)]`, or None (the pair is left out).

    Example:
      >>> (chosen, learned), _ = fit_pair(pair, 513, "keep_start")
    """
    longest = len(pair.prompt) + max(len(pair.chosen), len(pair.rejected))
    if longest > max_length and (too_long == "drop" or (too_long == "keep_start" and len(pair.prompt) >= max_length)):
        return None
    cut = slice(None, max_length) if too_long != "keep_end" else slice(-max_length, None)
    flags = np.zeros(len(pair.prompt), bool)
    return [
        (np.concatenate([pair.prompt, c])[cut], np.concatenate([flags, np.ones(len(c), bool)])[cut])
        for c in (pair.chosen, pair.rejected)
    ]
