"""A mesh config's axis sizes for a number of processes, and the batch size it allows: plain Python
(no torch), so `python -m functrain.main` checks them before the heavy modules load;
`functrain.parallel` re-exports `mesh_shape`.

Example:
    >>> mesh_shape({"tp": 2}, 8)
    {'dp_replicate': 1, 'dp_shard': 4, 'cp': 1, 'tp': 2}
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["mesh_shape", "dp_world"]


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
