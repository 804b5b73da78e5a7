"""Remat policies as config values: "none", "full" or N (recompute every N-th block).

Internals: docs/internals.md "functrain.step.remat_policy".

Example:
    >>> recomputed_blocks(parse_policy("2"), 4)
    [False, True, False, True]
"""

from __future__ import annotations

from typing import Any

__all__ = ["parse_policy", "recomputed_blocks"]


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
