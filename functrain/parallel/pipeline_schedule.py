"""Pipeline schedules and stage partitions: pure bookkeeping, no torch, no communication.

Internals: docs/internals.md "functrain.parallel.pipeline_schedule".

Example:
    >>> one_f_one_b(n=2, m=4, rank=0)
    [Action(kind='F', micro=0), Action(kind='F', micro=1), Action(kind='B', micro=0), ...]
    >>> bubble_fraction(2, 4)
    0.2
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

__all__ = [
    "Action",
    "SCHEDULES",
    "bubble_fraction",
    "gpipe",
    "held",
    "one_f_one_b",
    "partition",
    "schedule",
    "simulate",
]


class Action(NamedTuple):
    """One step of a rank's schedule: `kind` "F" (forward) or "B" (backward) of microbatch `micro`."""

    kind: str
    micro: int


def _check(n: int, m: int, rank: int) -> None:
    """Raises ValueError unless 0 <= rank < n and n, m >= 1."""
    if n < 1 or m < 1 or not 0 <= rank < n:
        raise ValueError(
            f"a pipeline schedule needs n >= 1 ranks, m >= 1 microbatches and 0 <= rank < n; "
            f"got n={n}, m={m}, rank={rank}"
        )


def gpipe(n: int, m: int, rank: int) -> list[Action]:
    """GPipe: every forward, then every backward (in the same order).

    Args:
      n: pipeline ranks. m: microbatches per step. rank: this rank (0 = the first stage).

    Returns:
      The rank's actions in order.

    Example:
      >>> gpipe(2, 2, 1)
      [Action(kind='F', micro=0), Action(kind='F', micro=1), Action(kind='B', micro=0), Action(kind='B', micro=1)]
    """
    _check(n, m, rank)
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def one_f_one_b(n: int, m: int, rank: int) -> list[Action]:
    """1F1B: `n - rank - 1` warm-up forwards, then forward and backward in turn, then the last backwards.

    Args:
      n: pipeline ranks. m: microbatches per step. rank: this rank (0 = the first stage).

    Returns:
      The rank's actions in order; at most `min(n - rank, m)` forwards are ever awaiting their backward.

    Example:
      >>> [a.kind + str(a.micro) for a in one_f_one_b(2, 3, 0)]
      ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    """
    _check(n, m, rank)
    return _interleaved(m, min(n - rank - 1, m))


def eager_one_f_one_b(n: int, m: int, rank: int) -> list[Action]:
    """1F1B with one more warm-up forward on every rank but the last.

    Every rank then runs its forwards one microbatch ahead of the rank after it, so that rank's
    next input is already there: a forward or backward that runs slower than the others stalls the
    ranks after it only once that slack is used up, where under 1F1B every slow action on one rank
    idles the next. The bubble of equal stages is 1F1B's; a rank holds one microbatch's activations
    more (the last rank none more).

    Args:
      n: pipeline ranks. m: microbatches per step. rank: this rank (0 = the first stage).

    Returns:
      The rank's actions in order; at most `min(n - rank + 1, m)` forwards (the last rank 1) are
      ever awaiting their backward.

    Example:
      >>> [a.kind + str(a.micro) for a in eager_one_f_one_b(2, 4, 0)]
      ['F0', 'F1', 'F2', 'B0', 'F3', 'B1', 'B2', 'B3']
    """
    _check(n, m, rank)
    return _interleaved(m, min(n - rank - 1 + (rank < n - 1), m))


def _interleaved(m: int, warm: int) -> list[Action]:
    """`warm` forwards, then the forward of i + warm and the backward of i in turn, then the last backwards."""
    out = [Action("F", i) for i in range(warm)]
    for i in range(m - warm):
        out += [Action("F", i + warm), Action("B", i)]
    return out + [Action("B", i) for i in range(m - warm, m)]


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "eager-1f1b": eager_one_f_one_b,
}


