"""The checks of the config keys the GPT family reads (see `functrain.config_checks`): plain Python, no
torch, so `python -m functrain.main` reports a bad value before the heavy modules load.
`task.build` checks them again (a Task built from Python gets the same errors).

Example:
    >>> validate.check_all(config, CHECKS)
"""

from __future__ import annotations

from functrain import config_checks as v
from functrain.models.checks import LM_CHECKS

__all__ = ["CHECKS"]

CHECKS: list = [
    ("model.vocab_size", v.int_at_least(0)),
    ("model.block_size", v.int_at_least(1)),
    ("model.n_layer", v.int_at_least(1)),
    ("model.n_head", v.int_at_least(1)),
    ("model.n_embd", v.int_at_least(1)),
    ("model.dropout", v.number_in(0.0, 1.0)),
    ("model.bias", v.boolean()),
    *LM_CHECKS,
    v.relation(
        ("model.n_embd", "model.n_head"),
        lambda embd, heads: embd % heads == 0,
        "n_head must divide n_embd (each head gets n_embd / n_head channels); change either",
    ),
]
"""The checks of the keys the GPT family reads."""
