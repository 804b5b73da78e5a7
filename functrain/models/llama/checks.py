"""The checks of the config keys the Llama family reads (see `functrain.validate`): plain Python, no
torch, so `python -m functrain.main` reports a bad value before the heavy modules load.
`task.build` checks them again (a Task built from Python gets the same errors).

Example:
    >>> validate.check_all(config, CHECKS)
"""

from __future__ import annotations

from functrain import validate as v
from functrain.models.checks import LM_CHECKS

__all__ = ["CHECKS"]


def _init_from_ok(value) -> bool:
    """'' or 'hf:<dir>'."""
    return isinstance(value, str) and (value == "" or (value.startswith("hf:") and len(value) > 3))


def _tokenizer_ok(value) -> bool:
    """'auto', 'bytes', 'bpe:N' (N >= 257) or a path."""
    if not isinstance(value, str) or not value:
        return False
    if value.startswith("bpe:"):
        return value[4:].isdigit() and int(value[4:]) >= 257
    return True


CHECKS: list = [
    ("model.vocab_size", v.int_at_least(0)),
    ("model.block_size", v.int_at_least(1)),
    ("model.n_layer", v.int_at_least(1)),
    ("model.n_head", v.int_at_least(1)),
    ("model.n_kv_head", v.int_at_least(1)),
    ("model.n_embd", v.int_at_least(1)),
    ("model.intermediate_size", v.int_at_least(0)),
    ("model.head_dim", v.int_at_least(0)),
    ("model.rope_theta", v.number_at_least(1.0)),
    ("model.norm_eps", v.number_at_least(0.0)),
    ("model.tie_embeddings", v.boolean()),
    ("model.dropout", v.number_in(0.0, 1.0)),
    ("data.tokenizer", (_tokenizer_ok, "'auto', 'bytes', 'bpe:N' (N >= 257) or a tokenizer.json path")),
    ("init_from", (_init_from_ok, "'' or 'hf:<Hugging Face model directory>'")),
    ("export_hf", v.boolean()),
    *LM_CHECKS,
]
"""The checks of the keys the Llama family reads."""
