"""Every random draw inside any module taken from the step's key: a torch function mode, no change to the module.

Internals: docs/internals.md "functrain.nn.randomness".

Example:
    >>> with randomness.keyed(key):
    ...     out = torch.func.functional_call(model, params, (x,))   # nn.Dropout draws from key
"""

from __future__ import annotations

import contextlib
import math
import types
import warnings

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from functrain import ops, rng

__all__ = ["SALT", "KeyedRandomness", "keyed", "warn_unkeyed"]

SALT = 0x6472_6F70  # "drop": keeps these keys apart from a loss's own fold_in(key, small int)

_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946
_ALPHA_PRIME = -_SELU_ALPHA * _SELU_SCALE  # the value alpha dropout sets dropped units to

# Tensor methods written in Python (`Tensor.unflatten`, `split`, `norm`, ...): passed through by
# name, since Dynamo cannot trace their bodies' `super()` calls when it inlines the mode.
_TENSOR_PY_METHODS = frozenset(k for k, v in vars(torch.Tensor).items() if isinstance(v, types.FunctionType))
# Draws no key can stand in for: run from torch's generator, and named once (`warn_unkeyed`).
_UNKEYABLE = (
    torch.randperm,
    torch.multinomial,
    torch.Tensor.multinomial,
    torch.poisson,
    torch.normal,
    torch.Tensor.random_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
    torch.Tensor.geometric_,
)
_UNKEYED: set[str] = set()
_WARNED: set[str] = set()


def _no_override(*args) -> bool:
    return False


