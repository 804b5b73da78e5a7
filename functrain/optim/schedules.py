"""Learning-rate schedules: `count (int64 0-d tensor) -> lr (float32 0-d tensor)`, with their constants as
hyper-parameters that can live in the optimizer state.

Internals: docs/internals.md "functrain.optim.schedules".

Example:
    >>> sched = optim.warmup_cosine(peak_value=3e-4, warmup_steps=100, decay_steps=5000)
    >>> sched(torch.tensor(50))  # tensor(1.5e-4)
    >>> sched.hyper              # {'lr': 0.0003, 'warmup_steps': 100, 'decay_steps': 5000, ...}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["Schedule", "constant", "linear", "linear_warmup", "warmup_cosine", "warmup_linear"]


class Schedule:
    """A learning-rate schedule: `fn(count, **hyper)` with default constants `hyper`.

    Args:
      fn: `fn(count, **constants) -> rate`, torch ops only (constants may be floats or 0-d tensors).
      hyper: the constants' names and default values.

    Example:
      >>> s = Schedule(lambda count, lr: lr * 0.5 ** (count / 100), {"lr": 1e-3})
      >>> s(torch.tensor(100)), s.at(torch.tensor(100), {"lr": torch.tensor(2e-3)})
    """

    def __init__(self, fn: Callable[..., torch.Tensor], hyper: Mapping[str, float]):
        self.fn = fn
        self.hyper = dict(hyper)

    def __call__(self, count: torch.Tensor) -> torch.Tensor:
        """The rate at `count` with the default constants."""
        return self.at(count, self.hyper)

    def at(self, count: torch.Tensor, hyper: Mapping[str, Any]) -> torch.Tensor:
        """The rate (float32, computed in float64) at `count` with constants `hyper` (e.g. state tensors)."""
        return torch.as_tensor(self.fn(count, **hyper), device=count.device).to(torch.float32)


def _t(count: torch.Tensor) -> torch.Tensor:
    """The count as float64 (the constants' dtype in the state)."""
    return count.to(torch.float64)


def constant(value: float) -> Schedule:
    """A constant learning rate.

    Args:
      value: the rate (hyper-parameter "lr").

    Returns:
      A schedule.

    Example:
      >>> optim.constant(1e-3)(torch.tensor(7))  # tensor(1e-3)
    """
    return Schedule(lambda count, lr: torch.zeros((), dtype=torch.float64, device=count.device) + lr, {"lr": value})


def _warm(t: torch.Tensor, lr: Any, init_lr: Any, warmup_steps: Any) -> torch.Tensor:
    """The linear warm-up's rate at float64 count `t`: init_lr -> lr over warmup_steps (at least 1)."""
    return init_lr + (lr - init_lr) * t / torch.clamp(
        torch.as_tensor(warmup_steps, dtype=torch.float64, device=t.device), min=1.0
    )


def _linear(count: Any, init_lr: Any, end_lr: Any, transition_steps: Any, transition_begin: Any) -> torch.Tensor:
    """init_lr -> end_lr linearly over [transition_begin, transition_begin + transition_steps]."""
    frac = torch.clamp((_t(count) - transition_begin) / transition_steps, 0.0, 1.0)
    return init_lr + (end_lr - init_lr) * frac


def linear(init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0) -> Schedule:
    """Linear interpolation from `init_value` to `end_value` over `transition_steps`, then flat.

    Args:
      init_value: the rate up to `transition_begin` ("init_lr").
      end_value: the rate from `transition_begin + transition_steps` on ("end_lr").
      transition_steps: length of the ramp (> 0).
      transition_begin: count at which the ramp starts.

    Returns:
      A schedule.

    Example:
      >>> optim.linear(1.0, 0.0, 10)(torch.tensor(5))  # tensor(0.5)
    """
    if transition_steps <= 0:
        raise ValueError(f"linear: transition_steps must be > 0, got {transition_steps}")
    return Schedule(
        _linear,
        {
            "init_lr": init_value,
            "end_lr": end_value,
            "transition_steps": transition_steps,
            "transition_begin": transition_begin,
        },
    )


def linear_warmup(peak_value: float, warmup_steps: int, init_value: float = 0.0) -> Schedule:
    """Linear warm-up from `init_value` to `peak_value` over `warmup_steps`, then constant.

    Args:
      peak_value: the rate after warm-up ("lr").
      warmup_steps: warm-up length; 0 means constant `peak_value`.
      init_value: the rate at count 0 ("init_lr").

    Returns:
      A schedule.

    Example:
      >>> optim.linear_warmup(1e-3, 100)(torch.tensor(50))  # tensor(5e-4)
    """

    def fn(count: torch.Tensor, lr: Any, warmup_steps: Any, init_lr: Any) -> torch.Tensor:
        t = _t(count)
        warm = _warm(t, lr, init_lr, warmup_steps)
        return torch.where(t < warmup_steps, warm, torch.zeros_like(t) + lr)

    return Schedule(fn, {"lr": peak_value, "warmup_steps": warmup_steps, "init_lr": init_value})


def warmup_cosine(
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    init_value: float = 0.0,
) -> Schedule:
    """Linear warm-up to `peak_value`, then cosine decay to `end_value` at count `decay_steps`.

    Args:
      peak_value: the rate at the end of warm-up ("lr").
      warmup_steps: warm-up length (may be 0) ("warmup_steps").
      decay_steps: the count at which the decay ends (total schedule length, warm-up included);
        the rate stays at `end_value` afterwards ("decay_steps").
      end_value: the final rate ("min_lr").
      init_value: the rate at count 0 ("init_lr").

    Returns:
      A schedule.

    Example:
      >>> optim.warmup_cosine(3e-4, warmup_steps=100, decay_steps=5000, end_value=3e-5)
    """
    if decay_steps <= warmup_steps:
        raise ValueError(f"warmup_cosine: decay_steps ({decay_steps}) must exceed warmup_steps ({warmup_steps})")

    def fn(
        count: torch.Tensor, lr: Any, warmup_steps: Any, decay_steps: Any, min_lr: Any, init_lr: Any
    ) -> torch.Tensor:
        t = _t(count)
        warm = _warm(t, lr, init_lr, warmup_steps)
        frac = torch.clamp((t - warmup_steps) / (decay_steps - warmup_steps), 0.0, 1.0)
        cos = min_lr + 0.5 * (lr - min_lr) * (1.0 + torch.cos(math.pi * frac))
        return torch.where(t < warmup_steps, warm, cos)

    return Schedule(
        fn,
        {
            "lr": peak_value,
            "warmup_steps": warmup_steps,
            "decay_steps": decay_steps,
            "min_lr": end_value,
            "init_lr": init_value,
        },
    )


def warmup_linear(
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    init_value: float = 0.0,
) -> Schedule:
    """Linear warm-up to `peak_value`, then linear decay to `end_value` at count `decay_steps`.

    Args:
      peak_value: the rate at the end of warm-up ("lr").
      warmup_steps: warm-up length ("warmup_steps").
      decay_steps: the count at which the decay ends ("decay_steps").
      end_value: the final rate ("min_lr").
      init_value: the rate at count 0 ("init_lr").

    Returns:
      A schedule.

    Example:
      >>> optim.warmup_linear(1e-3, 100, 5000, end_value=1e-4)
    """
    if decay_steps <= warmup_steps:
        raise ValueError(f"warmup_linear: decay_steps ({decay_steps}) must exceed warmup_steps ({warmup_steps})")

    def fn(
        count: torch.Tensor, lr: Any, warmup_steps: Any, decay_steps: Any, min_lr: Any, init_lr: Any
    ) -> torch.Tensor:
        t = _t(count)
        warm = _warm(t, lr, init_lr, warmup_steps)
        return torch.where(t < warmup_steps, warm, _linear(count, lr, min_lr, decay_steps - warmup_steps, warmup_steps))

    return Schedule(
        fn,
        {
            "lr": peak_value,
            "warmup_steps": warmup_steps,
            "decay_steps": decay_steps,
            "min_lr": end_value,
            "init_lr": init_value,
        },
    )
