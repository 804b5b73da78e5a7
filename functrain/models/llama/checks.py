"""The checks of the config keys the Llama family reads (see `functrain.config_checks`): plain Python, no
torch, so `python -m functrain.main` reports a bad value before the heavy modules load.
`task.build` checks them again (a Task built from Python gets the same errors).

Example:
    >>> config_checks.check_all(config, CHECKS)
"""

from __future__ import annotations

from functrain import config_checks
from functrain.models.checks import LM_CHECKS, TOKENIZER_CHECK

__all__ = ["CHECKS", "SIZES"]


def _init_from_ok(value) -> bool:
    """'' or 'hf:<dir>'."""
    return isinstance(value, str) and (value == "" or (value.startswith("hf:") and len(value) > 3))


def _head_dim(embd: int, heads: int, head_dim: int) -> int:
    """The channels per head: head_dim, or n_embd / n_head when 0 (-1 when that is not an integer)."""
    if head_dim:
        return head_dim
    return embd // heads if embd % heads == 0 else -1


CHECKS: list = [
    ("model.vocab_size", config_checks.int_at_least(0)),
    ("model.block_size", config_checks.int_at_least(1)),
    ("model.n_layer", config_checks.int_at_least(1)),
    ("model.n_head", config_checks.int_at_least(1)),
    ("model.n_kv_head", config_checks.int_at_least(1)),
    ("model.n_embd", config_checks.int_at_least(1)),
    ("model.intermediate_size", config_checks.int_at_least(0)),
    ("model.head_dim", config_checks.int_at_least(0)),
    ("model.rope_theta", config_checks.number_at_least(1.0)),
    ("model.norm_eps", config_checks.number_at_least(0.0)),
    ("model.tie_embeddings", config_checks.boolean()),
    ("model.dropout", config_checks.number_in(0.0, 1.0)),
    TOKENIZER_CHECK,
    ("init_from", (_init_from_ok, "'' or 'hf:<Hugging Face model directory>'")),
    *LM_CHECKS,
    # With init_from the model's shape comes from the Hugging Face config.json, not these keys.
    config_checks.relation(
        ("init_from", "model.n_head", "model.n_kv_head"),
        lambda src, heads, kv: bool(src) or heads % kv == 0,
        "n_kv_head must divide n_head (grouped-query attention shares each kv head among n_head / "
        "n_kv_head query heads); change either",
    ),
    config_checks.relation(
        ("init_from", "model.n_embd", "model.n_head", "model.head_dim"),
        lambda src, embd, heads, hd: bool(src) or _head_dim(embd, heads, hd) % 2 == 0,
        "each head needs an even number of channels (rotary embeddings rotate pairs): set head_dim to an "
        "even number, or n_head dividing n_embd into an even n_embd / n_head",
    ),
]
"""The checks of the keys the Llama family reads."""

SIZES: dict[str, str] = {"n_layer": "model.n_layer", "block_size": "model.block_size", "n_head": "model.n_head"}
"""The keys of the model sizes the trainer's mesh checks read (docs/internals.md "functrain.task")."""
