"""Dropout inside any module drawn from the step's key: a torch function mode, no change to the module.

`nn.Dropout`, `F.dropout` and the alpha, feature and 1-d/2-d/3-d dropouts, and
`F.scaled_dot_product_attention(..., dropout_p > 0)` normally draw from torch's global generator,
which a step cannot carry as data: such a run is not a function of (seed, step) and a resume is not
bit-exact. Under `keyed(key)` each of these calls draws its mask from
`rng.fold_in(key, SALT + i)` for the i-th call in the forward instead (one opaque `functrain::uniform`
draw), so the same key gives the same masks, eagerly or compiled, and the masks follow the state's
key: per step, per microbatch, per data-parallel rank and per population member.

`make_train_step` enters it around the loss with the (micro)batch's key; the eval step has no key,
and modules in eval mode do not drop. Calls that do not drop (`training=False`, p == 0) pass through
unchanged, as does every other function, so a model without dropout computes exactly what it did.
The call counter is a Python int read while tracing: a forward makes its calls in one order, so the
i-th call gets the same key every step.

SDPA with dropout runs as its math formulation (scores, softmax, keyed dropout, weighted sum): the
fused kernels draw their own numbers. It keeps the (B, H, T, T) weights, as torch's math backend does.

Example:
    >>> with randomness.keyed(key):
    ...     out = torch.func.functional_call(model, params, (x,))   # nn.Dropout draws from key
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from functrain import rng

__all__ = ["SALT", "KeyedRandomness", "keyed"]

SALT = 0x6472_6F70  # "drop": keeps these keys apart from a loss's own fold_in(key, small int)

_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946
_ALPHA_PRIME = -_SELU_ALPHA * _SELU_SCALE  # the value alpha dropout sets dropped units to


def _arg(args, kwargs, i: int, name: str, default):
    """Argument `name` of a call, given by position `i` or by keyword."""
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _feature_mask_shape(x: torch.Tensor, spatial: int) -> list[int]:
    """The mask shape of a feature dropout: one draw per (batch, channel), broadcast over `spatial` dims."""
    return list(x.shape[:-spatial]) + [1] * spatial


def _active(p: float, training: bool) -> bool:
    """Whether a dropout call drops anything."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    return bool(training) and p > 0.0


class KeyedRandomness(TorchFunctionMode):
    """The torch function mode behind `keyed`: dropouts draw from `key` (see the module docstring).

    Args:
      key: an int64 key of shape (2,), e.g. the step's dropout key.

    Example:
      >>> with KeyedRandomness(key):
      ...     y = F.dropout(x, 0.1)
    """

    def __init__(self, key: torch.Tensor):
        super().__init__()
        self.key = key
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            return self._dropout(func, args, kwargs, 0)
        if func is F.scaled_dot_product_attention:
            return self._sdpa(func, args, kwargs)
        if func is F.dropout1d or func is F.dropout2d or func is F.dropout3d:
            return self._dropout(func, args, kwargs, 1 if func is F.dropout1d else 2 if func is F.dropout2d else 3)
        if func is F.alpha_dropout or func is F.feature_alpha_dropout:
            return self._dropout(func, args, kwargs, 0, alpha=True, feature=func is F.feature_alpha_dropout)
        return func(*args, **kwargs)

    def _next_key(self) -> torch.Tensor:
        """The key of the next drawing call."""
        k = rng.fold_in(self.key, SALT + self.calls)
        self.calls += 1
        return k

    def _keep(self, shape, p: float, dtype) -> torch.Tensor:
        """A 0/1 mask in `dtype`, 1 with probability 1 - p."""
        return (rng.uniform(self._next_key(), shape) >= p).to(dtype)

    def _dropout(self, func, args, kwargs, spatial: int, alpha: bool = False, feature: bool = False):
        """Any dropout: elementwise (spatial 0), whole channels over `spatial` trailing dims, or alpha
        dropout (which keeps a SELU network's mean and variance; `feature`: per channel)."""
        x, p = args[0], float(_arg(args, kwargs, 1, "p", 0.5))
        if not _active(p, _arg(args, kwargs, 2, "training", not alpha)):  # alpha dropouts default to eval
            return func(*args, **kwargs)
        if p == 1.0:
            return x * 0.0
        if feature:
            spatial = x.ndim - 2  # (N, C, ...): one draw per (sample, channel)
        # (N, C, *spatial) or, without a batch dim, (C, *spatial): one draw per channel
        shape = x.shape if spatial == 0 else _feature_mask_shape(x, spatial)
        keep = self._keep(shape, p, x.dtype)
        if not alpha:  # inplace=True gives a new tensor, as under vmap
            return x * keep * (1.0 / (1.0 - p))
        a = 1.0 / math.sqrt((_ALPHA_PRIME**2 * p + 1.0) * (1.0 - p))
        return (x * keep + _ALPHA_PRIME * (1.0 - keep)) * a - a * _ALPHA_PRIME * p

    def _sdpa(self, func, args, kwargs):
        p = float(_arg(args, kwargs, 4, "dropout_p", 0.0))
        if p == 0.0:
            return func(*args, **kwargs)
        q, k, v = args[0], _arg(args, kwargs, 1, "key", None), _arg(args, kwargs, 2, "value", None)
        mask = _arg(args, kwargs, 3, "attn_mask", None)
        causal = bool(_arg(args, kwargs, 5, "is_causal", False))
        scale = _arg(args, kwargs, 6, "scale", None)
        if kwargs.get("enable_gqa", False) and k.shape[-3] != q.shape[-3]:  # (B, Hkv, S, D) -> (B, H, S, D)
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        scores = (q @ k.transpose(-2, -1)) * scale  # (..., L, S)
        L, S = q.shape[-2], k.shape[-2]
        if causal:
            allowed = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()  # (L, S)
            scores = scores.masked_fill(~allowed, float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        weights = torch.softmax(scores, dim=-1)  # (..., L, S)
        weights = weights * self._keep(weights.shape, p, weights.dtype) * (1.0 / (1.0 - p))
        return weights @ v  # (..., L, Dv)


def keyed(key: "torch.Tensor | None"):
    """A context in which every module's dropout draws from `key` (see the module docstring).

    Args:
      key: an int64 key of shape (2,); None: a context that changes nothing (evaluation).

    Returns:
      A context manager.

    Example:
      >>> with keyed(rng.fold_in(state.rng, state.step)):
      ...     logits = functrain.apply(model, params, x)
    """
    if key is None:
        return contextlib.nullcontext()
    return KeyedRandomness(key)
