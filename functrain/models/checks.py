"""Config checks every decoder-LM family shares (`loss_chunk_size`, `remat`, `sample.*`): plain
Python, no torch, so `python -m functrain.main` reports a bad value before the heavy modules load.
A family's own `checks.py` adds its `model.*` keys.

Example:
    >>> CHECKS = [("model.n_layer", validate.int_at_least(1)), *LM_CHECKS]
"""

from __future__ import annotations

from functrain import validate as v
from functrain.remat_policy import parse_policy

__all__ = ["LM_CHECKS", "REMAT_CHECK"]


def _is_remat(value) -> bool:
    """Whether `value` is a remat policy or "auto"."""
    if value == "auto":
        return True
    try:
        parse_policy(value)
        return True
    except ValueError:
        return False


REMAT_CHECK = ("remat", (_is_remat, "'auto', 'none', 'full' or a positive int N (recompute every N-th block)"))
"""The check of a family's `remat` key."""

LM_CHECKS: list = [
    ("loss_chunk_size", v.int_at_least(0)),
    REMAT_CHECK,
    ("sample.max_new_tokens", v.int_at_least(0)),
    ("sample.temperature", v.number_at_least(0.0)),
    ("sample.top_k", v.int_at_least(0)),
]
"""The keys the shared LM loss and sampler read."""
