"""The checks of the config keys the Hugging Face family reads (see `functrain.config`): plain Python, no
torch, so `python -m functrain.main` reports a bad value before the heavy modules load.

Example:
    >>> validate.check_all(config, CHECKS)
"""

from __future__ import annotations

from functrain import config as v
from functrain.models.checks import LM_CHECKS

__all__ = ["CHECKS"]


def _tokenizer_ok(value) -> bool:
    """'auto', 'bytes', 'bpe:N' (N >= 257) or a path."""
    if not isinstance(value, str) or not value:
        return False
    if value.startswith("bpe:"):
        return value[4:].isdigit() and int(value[4:]) >= 257
    return True


CHECKS: list = [
    ("model.path", (lambda x: isinstance(x, str) and bool(x),
                    "a transformers model directory (config.json; weights and tokenizer.json optional)")),
    ("model.block_size", v.int_at_least(1)),
    ("model.weights", v.boolean()),
    ("data.tokenizer", (_tokenizer_ok, "'auto', 'bytes', 'bpe:N' (N >= 257) or a tokenizer.json path")),
    ("export_hf", v.boolean()),
    *LM_CHECKS,
]
"""The checks of the keys the Hugging Face family reads."""