def schedule(name: str, n: int, m: int, rank: int) -> list[Action]:
    """The actions of `rank` under schedule `name` ("gpipe" or "1f1b").

    Args:
      name: a key of `SCHEDULES`. n: pipeline ranks. m: microbatches. rank: this rank.

    Returns:
      The rank's actions in order.

    Raises:
      ValueError: an unknown schedule name (one line naming the choices).

    Example:
      >>> len(schedule("1f1b", 4, 8, 0))
      16
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}: use one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](n, m, rank)


def bubble_fraction(n: int, m: int) -> float:
    """The idle share of a step for GPipe and 1F1B when every stage costs the same: (n-1) / (m+n-1).

    Args:
      n: pipeline ranks. m: microbatches per step.

    Returns:
      A fraction in [0, 1).

    Example:
      >>> bubble_fraction(4, 16)
      0.15789473684210525
    """
    return (n - 1) / (m + n - 1)


def simulate(name: str, n: int, m: int, forward: Sequence, backward: Sequence) -> list[float]:
    """Each rank's idle share of a step when its forwards and backwards cost what is given and
    transfers are free: the bubble a schedule leaves for these costs.

    Args:
      name: a key of `SCHEDULES`. n: pipeline ranks. m: microbatches per step.
      forward, backward: per rank, the seconds of one microbatch's forward and backward: one number
        (every microbatch costs the same) or a sequence of m numbers (microbatch i costs the i-th).

    Returns:
      Per rank, 1 - (its compute) / (the step's span). With equal costs every entry is
      `bubble_fraction(n, m)`.

    Raises:
      RuntimeError: the schedules deadlock (a rank waits for work no rank can do).
      ValueError: a rank's costs are a sequence of other than m numbers (one line).

    Example:
      >>> [round(b, 6) for b in simulate("1f1b", 2, 4, [1, 1], [2, 2])]
      [0.2, 0.2]
      >>> [round(b, 6) for b in simulate("1f1b", 2, 2, [[1, 1], [1, 2]], [2, 2])]  # one slow forward
      [0.4, 0.3]
    """
    costs = {"F": [_per_micro(c, m, "forward") for c in forward], "B": [_per_micro(c, m, "backward") for c in backward]}
    plans = [schedule(name, n, m, r) for r in range(n)]
    done: dict = {}  # (kind, rank, micro) -> when it finished
    clock, at = [0.0] * n, [0] * n
    while any(at[r] < len(plans[r]) for r in range(n)):
        moved = False
        for r in range(n):
            while at[r] < len(plans[r]):
                kind, i = plans[r][at[r]]
                need = [("F", r, i), ("B", r + 1, i)] if kind == "B" else [("F", r - 1, i)]
                need = [k for k in need if 0 <= k[1] < n]
                if not all(k in done for k in need):
                    break
                start = max([clock[r]] + [done[k] for k in need])
                clock[r] = done[(kind, r, i)] = start + costs[kind][r][i]
                at[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"schedule {name!r} deadlocks at n={n}, m={m} (ranks at actions {at})")
    span = max(clock)
    return [1.0 - (sum(costs["F"][r]) + sum(costs["B"][r])) / span for r in range(n)]


def _per_micro(cost, m: int, what: str) -> list[float]:
    """A rank's cost per microbatch: one number repeated m times, or m numbers as given."""
    if isinstance(cost, (int, float)):
        return [float(cost)] * m
    cost = [float(c) for c in cost]
    if len(cost) != m:
        raise ValueError(f"{what} costs: got {len(cost)} for {m} microbatches; give one number or one per microbatch")
    return cost


def held(actions: Sequence[Action]) -> int:
    """The most microbatches whose forward has run and whose backward has not, along `actions`.

    Args:
      actions: a rank's schedule.

    Returns:
      The peak number of microbatches' activations the rank holds at once.

    Example:
      >>> held(gpipe(4, 8, 0)), held(one_f_one_b(4, 8, 0))
      (8, 4)
    """
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


def partition(weights: Sequence[float], n: int, *, first: float = 0.0, last: float = 0.0) -> list[range]:
    """Cuts blocks of the given weights into `n` contiguous non-empty groups, the heaviest as light as can be.

    Args:
      weights: each block's weight (parameter count, FLOPs), in order.
      n: the number of groups (pipeline ranks).
      first: extra weight of group 0 (the embedding it also runs).
      last: extra weight of group n - 1 (the head it also runs).

    Returns:
      `n` ranges of block indices, in order, covering every block once.

    Raises:
      ValueError: fewer blocks than groups (one line with the fix).

    Example:
      >>> partition([1, 1, 1, 1], 2, first=2)
      [range(0, 1), range(1, 4)]
    """
    k = len(weights)
    if n < 1 or k < n:
        raise ValueError(
            f"pipeline of {n} stages over {k} blocks: each stage needs at least one block; "
            f"use at most {k} pipeline ranks (mesh.pp) or a deeper model"
        )
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))

    def load(g: int, i: int, j: int) -> float:
        """Weight of group g holding blocks i..j-1."""
        return prefix[j] - prefix[i] + (first if g == 0 else 0.0) + (last if g == n - 1 else 0.0)

    # best[g][j]: the lightest heaviest-group over splits of blocks 0..j-1 into groups 0..g
    inf = float("inf")
    best = [[inf] * (k + 1) for _ in range(n)]
    cut = [[0] * (k + 1) for _ in range(n)]
    for j in range(1, k + 1):
        best[0][j] = load(0, 0, j)
    for g in range(1, n):
        for j in range(g + 1, k + 1):
            for i in range(g, j):  # group g holds blocks i..j-1
                cand = max(best[g - 1][i], load(g, i, j))
                if cand < best[g][j]:
                    best[g][j], cut[g][j] = cand, i
    bounds = [k]
    for g in range(n - 1, 0, -1):
        bounds.append(cut[g][bounds[-1]])
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[g], bounds[g + 1]) for g in range(n)]
