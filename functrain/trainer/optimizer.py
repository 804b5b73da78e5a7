"""The optimizer a run config describes: `from_config(config.optim, steps)`, and its checks.

Internals: docs/internals.md "functrain.trainer.optimizer".

Example:
    >>> config_checks.check_all(config, optimizer_checks.CHECKS)
    >>> opt = optimizer.from_config(config.optim, config.steps)
"""

from __future__ import annotations

from typing import Any

import functrain.step.precision as precision_lib
from functrain.optim.aliases import adamw, sgd
from functrain.optim.base import Transform, chain
from functrain.optim.schedules import Schedule, linear_warmup, warmup_cosine, warmup_linear
from functrain.optim.transforms import clip_by_global_norm

__all__ = ["decay_mask", "from_config", "schedule_from_config"]


def schedule_from_config(c: Any, steps: int) -> Schedule:
    """The learning-rate schedule of `c` (the optim config) over a run of `steps` steps.

    The warm-up follows nanoGPT: the rate of update t (t = 0 first) is `lr * (t + 1) / (W + 1)` for
    t < W = warmup_steps, so the first update already moves the params (optax's schedules with
    `init_value = lr / (W + 1)` give the same curve). `c.warmup_from_zero=True` gives `lr * t / W`
    instead: rate 0 at the first update (optax's default `init_value=0`).

    Args:
      c: the optim config (lr, min_lr, warmup_steps, warmup_from_zero, schedule).
      steps: total training steps (the decay length).

    Returns:
      A schedule `count -> lr`.

    Example:
      >>> sched = schedule_from_config(config.optim, config.steps)
      >>> sched(torch.tensor(0))  # lr / (warmup_steps + 1)
    """
    warmup = min(c.warmup_steps, max(steps - 1, 0))
    init = 0.0 if c.warmup_from_zero else c.lr / (warmup + 1)
    if c.schedule == "cosine":
        return warmup_cosine(c.lr, warmup, max(steps, warmup + 1), end_value=c.min_lr, init_value=init)
    if c.schedule == "constant":
        return linear_warmup(c.lr, warmup, init_value=init)
    return warmup_linear(c.lr, warmup, max(steps, warmup + 1), end_value=c.min_lr, init_value=init)  # "linear"


def decay_mask(params: dict) -> dict:
    """Weight decay on matrices only (not biases or norm scales), as nanoGPT / GPT-2 do.

    Args:
      params: {name: tensor}.

    Returns:
      {name: bool}: True for tensors of 2 or more dims.

    Example:
      >>> optim.adamw(3e-4, weight_decay=0.1, mask=decay_mask)
    """
    return {name: p.ndim >= 2 for name, p in params.items()}


def from_config(c: Any, steps: int) -> Transform:
    """The optimizer `c` describes: clipping (if `c.clip > 0`), then adamw or sgd with the schedule.

    Args:
      c: the optim config (checked with `CHECKS` first).
      steps: total training steps.

    Returns:
      A `Transform`.

    Example:
      >>> opt = from_config(config.optim, config.steps)
    """
    lr = schedule_from_config(c, steps)
    if c.name == "adamw":
        fused = c.fused  # None: the kernel in eager steps only (checked: True keeps the moments float32)
        mu_dtype, nu_dtype = (None if fused else precision_lib.parse_dtype(c[k]) for k in ("mu_dtype", "nu_dtype"))
        base = adamw(
            lr, c.b1, c.b2, c.eps, c.weight_decay, mask=decay_mask, mu_dtype=mu_dtype, nu_dtype=nu_dtype, fused=fused
        )
    else:
        base = sgd(lr, momentum=c.momentum, weight_decay=c.weight_decay, mask=decay_mask)
    return chain(clip_by_global_norm(c.clip), base) if c.clip > 0 else base
