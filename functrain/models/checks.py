"""Config checks every decoder-LM family shares (`loss_chunk_size`, `remat`, `sample.*`, `data.*`): plain
Python, no torch, so `python -m functrain.main` reports a bad value before the heavy modules load.
A family's own `checks.py` adds its `model.*` keys.

Example:
    >>> CHECKS = [("model.n_layer", config_checks.int_at_least(1)), *LM_CHECKS]
"""

from __future__ import annotations

from functrain import config_checks
from functrain.config_checks import parse_policy

__all__ = ["DATA_CHECKS", "LM_CHECKS", "REMAT_CHECK", "TOKENIZER_CHECK"]


def _is_remat(value) -> bool:
    """Whether `value` is a remat policy or "auto"."""
    if value == "auto":
        return True
    try:
        parse_policy(value)
        return True
    except ValueError:
        return False


def _tokenizer_ok(value) -> bool:
    """'auto', 'bytes', 'bpe:N' (N >= 257) or a path."""
    if not isinstance(value, str) or not value:
        return False
    if value.startswith("bpe:"):
        return value[4:].isdigit() and int(value[4:]) >= 257
    return True


TOKENIZER_CHECK = ("data.tokenizer", (_tokenizer_ok, "'auto', 'bytes', 'bpe:N' (N >= 257) or a tokenizer.json path"))
"""The check of a family's `data.tokenizer` key (`models.lm_data.tokenizer_of` reads it)."""

REMAT_CHECK = ("remat", (_is_remat, "'auto', 'none', 'full' or a positive int N (recompute every N-th block)"))
"""The check of a family's `remat` key."""


def _weights_ok(mixture) -> bool:
    """Every weight a positive finite number."""
    return all(
        not isinstance(w, bool) and isinstance(w, (int, float)) and 0 < w < float("inf")
        for w in dict(mixture or {}).values()
    )


def _same_names(sources, mixture) -> bool:
    """data.sources and data.mixture name the same sources."""
    return set(dict(sources or {})) == set(dict(mixture or {}))


def _fields_ok(fields) -> bool:
    """A mapping of non-empty names to non-empty names."""
    if fields is None:
        return True
    if not hasattr(fields, "items"):
        return False
    return all(isinstance(k, str) and k and isinstance(f, str) and f for k, f in fields.items())


DATA_CHECKS: list = [
    ("data.path", (lambda x: isinstance(x, str) and bool(x), "a non-empty path, glob or 'stdlib'")),
    ("data.text_field", (lambda x: isinstance(x, str) and bool(x), "a non-empty name of a parquet column / jsonl key")),
    ("data.sampling", config_checks.one_of("windows", "epochs")),
    (
        "data.val_fraction",
        (lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < 1, "a number in (0, 1)"),
    ),
    ("data.max_bad_line_fraction", config_checks.number_in(0.0, 1.0)),
    ("data.tokenize_workers", config_checks.int_at_least(0)),
    ("data.mixture", (_weights_ok, "{source name: positive weight}")),
    ("data.format", config_checks.one_of("auto", "text", "prompt_completion", "messages", "alpaca")),
    ("data.train_on", config_checks.one_of("auto", "completion", "assistant", "last", "all")),
    (
        "data.fields",
        (_fields_ok, "{format field: the records' field}, e.g. {'prompt': 'question', 'completion': 'answer'}"),
    ),
    ("data.packing", config_checks.boolean()),
    ("data.too_long", config_checks.one_of("drop", "truncate")),
    (
        "data.chat_template",
        (
            lambda x: isinstance(x, str) and bool(x),
            "a non-empty 'auto', 'default', a .jinja file or a directory with a tokenizer_config.json",
        ),
    ),
    config_checks.relation(
        ("data.sources", "data.mixture"),
        _same_names,
        "give every source in data.sources one weight in data.mixture (and no other)",
    ),
]
"""The keys `functrain.data.lm_data` reads."""

LM_CHECKS: list = [
    ("loss_chunk_size", config_checks.int_at_least(0)),
    REMAT_CHECK,
    ("sample.max_new_tokens", config_checks.int_at_least(0)),
    ("sample.temperature", config_checks.number_at_least(0.0)),
    ("sample.top_k", config_checks.int_at_least(0)),
    *DATA_CHECKS,
]
"""The keys the shared LM loss and sampler read."""
