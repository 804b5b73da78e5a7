"""Learning-rate schedules: pure functions `count (int64 0-d tensor) -> lr (float32 0-d tensor)`.

They are built from torch ops on the count tensor, so they trace into the compiled step and the
learning rate changes every step without a recompile.

Example:
    >>> sched = optim.warmup_cosine(peak_value=3e-4, warmup_steps=100, decay_steps=5000)
    >>> sched(torch.tensor(50))  # tensor(1.5e-4)
"""

from __future__ import annotations

import math
from typing import Callable

import torch

__all__ = ["constant", "linear", "linear_warmup", "warmup_cosine"]

Schedule = Callable[[torch.Tensor], torch.Tensor]


def _t(count: torch.Tensor) -> torch.Tensor:
    """The count as float32."""
    return count.to(torch.float32)


def constant(value: float) -> Schedule:
    """A constant learning rate.

    Args:
      value: the rate.

    Returns:
      A schedule.

    Example:
      >>> optim.constant(1e-3)(torch.tensor(7))  # tensor(1e-3)
    """
    return lambda count: torch.full((), value, dtype=torch.float32, device=count.device)


def linear(init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0) -> Schedule:
    """Linear interpolation from `init_value` to `end_value` over `transition_steps`, then flat.

    Args:
      init_value: the rate up to `transition_begin`.
      end_value: the rate from `transition_begin + transition_steps` on.
      transition_steps: length of the ramp (> 0).
      transition_begin: count at which the ramp starts.

    Returns:
      A schedule.

    Example:
      >>> optim.linear(1.0, 0.0, 10)(torch.tensor(5))  # tensor(0.5)
    """
    if transition_steps <= 0:
        raise ValueError(f"linear: transition_steps must be > 0, got {transition_steps}")

    def schedule(count):
        frac = torch.clamp((_t(count) - transition_begin) / transition_steps, 0.0, 1.0)
        return init_value + (end_value - init_value) * frac

    return schedule


def linear_warmup(peak_value: float, warmup_steps: int, init_value: float = 0.0) -> Schedule:
    """Linear warm-up from `init_value` to `peak_value` over `warmup_steps`, then constant.

    Args:
      peak_value: the rate after warm-up.
      warmup_steps: warm-up length; 0 means constant `peak_value`.
      init_value: the rate at count 0.

    Returns:
      A schedule.

    Example:
      >>> optim.linear_warmup(1e-3, 100)(torch.tensor(50))  # tensor(5e-4)
    """
    if warmup_steps <= 0:
        return constant(peak_value)
    return linear(init_value, peak_value, warmup_steps)


def warmup_cosine(
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    init_value: float = 0.0,
) -> Schedule:
    """Linear warm-up to `peak_value`, then cosine decay to `end_value` at count `decay_steps`.

    Args:
      peak_value: the rate at the end of warm-up.
      warmup_steps: warm-up length (may be 0).
      decay_steps: the count at which the decay ends (total schedule length, warm-up included);
        the rate stays at `end_value` afterwards.
      end_value: the final rate.
      init_value: the rate at count 0.

    Returns:
      A schedule.

    Example:
      >>> optim.warmup_cosine(3e-4, warmup_steps=100, decay_steps=5000, end_value=3e-5)
    """
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"warmup_cosine: decay_steps ({decay_steps}) must exceed warmup_steps ({warmup_steps})"
        )

    def schedule(count):
        t = _t(count)
        warm = init_value + (peak_value - init_value) * t / max(warmup_steps, 1)
        frac = torch.clamp((t - warmup_steps) / (decay_steps - warmup_steps), 0.0, 1.0)
        cos = end_value + 0.5 * (peak_value - end_value) * (1.0 + torch.cos(math.pi * frac))
        return torch.where(t < warmup_steps, warm, cos)

    return schedule
