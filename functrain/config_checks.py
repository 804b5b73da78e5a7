"""Run-config checks every layer shares, and the mesh a config asks for: plain Python, no torch.

Internals: docs/internals.md "functrain.config_checks".

Example:
    >>> check_all(config, [("model.n_layer", int_at_least(1))])
    >>> mesh_shape({"tp": 2}, 8)
    {'dp_replicate': 1, 'dp_shard': 4, 'cp': 1, 'tp': 2}
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from functrain.errors import FunctrainError

__all__ = [
    "ConfigError",
    "check_attention_fits",
    "Check",
    "check_all",
    "fail",
    "get",
    "int_at_least",
    "number_at_least",
    "number_in",
    "one_of",
    "parse_policy",
    "recomputed_blocks",
    "boolean",
    "relation",
    "check_batch",
    "check_pipeline",
    "check_context",
    "mesh_shape",
    "dp_world",
]

Check = tuple  # (dotted key, (predicate, valid range in words)); a relation: ((key, ...), (predicate, rule))


class ConfigError(FunctrainError, ValueError):
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
      dp_world: data-parallel ranks of the mesh (`functrain.config_checks.dp_world`).
      what: the key that sets the micro-batches ("pp.microbatches" for pipeline stages).

    Example:
      >>> check_batch(16, 2, 4)   # 2 rows per micro-batch per rank: fine
    """
    if batch_size % (dp_world * accum_steps):
        raise ConfigError(
            f"batch_size={batch_size} must divide by data-parallel ranks ({dp_world}) x {what} "
            f"({accum_steps}); change batch_size, {what} or the mesh (--config.batch_size)"
        )


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
        raise ConfigError(
            f"accum_steps={accum_steps} with mesh.pp={pp}: a pipeline accumulates over its "
            "microbatches; set --config.pp.microbatches instead and accum_steps=1"
        )
    if pp > 1 and 0 < n_layer < pp:
        raise ConfigError(
            f"mesh.pp={pp} pipeline stages over model.n_layer={n_layer} blocks: each stage needs "
            "a block; lower --config.mesh.pp or raise --config.model.n_layer"
        )


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
            "holds two chunks of every sequence); change --config.model.block_size or --config.mesh.cp"
        )


def _get(cfg: Any, name: str, default: int) -> int:
    """Field `name` of a dict-like or attribute-style config, or `default`."""
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        return int(cfg.get(name, default))
    return int(getattr(cfg, name, default))


def mesh_shape(mesh_config: Any, world: int) -> dict[str, int]:
    """Resolves the axis sizes of a mesh config for `world` processes.

    Args:
      mesh_config: a dict / ml_collections ConfigDict / object with optional int fields
        `dp_replicate` (default 1), `dp_shard` (default -1), `cp` (default 1), `tp` (default 1); -1
        means "the rest of the world size" and may appear once. None means pure FSDP over all
        processes. An optional `pp` (default 1, pipeline ranks, see `functrain.parallel.pipeline`) splits
        the world into `pp` pipeline stages, each a mesh of the other four axes over world / pp.
      world: the number of processes.

    Returns:
      {"dp_replicate": a, "dp_shard": b, "cp": c, "tp": d} with a * b * c * d == world / pp: the
      mesh of one pipeline stage (of the whole world without `pp`).

    Raises:
      ValueError: one line naming the sizes and the world size when they do not fit.

    Example:
      >>> mesh_shape({"tp": 2}, 8)
      {'dp_replicate': 1, 'dp_shard': 4, 'cp': 1, 'tp': 2}
    """
    pp = _get(mesh_config, "pp", 1)
    if pp < 1 or world % pp:
        raise ValueError(f"mesh config pp={pp}: pipeline ranks must be a positive divisor of the world size {world}")
    world //= pp
    sizes = {
        "dp_replicate": _get(mesh_config, "dp_replicate", 1),
        "dp_shard": _get(mesh_config, "dp_shard", -1),
        "cp": _get(mesh_config, "cp", 1),
        "tp": _get(mesh_config, "tp", 1),
    }
    desc = " x ".join(f"{k}={v}" for k, v in sizes.items()) + (f" (one of pp={pp} pipeline stages)" if pp > 1 else "")
    bad = [k for k, v in sizes.items() if v == 0 or v < -1]
    rest = [k for k, v in sizes.items() if v == -1]
    if bad:
        raise ValueError(f"mesh config {desc}: sizes must be positive or -1 (got {', '.join(bad)})")
    if len(rest) > 1:
        raise ValueError(f"mesh config {desc}: at most one axis may be -1 (got {', '.join(rest)})")
    known = 1
    for v in sizes.values():
        known *= v if v > 0 else 1
    if rest:
        if world % known:
            raise ValueError(
                f"mesh config {desc}: world size {world} is not divisible by {known}, "
                f"so {rest[0]}=-1 has no integer size"
            )
        sizes[rest[0]] = world // known
    elif known != world:
        raise ValueError(f"mesh config {desc}: product {known} != world size {world}")
    return sizes


