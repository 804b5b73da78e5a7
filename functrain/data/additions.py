"""A verifiable task built in: additions of two numbers below 100 ("17+25="), each record's `answer` the sum, and
two reward functions as a GRPO run names them (`"functrain.data.additions:correct"`): the right integer, and the
answer's form (digits, then a line break: the end of a byte-level completion).

Example:
    >>> records()[0]
    {'prompt': '51+92=', 'answer': '143'}
    >>> correct(["1+2="], ["3"], answer=["3"])
    [1.0]
"""

from __future__ import annotations

import numpy as np

__all__ = ["SOURCE", "correct", "formatted", "records"]

SOURCE = "additions"
"""The name `data.path` gives the task."""


def records(n: int = 5000, seed: int = 1234) -> list[dict[str, str]]:
    """`n` additions {"prompt": "a+b=", "answer": "a + b"}, a and b in [0, 100), the same on every machine.

    Example:
      >>> len(records(10))
      10
    """
    a, b = np.random.default_rng(seed).integers(0, 100, size=(2, n))
    return [{"prompt": f"{x}+{y}=", "answer": str(x + y)} for x, y in zip(a.tolist(), b.tolist())]


def correct(prompts: list, completions: list[str], answer: list[str], **fields) -> list[float]:
    """1.0 where a completion (surrounding blanks stripped) is the record's answer, else 0.0.

    Example:
      >>> correct(["1+2=", "1+2="], ["3", "4"], answer=["3", "3"])
      [1.0, 0.0]
    """
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


def formatted(prompts: list, completions: list[str], **fields) -> list[float]:
    """The answer's form: the share of digits before a completion's first line break, halved where no line break
    ended it (1.0: a number, then the end).

    Example:
      >>> formatted(["1+2=", "1+2="], ["3\n", "3x"])
      [1.0, 0.25]
    """
    out = []
    for c in completions:
        body = c.split("\n", 1)[0]
        share = sum(ch.isdigit() for ch in body) / max(len(body), 1)
        out.append(share if "\n" in c else share / 2)
    return out
