"""Config validation: every value checked once, each failure one line naming the key and its range.

A check is data: `(key, predicate, valid range in words)`; `relation` checks several keys together
(n_head dividing n_embd), `check_batch` the batch against the mesh. The loop's keys are in `LOOP_CHECKS`;
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
    "relation",
    "check_batch",
    "check_pipeline",
    "check_context",
    "check_cuda_graphs",
    "LOOP_CHECKS",
]

Check = tuple  # (dotted key, (predicate, valid range in words)); a relation: ((key, ...), (predicate, rule))


class ConfigError(ValueError):
    """A config value is invalid; the message is one line naming the key, the value and the fix."""


def get(config: Any, key: str) -> Any:
    """The value of a dotted key in an ml_collections ConfigDict or nested dicts.

    Args:
      config: the config.
      key: a dotted key, e.g. "checkpoint.keep".

    Returns:
      The value (KeyError or AttributeError when a part is missing).

    Example:
      >>> get(config, "checkpoint.keep")
      2
    """
    node = config
    for part in key.split("."):
        node = node[part]
    return node


def fail(key: str, value: Any, valid: str) -> ConfigError:
    """The error for `key=value`: one line naming the flag as typed on the command line.

    Args:
      key: the dotted key.
      value: the rejected value.
      valid: the valid range in words.

    Returns:
      A `ConfigError` to raise.

    Example:
      >>> raise fail("steps", 0, "an integer >= 1")
      # functrain: error: steps=0 is out of range: an integer >= 1 (--config.steps)
    """
    return ConfigError(f"{key}={_show(value)} is out of range: {valid} (--config.{key})")


def _show(value: Any) -> str:
    """A value on one line (a ConfigDict as the dict it holds)."""
    return repr(value.to_dict() if hasattr(value, "to_dict") else value)


def check_all(config: Any, checks: Sequence[Check]) -> None:
    """Raises `ConfigError` for the first value a check rejects.

    Args:
      config: an ml_collections ConfigDict (or nested dicts).
      checks: `(key, (predicate, valid range in words))` pairs, e.g. from `int_at_least(1)`.

    Example:
      >>> check_all(config, [("steps", int_at_least(1))])
    """
    for key, (ok, valid) in checks:
        if isinstance(key, tuple):  # a relation between keys (see `relation`)
            values = [get(config, k) for k in key]
            if not ok(*values):
                named = ", ".join(f"{k}={_show(v)}" for k, v in zip(key, values))
                raise ConfigError(f"{named}: {valid} ({' / '.join('--config.' + k for k in key)})")
            continue
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
    """A check: an integer (not a bool) >= n.

    Args:
      n: the smallest valid value.

    Returns:
      `(predicate, valid range in words)` for a `(key, check)` pair.

    Example:
      >>> ("steps", int_at_least(1))
    """
    return (lambda v: _is_int(v) and v >= n), f"an integer >= {n}"


def number_at_least(x: float, *, strict: bool = False) -> tuple[Callable[[Any], bool], str]:
    """A check: a real number (not a bool, not NaN) >= x, or > x with `strict`.

    Args:
      x: the bound.
      strict: exclude `x` itself.

    Returns:
      `(predicate, valid range in words)`.

    Example:
      >>> ("optim.lr", number_at_least(0.0))
    """
    if strict:
        return (lambda v: _is_number(v) and v > x), f"a number > {x}"
    return (lambda v: _is_number(v) and v >= x), f"a number >= {x}"


def number_in(lo: float, hi: float) -> tuple[Callable[[Any], bool], str]:
    """A check: a real number (not a bool, not NaN) in [lo, hi).

    Args:
      lo: the smallest valid value.
      hi: the first invalid value above it.

    Returns:
      `(predicate, valid range in words)`.

    Example:
      >>> ("model.dropout", number_in(0.0, 1.0))
    """
    return (lambda v: _is_number(v) and lo <= v < hi), f"a number in [{lo}, {hi})"


def one_of(*choices) -> tuple[Callable[[Any], bool], str]:
    """A check: one of the given values.

    Args:
      *choices: the valid values.

    Returns:
      `(predicate, valid range in words)`.

    Example:
      >>> ("precision", one_of("fp32", "bf16", "fp16"))
    """
    return (lambda v: v in choices), "one of " + ", ".join(repr(c) for c in choices)


def boolean() -> tuple[Callable[[Any], bool], str]:
    """A check: True or False (not 0, 1 or a string).

    Returns:
      `(predicate, valid range in words)`.

    Example:
      >>> ("compile", boolean())
    """
    return (lambda v: isinstance(v, bool)), "True or False"


def relation(keys: Sequence[str], ok: Callable[..., bool], rule: str) -> Check:
    """A check of several keys together, e.g. one that must divide another. List it after the
    checks of its keys (`check_all` stops at the first failure, so `ok` sees valid values).

    Args:
      keys: the dotted keys, in the order `ok` takes their values.
      ok: a predicate over the values.
      rule: what must hold, in words, with the fix; the error line names every key and value.

    Returns:
      A check for `check_all`.

    Example:
      >>> relation(("model.n_embd", "model.n_head"), lambda e, h: e % h == 0,
      ...          "n_head must divide n_embd")
      # -> model.n_embd=128, model.n_head=5: n_head must divide n_embd (--config.model.n_embd / --config.model.n_head)
    """
    return tuple(keys), (ok, rule)


def check_batch(batch_size: int, accum_steps: int, dp_world: int, what: str = "accum_steps") -> None:
    """Raises `ConfigError` unless `batch_size` splits into `dp_world` ranks x `accum_steps` micro-batches.

    Args:
      batch_size: the global batch (`config.batch_size`).
      accum_steps: gradient-accumulation micro-batches per step.
      dp_world: data-parallel ranks of the mesh (`functrain.mesh_config.dp_world`).
      what: the key that sets the micro-batches ("pp.microbatches" for pipeline stages).

    Example:
      >>> check_batch(16, 2, 4)   # 2 rows per micro-batch per rank: fine
    """
    if batch_size % (dp_world * accum_steps):
        raise ConfigError(
            f"batch_size={batch_size} must divide by data-parallel ranks ({dp_world}) x {what} "
            f"({accum_steps}); change batch_size, {what} or the mesh (--config.batch_size)")


def check_pipeline(pp: int, accum_steps: int, n_layer: int) -> None:
    """Raises `ConfigError` unless a run of `pp` pipeline stages can cut its blocks and its batch.

    Args:
      pp: the mesh's pipeline stages (`config.mesh.pp`; 1: no pipeline).
      accum_steps: `config.accum_steps` (a pipeline's microbatches are `pp.microbatches`).
      n_layer: the model's blocks (0 when the family has no `model.n_layer`).

    Example:
      >>> check_pipeline(2, 1, 12)   # 12 blocks over 2 stages: fine
    """
    if pp > 1 and accum_steps != 1:
        raise ConfigError(f"accum_steps={accum_steps} with mesh.pp={pp}: a pipeline accumulates over its "
                          "microbatches; set --config.pp.microbatches instead and accum_steps=1")
    if pp > 1 and 0 < n_layer < pp:
        raise ConfigError(f"mesh.pp={pp} pipeline stages over model.n_layer={n_layer} blocks: each stage needs "
                          "a block; lower --config.mesh.pp or raise --config.model.n_layer")


def check_context(block_size: int, cp: int) -> None:
    """Raises `ConfigError` unless a sequence of `block_size` tokens splits over `cp` context-parallel ranks.

    Args:
      block_size: the training sequence length (`config.model.block_size`).
      cp: the mesh's context-parallel size (1: nothing to split).

    Example:
      >>> check_context(1024, 4)   # 8 chunks of 128 tokens, two per rank: fine
    """
    if cp > 1 and block_size % (2 * cp):
        raise ConfigError(
            f"model.block_size={block_size} must divide by 2 x mesh.cp = {2 * cp} (each context-parallel rank "
            "holds two chunks of every sequence); change --config.model.block_size or --config.mesh.cp")


def check_cuda_graphs(config: Any, device_type: str | None = None) -> None:
    """Raises `ConfigError` when `config.cuda_graphs` is asked for where it cannot work.

    Args:
      config: the run config (reads cuda_graphs, compile, compile_unit).
      device_type: the run's device type, once known ("cuda", "cpu", ...); None skips that check.

    Returns:
      None.

    Example:
      >>> check_cuda_graphs(config, "cuda")
    """
    if not config.get("cuda_graphs", False):
        return
    if not config.compile:
        raise ConfigError("cuda_graphs=True records the compiled step: it needs compile=True "
                          "(set --config.compile=True or drop --config.cuda_graphs)")
    if config.compile_unit != "step":
        raise ConfigError(f"cuda_graphs=True records the one-graph step: it needs compile_unit='step', not "
                          f"{config.compile_unit!r} (set --config.compile_unit=step or drop --config.cuda_graphs)")
    if device_type is not None and device_type != "cuda":
        raise ConfigError(f"cuda_graphs=True needs a CUDA device; this run's device is {device_type} "
                          "(drop --config.cuda_graphs)")


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
    ("fullgraph", boolean()),
    ("model_state_sync", one_of("broadcast", "mean")),
    ("cp_attention", one_of("zigzag", "stream", "mask")),
    ("pp.microbatches", int_at_least(1)),
    ("pp.schedule", one_of("1f1b", "eager-1f1b", "gpipe")),
    ("cuda_graphs", boolean()),
    ("donate", boolean()),
    ("peak_flops", number_at_least(0.0)),
    ("deterministic", boolean()),
    ("precision", one_of("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")),
    ("max_consecutive_skips", int_at_least(0)),
    ("tensorboard", boolean()),
    ("host_memory", one_of("keep", "default")),
    ("gc_every", int_at_least(0)),
    ("prefetch", int_at_least(0)),
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