def dp_world(shape: Mapping[str, int]) -> int:
    """The number of data-parallel replicas (batch shards) of a resolved mesh shape.

    Args:
      shape: `mesh_shape`'s result.

    Returns:
      dp_replicate x dp_shard (context- and tensor-parallel ranks share their batch rows).

    Example:
      >>> dp_world(mesh_shape({"tp": 2}, 8))
      4
    """
    return shape["dp_replicate"] * shape["dp_shard"]


def check_attention_fits(block_size: int, heads: int, rows: int, cp: int = 1, memory: int | None = None) -> None:
    """Raises `ConfigError` when one attention layer's scores of a microbatch cannot fit the host's memory.

    The CPU attention of a training step (and inductor's kernels for it) holds the (rows, heads, T / cp, T)
    scores of a layer at once: a block size they cannot fit would only fail after minutes of compiling.

    Args:
      block_size: the training sequence length T.
      heads: the attention heads.
      rows: the sequences of one microbatch on a rank.
      cp: the context-parallel size (each rank's queries are T / cp).
      memory: bytes available (default: the host's physical memory).

    Example:
      >>> check_attention_fits(1024, 12, 8)   # 400 MiB of scores: fine
    """
    if memory is None:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = rows * heads * (block_size // max(cp, 1)) * block_size * 4
    if heads > 0 and need > memory:
        raise ConfigError(
            f"model.block_size={block_size}: one attention layer's scores alone take {need / 2**30:.1f} GiB "
            f"({rows} rows x {heads} heads x {block_size // max(cp, 1)} x {block_size} floats) where this host has "
            f"{memory / 2**30:.1f} GiB; lower --config.model.block_size or --config.batch_size, or raise "
            "--config.accum_steps"
        )


def parse_policy(policy: Any) -> str | int:
    """Validates a remat policy and returns it normalized ("none", "full" or an int N >= 1).

    Args:
      policy: "none" (no recomputation), "full" (recompute every block), or a positive int N:
        recompute every N-th block (blocks N-1, 2N-1, ... counting from 0, as torchtitan's
        `selective_ac_option: N`; N = 1 is "full"). A decimal string such as "2" is read as the int
        (for command-line configs).

    Returns:
      "none", "full" or an int >= 1.

    Raises:
      ValueError: for anything else, naming the value and the allowed ones.

    Example:
      >>> parse_policy("2")   # 2
    """
    if isinstance(policy, str) and policy.strip().isdigit():
        policy = int(policy)
    if policy in ("none", "full"):
        return policy
    if isinstance(policy, int) and not isinstance(policy, bool) and policy >= 1:
        return policy
    raise ValueError(
        f"remat policy must be 'none', 'full' or a positive int N (recompute every N-th block), got {policy!r}"
    )


def recomputed_blocks(policy: str | int, n_blocks: int) -> list[bool]:
    """Which blocks a parsed remat policy recomputes in its backward.

    Args:
      policy: "none", "full" or N (`parse_policy`'s result): every N-th block (the N-th, 2N-th, ...).
      n_blocks: how many blocks the model has.

    Returns:
      One flag per block, True where the block is recomputed (its gathered params freed after its
      forward, its activations not held).

    Example:
      >>> recomputed_blocks(2, 4)
      [False, True, False, True]
    """
    if policy == "none":
        return [False] * n_blocks
    if policy == "full":
        return [True] * n_blocks
    return [(i + 1) % int(policy) == 0 for i in range(n_blocks)]
