"""The eager in-place route of `adamw(fused=True)`: torch's fused AdamW kernel (`torch._fused_adamw_`).

Internals: docs/internals.md "functrain.optim.fused".

Example:
    >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(3e-4, fused=True))
    >>> step = make_train_step(loss_fn, opt, compile=False)  # each update is one kernel pass
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from functrain import tree as tree_lib
from functrain.optim.base import resolve_mask
from functrain.optim.transforms import ScaleByLearningRateState, rate_at

__all__ = ["adamw_route", "kernel_takes"]

PyTree = Any


def kernel_takes(tensors: list) -> bool:
    """Whether torch's fused kernel takes these tensors: plain tensors of one floating dtype on one CPU or CUDA device.

    Args:
      tensors: the params, grads and moments, in one list.

    Returns:
      A Python bool.

    Example:
      >>> kernel_takes([p, g, m, v])
    """
    if not tensors:
        return False
    first = tensors[0]
    if first.device.type not in ("cpu", "cuda") or not first.is_floating_point():
        return False
    return all(type(t) is torch.Tensor and t.dtype == first.dtype and t.device == first.device for t in tensors)


def adamw_route(learning_rate: Any, mask: PyTree | Callable[[PyTree], PyTree] | None) -> Callable[..., Any]:
    """The `fused` route of `adamw`: its chain's update (Adam, decoupled decay, the schedule) in one kernel call per
    decay group.

    Args:
      learning_rate: adamw's learning rate (a float, tensor, schedule or callable).
      mask: adamw's weight-decay mask (None: every leaf).

    Returns:
      `fused(params, grads, state, *, norm, found_inf, grad_scale=None) -> new state or None`: updates
      `params` and the moments in `state` in place and returns the state after the update (its
      counters and learning rate written in place too); None, touching nothing, when the kernel does
      not take these tensors.

    Example:
      >>> route = adamw_route(3e-4, mask=None)
      >>> new_state = route(params, grads, opt_state, norm=None, found_inf=torch.zeros(()))
    """

    host = _HostValues()  # the kernel takes betas, eps and decay as Python floats

    def fused(params: PyTree, grads: PyTree, state: Any, *, norm: Any, found_inf: Any, grad_scale: Any = None) -> Any:
        adam, decay, lr_state = state  # chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate)
        p, spec = tree_lib.flatten(params)
        # dense grads: autograd hands out expanded views (a sum's gradient: stride 0), which the kernel misreads
        g = [x if x.is_contiguous() else x.contiguous() for x in spec.flatten_up_to(grads)]
        m = spec.flatten_up_to(adam.mu)
        v = spec.flatten_up_to(adam.nu)
        if not kernel_takes(p + g + m + v):
            return None
        flags = resolve_mask(mask, params) if mask is not None else [True] * len(p)
        ok = (found_inf == 0).to(adam.count.dtype)
        rate = rate_at(learning_rate, lr_state.count, lr_state.hyper).to(torch.float32)
        count = (adam.count + 1).to(p[0].dtype)  # the kernel's bias corrections read the new count
        h = adam.hyper
        b1, b2, eps, wd = (host.value(x) for x in (h["b1"], h["b2"], h["eps"], decay.hyper["weight_decay"]))
        found = found_inf.to(torch.float32)
        scale = None if grad_scale is None else grad_scale.to(torch.float32)
        for want in (True, False):  # the decayed leaves, then the others
            idx = [i for i, f in enumerate(flags) if f == want]
            if idx:
                torch._fused_adamw_(
                    [p[i] for i in idx],
                    [g[i] for i in idx],
                    [m[i] for i in idx],
                    [v[i] for i in idx],
                    [],
                    [count] * len(idx),
                    lr=rate,
                    beta1=b1,
                    beta2=b2,
                    weight_decay=wd if want else 0.0,
                    eps=eps,
                    amsgrad=False,
                    maximize=False,
                    grad_scale=scale,
                    found_inf=found,
                )
        adam.count.add_(ok)  # a skipped step leaves the counters and the logged rate as they were
        lr_state.lr.copy_(torch.where(ok > 0, rate, lr_state.lr))
        lr_state.count.add_(ok)
        return adam, decay, ScaleByLearningRateState(lr_state.count, lr_state.lr, lr_state.hyper)

    return fused


class _HostValues:
    """`float(t)` of hyper-parameter tensors, read from the device once per value: a tensor read
    before, unchanged since (same object, same version counter), is answered from the host (a step
    then waits for no device read)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple] = {}  # id(t) -> (weakref to t, t._version, float(t))

    def value(self, t: torch.Tensor) -> float:
        """`float(t)`, from the host when `t` was read before and has not changed."""
        hit = self._seen.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2]
        v = float(t)
        self._seen[id(t)] = (weakref.ref(t), t._version, v)
        return v