def _without_override_check(func):
    """A copy of a torch.nn.functional composite whose entry check for overrides is off."""
    names = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
    globals_ = dict(func.__globals__, **{n: _no_override for n in names})
    copy = types.FunctionType(func.__code__, globals_, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return copy


_MHA = _without_override_check(F.multi_head_attention_forward)
_GUMBEL = _without_override_check(F.gumbel_softmax)


def _arg(args, kwargs, i: int, name: str, default):
    """Argument `name` of a call, given by position `i` or by keyword."""
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _size(args) -> list[int]:
    """The size of a factory call: `rand(2, 3)` or `rand((2, 3))`."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return [int(s) for s in args[0]]
    return [int(s) for s in args]


def _feature_mask_shape(x: torch.Tensor, spatial: int) -> list[int]:
    """The mask shape of a feature dropout: one draw per (batch, channel), broadcast over `spatial` dims."""
    return list(x.shape[:-spatial]) + [1] * spatial


def _active(p: float, training: bool) -> bool:
    """Whether a dropout call drops anything."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    return bool(training) and p > 0.0


def warn_unkeyed() -> None:
    """Warns once for each draw seen under `keyed` that could not be keyed (one `functrain: warning:` line each).

    Example:
      >>> state, metrics = compiled_step(state, batch)
      >>> warn_unkeyed()   # make_train_step's step does this after every call
    """
    for name in sorted(_UNKEYED - _WARNED):
        warnings.warn(
            f"functrain: warning: torch.{name} inside the loss draws from torch's global generator (it "
            f"cannot be keyed): the run is not a function of its seed; pass it a generator=, or draw "
            f"from the step's key (functrain.rng)",
            stacklevel=3,
        )
    _WARNED.update(_UNKEYED)
    _UNKEYED.clear()


def _passed(func, name, args, kwargs):
    """`func` called as it is (a Python-written Tensor method by name: see `_TENSOR_PY_METHODS`)."""
    if name in _TENSOR_PY_METHODS and getattr(torch.Tensor, name) is func:
        return getattr(args[0], name)(*args[1:], **kwargs)
    return func(*args, **kwargs)


class KeyedRandomness(TorchFunctionMode):
    """The torch function mode behind `keyed`: random draws come from `key` (see the module docstring).

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
        name = getattr(func, "__name__", None)
        if name not in _SEEN_NAMES:  # most calls: a few bytecodes for Dynamo to trace, not the whole chain
            return _passed(func, name, args, kwargs)
        if func is F.dropout or func is torch.dropout:
            return self._dropout(func, args, kwargs, 0)
        if func is F.scaled_dot_product_attention:
            return self._sdpa(func, args, kwargs)
        if func is F.dropout1d or func is F.dropout2d or func is F.dropout3d:
            return self._dropout(func, args, kwargs, 1 if func is F.dropout1d else 2 if func is F.dropout2d else 3)
        if func is F.alpha_dropout or func is F.feature_alpha_dropout:
            return self._dropout(func, args, kwargs, 0, alpha=True, feature=func is F.feature_alpha_dropout)
        if func is F.embedding:
            return self._embedding(func, args, kwargs)
        if func is F.multi_head_attention_forward or func is F.gumbel_softmax:
            with self:  # the composite's own draws, seen by this mode
                return (_MHA if func is F.multi_head_attention_forward else _GUMBEL)(*args, **kwargs)
        if "generator" in kwargs and kwargs["generator"] is not None:
            return func(*args, **kwargs)  # the caller's own generator
        drawn = self._draw(func, args, kwargs)
        if drawn is not None:
            return drawn
        return _passed(func, name, args, kwargs)

    def _draw(self, func, args, kwargs):
        """A keyed draw for the random factories, `_like`s, in-place fills and rrelu; None for any other call."""
        if func is torch.rand or func is torch.randn:
            shape, dtype = _size(args), kwargs.get("dtype") or torch.get_default_dtype()
            return self._numbers(func is torch.randn, shape, dtype, kwargs.get("device"))
        if func is torch.rand_like or func is torch.randn_like:
            x = args[0]
            return self._numbers(
                func is torch.randn_like, x.shape, kwargs.get("dtype") or x.dtype, kwargs.get("device") or x.device
            )
        if func is torch.randint or func is torch.randint_like:
            return self._randint(func, args, kwargs)
        if func is torch.bernoulli or func is torch.Tensor.bernoulli or func is torch.Tensor.bernoulli_:
            x = args[0]
            p = _arg(args, kwargs, 1, "p", None)
            probs = x if p is None else p
            keep = (self._uniform(x.shape, x.dtype if x.is_floating_point() else torch.float32) < probs).to(x.dtype)
            return x.copy_(keep) if func is torch.Tensor.bernoulli_ else keep
        if func is torch.Tensor.uniform_ or func is torch.Tensor.normal_ or func is torch.Tensor.exponential_:
            return args[0].copy_(self._fill(func, args, kwargs))
        if func is F.rrelu or func is torch.rrelu:
            return self._rrelu(func, args, kwargs)
        if (
            func is F.fractional_max_pool2d
            or func is F.fractional_max_pool3d
            or func is F.fractional_max_pool2d_with_indices
            or func is F.fractional_max_pool3d_with_indices
        ):
            return self._fractional_max_pool(func, args, kwargs)
        for f in _UNKEYABLE:
            if func is f:
                _UNKEYED.add(func.__name__)
                return func(*args, **kwargs)
        return None

    def _embedding(self, func, args, kwargs):
        """`F.embedding` as `functrain.ops.embedding` (a deterministic compiled backward on CPU), the padding row
        getting no gradient; max_norm, scale_grad_by_freq and sparse keep torch's own."""
        idx, weight = args[0], _arg(args, kwargs, 1, "weight", None)
        padding_idx = _arg(args, kwargs, 2, "padding_idx", None)
        own = (
            _arg(args, kwargs, 3, "max_norm", None) is not None
            or _arg(args, kwargs, 5, "scale_grad_by_freq", False)
            or _arg(args, kwargs, 6, "sparse", False)
        )
        if own or weight.device.type != "cpu":
            return func(*args, **kwargs)
        out = ops.embedding(weight, idx)  # (..., C)
        if padding_idx is None:
            return out
        padding_idx = padding_idx + weight.shape[0] if padding_idx < 0 else padding_idx
        return torch.where((idx == padding_idx)[..., None], out.detach(), out)

    def _next_key(self) -> torch.Tensor:
        """The key of the next drawing call."""
        k = rng.fold_in(self.key, SALT + self.calls)
        self.calls += 1
        return k

    def _uniform(self, shape, dtype) -> torch.Tensor:
        """Uniform [0, 1) numbers of `shape` from the next key."""
        return rng.uniform(self._next_key(), shape, dtype)

    def _numbers(self, normal: bool, shape, dtype, device) -> torch.Tensor:
        """`rand` (uniform [0, 1)) or `randn` (standard normal) numbers from the next key."""
        draw = rng.gaussian if normal else rng.uniform
        out = draw(self._next_key(), shape, dtype)
        return out if device is None else out.to(device)

    def _keep(self, shape, p: float, dtype) -> torch.Tensor:
        """A 0/1 mask in `dtype`, 1 with probability 1 - p."""
        return (self._uniform(shape, dtype) >= p).to(dtype)

    def _randint(self, func, args, kwargs):
        """`randint(high, size)`, `randint(low, high, size)` or `randint_like(x, [low,] high)`."""
        if func is torch.randint_like:
            x, bounds = args[0], list(args[1:])
            shape, dtype, device = x.shape, kwargs.get("dtype") or x.dtype, kwargs.get("device") or x.device
        else:
            bounds, shape = list(args[:-1]), _size(args[-1:])
            dtype, device = kwargs.get("dtype") or torch.int64, kwargs.get("device")
        if "high" in kwargs:
            bounds.append(kwargs["high"])
        low, high = (kwargs.get("low", 0), bounds[0]) if len(bounds) == 1 else bounds
        u = self._uniform(shape, torch.float64)
        out = (torch.floor(u * (high - low)) + low).to(dtype)
        return out if device is None else out.to(device)

    def _fill(self, func, args, kwargs) -> torch.Tensor:
        """The numbers `uniform_(a, b)`, `normal_(mean, std)` or `exponential_(lambd)` would write."""
        x = args[0]
        if func is torch.Tensor.uniform_:
            a, b = _arg(args, kwargs, 1, "from", 0.0), _arg(args, kwargs, 2, "to", 1.0)
            return self._uniform(x.shape, x.dtype) * (b - a) + a
        if func is torch.Tensor.normal_:
            mean, std = _arg(args, kwargs, 1, "mean", 0.0), _arg(args, kwargs, 2, "std", 1.0)
            return rng.gaussian(self._next_key(), x.shape, x.dtype) * std + mean
        lambd = _arg(args, kwargs, 1, "lambd", 1.0)
        return -torch.log1p(-self._uniform(x.shape, x.dtype)) / lambd

    def _rrelu(self, func, args, kwargs):
        """Randomized leaky ReLU: in training each negative input's slope is uniform in [lower, upper]."""
        x = args[0]
        lower, upper = _arg(args, kwargs, 1, "lower", 1.0 / 8), _arg(args, kwargs, 2, "upper", 1.0 / 3)
        if not _arg(args, kwargs, 3, "training", False):
            return func(*args, **kwargs)
        slope = self._uniform(x.shape, x.dtype) * (upper - lower) + lower
        out = torch.where(x >= 0, x, x * slope)
        return x.copy_(out) if _arg(args, kwargs, 4, "inplace", False) and func is F.rrelu else out

    def _fractional_max_pool(self, func, args, kwargs):
        """Fractional max pooling with its random offsets drawn from the next key (the shape torch draws)."""
        if kwargs.get("_random_samples") is not None or len(args) > 5:
            return func(*args, **kwargs)
        x = args[0]
        dims = 2 if func is F.fractional_max_pool2d or func is F.fractional_max_pool2d_with_indices else 3
        batch = 1 if x.dim() == dims + 1 else x.shape[0]
        samples = self._uniform([batch, x.shape[-dims - 1], dims], x.dtype)  # (N, C, dims)
        return func(*args, **dict(kwargs, _random_samples=samples))

    def _dropout(self, func, args, kwargs, spatial: int, alpha: bool = False, feature: bool = False):
        """Any dropout: elementwise (spatial 0), whole channels over `spatial` trailing dims, or alpha
        dropout (which keeps a SELU network's mean and variance; `feature`: per channel)."""
        x, p = args[0], float(_arg(args, kwargs, 1, "p", 0.5))
        training = _arg(args, kwargs, 2, "train" if func is torch.dropout else "training", not alpha)
        if not _active(p, training):  # alpha dropouts default to eval
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


# The names of every function the mode handles (draws, dropouts, SDPA, embedding, the composites, the
# unkeyable ones): a call of any other name passes through after one set lookup. A handled function's
# name may be shared by others (`torch.normal` / `Tensor.normal_` are not the same): those take the
# full identity checks, as before.
_SEEN_NAMES = frozenset(
    f.__name__
    for f in (
        F.dropout,
        torch.dropout,
        F.scaled_dot_product_attention,
        F.dropout1d,
        F.dropout2d,
        F.dropout3d,
        F.alpha_dropout,
        F.feature_alpha_dropout,
        F.embedding,
        F.multi_head_attention_forward,
        F.gumbel_softmax,
        torch.rand,
        torch.randn,
        torch.rand_like,
        torch.randn_like,
        torch.randint,
        torch.randint_like,
        torch.bernoulli,
        torch.Tensor.bernoulli,
        torch.Tensor.bernoulli_,
        torch.Tensor.uniform_,
        torch.Tensor.normal_,
        torch.Tensor.exponential_,
        F.rrelu,
        torch.rrelu,
        F.fractional_max_pool2d,
        F.fractional_max_pool3d,
        F.fractional_max_pool2d_with_indices,
        F.fractional_max_pool3d_with_indices,
        *_UNKEYABLE,
    )
)


def keyed(key: torch.Tensor | None):
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
