"""Config validation: every value checked once, each failure one line naming the key and its range.

A check is data: `(key, predicate, valid range in words)`. The loop's keys are in `LOOP_CHECKS`;
the optimizer's (`functrain.optim.checks`) and each model family's (its `checks.py`) sit beside the
code that reads them and use the same helpers. Check modules import no torch: `python -m
functrain.main` runs every check before the heavy modules load. `check_all` raises one `ConfigError`:

    functrain: error: batch_size=0 is out of range: an integer >= 1 (--config.batch_size)

Example:
    >>> validate.check_all(config, validate.LOOP_CHECKS)
    >>> validate.check_all(config, [("model.n_layer", validate.int_at_least(1))])
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Sequence

__all__ = [
    "ConfigError",
    "Check",
    "check_all",
    "fail",
    "get",
    "int_at_least",
    "number_at_least",
    "number_in",
    "one_of",
    "boolean",
    "LOOP_CHECKS",
]

Check = tuple  # (dotted key, (predicate, valid range in words))


class ConfigError(ValueError):
    """A config value is invalid; the message is one line naming the key, the value and the fix."""


def get(config: Any, key: str) -> Any:
    """The value of a dotted key ("checkpoint.keep") in an ml_collections ConfigDict or a dict."""
    node = config
    for part in key.split("."):
        node = node[part]
    return node


def fail(key: str, value: Any, valid: str) -> ConfigError:
    """The error for `key=value` (one line, naming the flag as typed on the command line)."""
    return ConfigError(f"{key}={value!r} is out of range: {valid} (--config.{key})")


def check_all(config: Any, checks: Sequence[Check]) -> None:
    """Raises `ConfigError` for the first value a check rejects.

    Args:
      config: an ml_collections ConfigDict (or nested dicts).
      checks: `(key, (predicate, valid range in words))` pairs, e.g. from `int_at_least(1)`.

    Example:
      >>> check_all(config, [("steps", int_at_least(1))])
    """
    for key, (ok, valid) in checks:
        value = get(config, key)
        if not ok(value):
            raise fail(key, value, valid)


def _is_int(v) -> bool:
    """An int that is not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """A real number that is not a bool (and not NaN)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and v == v


def int_at_least(n: int) -> tuple[Callable[[Any], bool], str]:
    """An integer >= n."""
    return (lambda v: _is_int(v) and v >= n), f"an integer >= {n}"


def number_at_least(x: float, *, strict: bool = False) -> tuple[Callable[[Any], bool], str]:
    """A number >= x (> x with `strict`)."""
    if strict:
        return (lambda v: _is_number(v) and v > x), f"a number > {x}"
    return (lambda v: _is_number(v) and v >= x), f"a number >= {x}"


def number_in(lo: float, hi: float) -> tuple[Callable[[Any], bool], str]:
    """A number in [lo, hi)."""
    return (lambda v: _is_number(v) and lo <= v < hi), f"a number in [{lo}, {hi})"


def one_of(*choices) -> tuple[Callable[[Any], bool], str]:
    """One of the given values."""
    return (lambda v: v in choices), "one of " + ", ".join(repr(c) for c in choices)


def boolean() -> tuple[Callable[[Any], bool], str]:
    """True or False."""
    return (lambda v: isinstance(v, bool)), "True or False"


LOOP_CHECKS: list[Check] = [
    ("steps", int_at_least(1)),
    ("stop_at", int_at_least(0)),
    ("batch_size", int_at_least(1)),
    ("accum_steps", int_at_least(1)),
    ("log_every", int_at_least(1)),
    ("eval_every", int_at_least(1)),
    ("eval_batches", int_at_least(1)),
    ("compile", boolean()),
    ("compile_unit", one_of("step", "blocks")),
    ("donate", boolean()),
    ("deterministic", boolean()),
    ("precision", one_of("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")),
    ("max_consecutive_skips", int_at_least(0)),
    ("tensorboard", boolean()),
    ("host_memory", one_of("keep", "default")),
    ("gc_every", int_at_least(0)),
    ("dist_timeout_s", int_at_least(0)),
    ("checkpoint.enabled", boolean()),
    ("checkpoint.every", int_at_least(0)),
    ("checkpoint.keep", int_at_least(1)),
    ("checkpoint.keep_every", int_at_least(0)),
    ("checkpoint.async_restore", boolean()),
    ("checkpoint.resume_hyperparams", one_of("config", "checkpoint")),
    ("profile.start", int_at_least(0)),
    ("profile.stop", int_at_least(0)),
]
"""The training loop's own keys (the model's and the optimizer's are checked beside their code)."""
