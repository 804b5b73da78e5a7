"""Requests as token rows, encoded exactly as lm-evaluation-harness's `HFLM` encodes them.

Internals: docs/internals.md "functrain.eval.requests".

Example:
    >>> rows = [pair_row(tok, "Q: 2+2=", " 4", prefix_id=0, block_size=128)]
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Row", "encode_pair", "pair_row", "rolling_rows"]


class Row(NamedTuple):
    """One forward's tokens: inputs `tokens[:-1]`, targets `tokens[1:]`, the last `scored` targets counted."""

    tokens: list[int]
    scored: int


def _ids(tokenizer, text: str) -> list[int]:
    """The tokenizer's ids of `text` as Python ints."""
    return [int(t) for t in tokenizer.encode(text)]


def encode_pair(tokenizer, context: str, continuation: str, prefix_id: int) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as the harness encodes a pair.

    Args:
      tokenizer: `encode(text) -> ids`.
      context: the conditioning text ("" for none).
      continuation: the text whose log-likelihood is asked.
      prefix_id: the token an empty context is.

    Returns:
      The two id lists; the continuation's are those of `context + continuation` after the context's
      (so a merge across the boundary counts to the continuation), trailing spaces of the context moved
      into the continuation first (a context of white space only is then empty).

    Example:
      >>> encode_pair(ByteTokenizer(), "a ", "b", 10)
      ([97], [32, 98])
    """
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if context == "":  # (a context of white space only is empty now too: the harness's HFLM asserts there)
        cont = _ids(tokenizer, continuation)
        if cont and cont[0] == prefix_id:  # the continuation starts with the prefix token: that is the context
            return cont[:1], cont[1:]
        return [prefix_id], cont
    whole = _ids(tokenizer, context + continuation)
    n = len(_ids(tokenizer, context))
    return whole[:n], whole[n:]


def pair_row(tokenizer, context: str, continuation: str, *, prefix_id: int, block_size: int) -> Row:
    """The row scoring `continuation` after `context` (the harness's `loglikelihood` request).

    Args:
      tokenizer: `encode(text) -> ids`.
      context: the conditioning text.
      continuation: the scored text (at least one token).
      prefix_id: the empty context's token.
      block_size: the longest model input.

    Returns:
      A `Row` of at most `block_size + 1` tokens (the context's head dropped if longer).

    Raises:
      ValueError: the continuation has no tokens, or alone exceeds the block (one line).

    Example:
      >>> pair_row(ByteTokenizer(), "ab", "c", prefix_id=10, block_size=8)
      Row(tokens=[97, 98, 99], scored=1)
    """
    ctx, cont = encode_pair(tokenizer, context, continuation, prefix_id)
    if not cont:
        raise ValueError(f"the continuation {continuation!r} encodes to no tokens: nothing to score")
    if len(cont) > block_size:
        raise ValueError(f"the continuation has {len(cont)} tokens, more than the model's block of {block_size}")
    return Row((ctx + cont)[-(block_size + 1) :], len(cont))


def rolling_rows(tokenizer, text: str, *, prefix_id: int, block_size: int) -> list[Row]:
    """The disjoint windows of a rolling log-likelihood: every token of `text` scored once.

    Args:
      tokenizer: `encode(text) -> ids`.
      text: the whole text.
      prefix_id: the token the first window starts from.
      block_size: the longest model input.

    Returns:
      Rows whose scored targets are the text's tokens in order, each window with the most context that
      fits (none for an empty text).

    Example:
      >>> [r.scored for r in rolling_rows(ByteTokenizer(), "abcdefgh", prefix_id=10, block_size=4)]
      [4, 4]
    """
    ids = _ids(tokenizer, text)
    rows, done = [], 0
    while done < len(ids):
        end = min(len(ids), done + block_size)
        before = [prefix_id] + ids[:done] if done == 0 else ids[:done]
        rows.append(Row((before + ids[done:end])[-(block_size + 1) :], end - done))
        done = end
    return rows
