"""A multiple-choice task made from a run's own validation documents: which line comes next?

Internals: docs/internals.md "functrain.eval.next_lines".

Example:
    >>> docs = data.validation_documents("stdlib")
    >>> examples = build(docs, ByteTokenizer(), block_size=128, prefix_id=10)
    >>> examples[0].choices[examples[0].label]     # the true next line
    '        return self._value\n'
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from functrain.eval.choice import Example

__all__ = ["DEFAULT_EXAMPLES", "build"]

DEFAULT_EXAMPLES = 500
_MIN_LINE, _MAX_LINE = 12, 60  # a candidate line's characters (its newline included)
_MIN_CONTEXT_LINES = 4  # lines before a candidate (its context is never a file's first lines)


def _lines(doc: str) -> list[str]:
    """The document's lines, newlines kept."""
    return doc.splitlines(keepends=True)


def _candidate(line: str) -> bool:
    """A line worth asking about: ends in a newline, of a middling length, not blank."""
    return line.endswith("\n") and _MIN_LINE <= len(line) <= _MAX_LINE and bool(line.strip())


def _fit(context: str, choices: Sequence[str], tokenizer, block_size: int) -> str:
    """The longest tail of `context` (cut at a line start) that, with the longest choice, fits the block."""
    longest = max(len(tokenizer.encode(c)) for c in choices)
    lines: list[str] = []
    chars = 0
    for line in reversed(_lines(context)):  # a generous bound first (16 characters a token): fewer encodes
        if chars + len(line) > 16 * (block_size + 1):
            break
        lines.insert(0, line)
        chars += len(line)
    while lines and len(tokenizer.encode("".join(lines))) + longest > block_size + 1:
        lines.pop(0)
    if lines:
        return "".join(lines)
    tail = context[-16 * (block_size + 1) :]  # a single line longer than the block: its head is cut
    while tail and len(tokenizer.encode(tail)) + longest > block_size + 1:
        tail = tail[1:]
    return tail


def build(
    documents: Sequence[str], tokenizer, *, block_size: int, n: int = DEFAULT_EXAMPLES, seed: int = 0, choices: int = 4
) -> list[Example]:
    """`n` next-line questions from `documents` (see the module docstring).

    Args:
      documents: the validation documents' texts, in a fixed order (at least 2 with candidate lines).
      tokenizer: the model's tokenizer (contexts are cut to fit `block_size`).
      block_size: the model's longest input.
      n: how many examples.
      seed: the draw's seed.
      choices: choices per example (the true line and `choices - 1` others).

    Returns:
      The examples (`where` is "next_lines:<i>"), each fitting the block.

    Raises:
      ValueError: fewer than 2 documents with lines to ask about (one line).

    Example:
      >>> build(["a = 1\\nb = 2\\n..."] * 2, ByteTokenizer(), block_size=64, n=1)[0].label
      2
    """
    docs = [
        (_lines(d), [i for i, line in enumerate(_lines(d)) if i >= _MIN_CONTEXT_LINES and _candidate(line)])
        for d in documents
    ]
    usable = [k for k, (_, cands) in enumerate(docs) if cands]
    if len(usable) < 2:
        raise ValueError(
            f"next_lines needs 2 or more validation documents with lines of {_MIN_LINE}-{_MAX_LINE} "
            f"characters after their first {_MIN_CONTEXT_LINES}; the data has {len(usable)}"
        )
    draw = random.Random(seed)
    out: list[Example] = []
    while len(out) < n:
        k = draw.choice(usable)
        lines, cands = docs[k]
        at = draw.choice(cands)
        true = lines[at]
        options = [true]
        while len(options) < choices:
            other = draw.choice([u for u in usable if u != k] if len(usable) > 1 else usable)
            line = docs[other][0][draw.choice(docs[other][1])]
            if line.strip() not in {o.strip() for o in options}:
                options.append(line)
        draw.shuffle(options)
        context = _fit("".join(lines[:at]), options, tokenizer, block_size)
        if context.strip():  # (white space alone is no context: drawn again)
            out.append(Example(context, tuple(options), options.index(true), f"next_lines:{len(out)}"))
    return out
