"""The checks of the config keys the Hugging Face family reads (see `functrain.config_checks`): plain Python, no
torch, so `python -m functrain.main` reports a bad value before the heavy modules load.

Example:
    >>> config_checks.check_all(config, CHECKS)
"""

from __future__ import annotations

from functrain import config_checks
from functrain.models.checks import LM_CHECKS, TOKENIZER_CHECK

__all__ = ["CHECKS", "SIZES"]


CHECKS: list = [
    (
        "model.path",
        (
            lambda x: isinstance(x, str) and bool(x),
            "a transformers model directory (config.json; weights and tokenizer.json optional), or 'tiny:<model type>'",
        ),
    ),
    ("model.block_size", config_checks.int_at_least(1)),
    ("model.weights", config_checks.boolean()),
    TOKENIZER_CHECK,
    *LM_CHECKS,
]
"""The checks of the keys the Hugging Face family reads."""

SIZES: dict[str, str] = {"block_size": "model.block_size"}  # layers and heads: the directory's config.json
"""The keys of the model sizes the trainer's mesh checks read (docs/internals.md "functrain.task")."""
