"""The checks of the config keys the GPT family reads (see `functrain.config_checks`): plain Python, no
torch, so `python -m functrain.main` reports a bad value before the heavy modules load.
`task.build` checks them again (a Task built from Python gets the same errors).

Example:
    >>> config_checks.check_all(config, CHECKS)
"""

from __future__ import annotations

from functrain import config_checks
from functrain.models.checks import LM_CHECKS

__all__ = ["CHECKS", "SIZES"]

CHECKS: list = [
    ("model.vocab_size", config_checks.int_at_least(0)),
    ("model.block_size", config_checks.int_at_least(1)),
    ("model.n_layer", config_checks.int_at_least(1)),
    ("model.n_head", config_checks.int_at_least(1)),
    ("model.n_embd", config_checks.int_at_least(1)),
    ("model.dropout", config_checks.number_in(0.0, 1.0)),
    ("model.bias", config_checks.boolean()),
    *LM_CHECKS,
    config_checks.relation(
        ("model.n_embd", "model.n_head"),
        lambda embd, heads: embd % heads == 0,
        "n_head must divide n_embd (each head gets n_embd / n_head channels); change either",
    ),
]
"""The checks of the keys the GPT family reads."""

SIZES: dict[str, str] = {"n_layer": "model.n_layer", "block_size": "model.block_size", "n_head": "model.n_head"}
"""The keys of the model sizes the trainer's mesh checks read (docs/internals.md "functrain.task")."""
