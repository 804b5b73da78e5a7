"""The checks of the config keys the Hugging Face family reads (see `functrain.config_checks`): plain Python, no
torch, so `python -m functrain.main` reports a bad value before the heavy modules load.

Example:
    >>> validate.check_all(config, CHECKS)
"""

from __future__ import annotations

from functrain import config_checks as v
from functrain.models.checks import LM_CHECKS, TOKENIZER_CHECK

__all__ = ["CHECKS"]


CHECKS: list = [
    (
        "model.path",
        (
            lambda x: isinstance(x, str) and bool(x),
            "a transformers model directory (config.json; weights and tokenizer.json optional), or 'tiny:<model type>'",
        ),
    ),
    ("model.block_size", v.int_at_least(1)),
    ("model.weights", v.boolean()),
    TOKENIZER_CHECK,
    ("export_hf", v.boolean()),
    *LM_CHECKS,
]
"""The checks of the keys the Hugging Face family reads."""
