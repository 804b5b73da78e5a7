"""Gradient transforms (verbs): each returns a `Transform` of two pure functions.

Internals: docs/internals.md "functrain.optim.transforms".
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

import functrain.metric_names as metric_names
from functrain import ops
from functrain import tree as tree_lib
from functrain.ops import foreach
from functrain.optim.base import Traits, Transform, resolve_mask
from functrain.optim.schedules import Schedule

__all__ = [
    "HyperState",
    "ScaleByAdamState",
    "TraceState",
    "ScaleByLearningRateState",
    "scale_by_adam",
    "add_decayed_weights",
    "clip_by_global_norm",
    "scale_by_learning_rate",
    "scale",
    "trace",
    "learning_rate",
]

PyTree = Any
ScalarOrSchedule = float | torch.Tensor | Schedule | Callable[[torch.Tensor], torch.Tensor]


def _count_like(params: PyTree) -> torch.Tensor:
    """A 0-d int64 zero on the device of the first leaf (the update counter)."""
    leaves = tree_lib.leaves(params)
    device = leaves[0].device if leaves else None
    return torch.zeros((), dtype=torch.int64, device=device)


def _hyper(like: torch.Tensor, **values: Any) -> dict[str, torch.Tensor]:
    """Hyper-parameters as float64 0-d tensors on `like`'s device (a state's `hyper` field)."""
    return {k: torch.as_tensor(v, dtype=torch.float64).to(like.device).clone() for k, v in values.items()}


class ScaleByAdamState(NamedTuple):
    """Adam moments: `count` updates done, first moment `mu`, second moment `nu`; `hyper`: b1, b2, eps."""

    count: torch.Tensor  # type: ignore[assignment]  # optax's field name (it shadows tuple.count)
    mu: PyTree
    nu: PyTree
    hyper: dict = {}


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
) -> Transform:
    """Rescales updates by Adam's bias-corrected moment estimates: `m_hat / (sqrt(v_hat) + eps)`.

    Args:
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator (outside the square root, as torch.optim.Adam).
      mu_dtype: storage dtype of the first moment (default: the param dtype).
      nu_dtype: storage dtype of the second moment (default: `mu_dtype`). Moments stored in
        bf16 halve the optimizer memory; the update math still runs in float32 (each step reads
        them, computes in float32 and rounds the new moments back to their dtype).

    Returns:
      A `Transform` with `ScaleByAdamState`.

    Example:
      >>> opt = optim.chain(optim.scale_by_adam(), optim.scale_by_learning_rate(1e-3))
    """

    def init(params: PyTree) -> PyTree:
        count = _count_like(params)
        return ScaleByAdamState(
            count=count,
            mu=tree_lib.zeros_like(params, dtype=mu_dtype),
            nu=tree_lib.zeros_like(params, dtype=nu_dtype or mu_dtype),
            hyper=_hyper(count, b1=b1, b2=b2, eps=eps),
        )

    def update(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        g, spec = tree_lib.flatten(updates)
        mu_store = spec.flatten_up_to(state.mu)
        nu_store = spec.flatten_up_to(state.nu)
        # Math in the widest of (moment, gradient, float32) dtype; narrow moments are rounded back.
        acc = [_math_dtype(m.dtype, n.dtype, x.dtype) for m, n, x in zip(mu_store, nu_store, g)]
        g = [x.to(a) for x, a in zip(g, acc)]
        mu = [m.to(a) for m, a in zip(mu_store, acc)]
        nu = [n.to(a) for n, a in zip(nu_store, acc)]
        count = state.count + 1
        h = state.hyper
        # Bias corrections in float64 as torch computes them (b2 -> 1); every factor is computed
        # once (hoisted) in float64 and read by the loops as a float32 scalar, as torch's floats are.
        t = count.to(torch.float64)
        inv_bc1, inv_bc2_sqrt, one_minus_b1, b2, one_minus_b2, eps = ops.hoist(
            1.0 / (1.0 - torch.pow(h["b1"], t)),
            torch.rsqrt(1.0 - torch.pow(h["b2"], t)),
            1.0 - h["b1"],
            h["b2"],
            1.0 - h["b2"],
            h["eps"],
        )
        mu = foreach.lerp(mu, g, one_minus_b1)  # m = b1 m + (1 - b1) g
        nu = foreach.mul(nu, b2)
        nu = foreach.addcmul(nu, foreach.mul(g, one_minus_b2), g)  # v = b2 v + (1 - b2) g^2
        # m_hat / (sqrt(v_hat) + eps) with one division per element
        denom = foreach.sqrt(nu)
        denom = foreach.mul(denom, inv_bc2_sqrt)
        denom = foreach.add(denom, eps)
        out = foreach.mul(mu, inv_bc1)
        out = foreach.div(out, denom)
        new_state = ScaleByAdamState(
            count=count,
            mu=spec.unflatten([m.to(s.dtype) for m, s in zip(mu, mu_store)]),
            nu=spec.unflatten([n.to(s.dtype) for n, s in zip(nu, nu_store)]),
            hyper=h,
        )
        return spec.unflatten(list(out)), new_state

    return Transform(init, update, Traits(leafwise=True))


def _math_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The widest of `dtypes` and float32: what Adam computes in."""
    out = torch.float32
    for d in dtypes:
        out = torch.promote_types(out, d)
    return out


class HyperState(NamedTuple):
    """The state of a transform whose only state is its hyper-parameters (weight decay, clip norm)."""

    hyper: dict


def add_decayed_weights(
    weight_decay: float = 0.0, mask: PyTree | Callable[[PyTree], PyTree] | None = None
) -> Transform:
    """Adds `weight_decay * param` to the updates (decoupled weight decay once scaled by -lr).

    Args:
      weight_decay: the decay coefficient.
      mask: optional tree of Python bools (or callable `params -> tree`); False leaves get no decay
        (biases and norm scales, typically).

    Returns:
      A `Transform` (it needs `params` in `update`) whose state holds `hyper["weight_decay"]`.

    Example:
      >>> decay_matrices = lambda p: {k: v.ndim >= 2 for k, v in p.items()}
      >>> optim.add_decayed_weights(0.1, mask=decay_matrices)
    """

    def init(params: PyTree) -> PyTree:
        return HyperState(_hyper(_count_like(params), weight_decay=weight_decay))

    def update(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        if params is None:
            raise ValueError("add_decayed_weights needs params: call update(updates, state, params)")
        u, spec = tree_lib.flatten(updates)
        p = spec.flatten_up_to(params)
        flags = resolve_mask(mask, params) if mask is not None else [True] * len(u)
        idx = [i for i, f in enumerate(flags) if f]
        if idx:  # u + wd p (wd is a state tensor: a sweep over it, 0 included, is one graph)
            (wd,) = ops.hoist(state.hyper["weight_decay"])
            scaled = foreach.mul([p[i].to(u[i].dtype) for i in idx], wd)
            for i, d in zip(idx, foreach.add([u[i] for i in idx], scaled)):
                u[i] = d
        return spec.unflatten(u), state

    return Transform(init, update, Traits(leafwise=True))


def clip_by_global_norm(max_norm: float) -> Transform:
    """Scales all updates by `min(1, max_norm / (global_norm + 1e-6))`, as `clip_grad_norm_`.

    Args:
      max_norm: the largest allowed global L2 norm.

    Returns:
      A `Transform` whose state holds `hyper["clip"]`.

    Example:
      >>> optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
    """

    def init(params: PyTree) -> PyTree:
        return HyperState(_hyper(_count_like(params), clip=max_norm))

    def update(
        updates: PyTree, state: Any, params: PyTree = None, norm: torch.Tensor | None = None
    ) -> tuple[PyTree, Any]:
        u, spec = tree_lib.flatten(updates)
        if norm is None:  # not given by the caller (see optim.call_update)
            norm = tree_lib.global_norm(u)
        (coef,) = ops.hoist(_clip_factor(state, norm))
        return spec.unflatten(foreach.mul(u, coef)), state

    return Transform(init, update, Traits(leafwise="norm", scale=_clip_factor, takes_norm=True))


def _clip_factor(state: HyperState, norm: torch.Tensor) -> torch.Tensor:
    """`min(1, max_norm / (norm + 1e-6))` in the norm's dtype, as torch.nn.utils.clip_grad_norm_ computes it."""
    return torch.clamp(state.hyper["clip"].to(norm.dtype) / (norm + 1e-6), max=1.0)


class TraceState(NamedTuple):
    """Momentum buffer of `trace`; `hyper`: momentum."""

    trace: PyTree
    hyper: dict = {}


def trace(decay: float, nesterov: bool = False) -> Transform:
    """Momentum: `t = decay * t + g`; returns `t` (or `g + decay * t` with Nesterov), as torch SGD.

    Args:
      decay: the momentum coefficient.
      nesterov: use Nesterov momentum.

    Returns:
      A `Transform` with `TraceState`.

    Example:
      >>> optim.chain(optim.trace(0.9), optim.scale_by_learning_rate(0.1))
    """

    def init(params: PyTree) -> PyTree:
        return TraceState(tree_lib.zeros_like(params), _hyper(_count_like(params), momentum=decay))

    def update(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        g, spec = tree_lib.flatten(updates)
        t = spec.flatten_up_to(state.trace)
        (momentum,) = ops.hoist(state.hyper["momentum"])
        t = foreach.add(foreach.mul(t, momentum), g)
        out = foreach.add(g, foreach.mul(t, momentum)) if nesterov else t
        return spec.unflatten(list(out)), TraceState(spec.unflatten(list(t)), state.hyper)

    return Transform(init, update, Traits(leafwise=True))


def scale(factor: float) -> Transform:
    """Multiplies updates by a constant `factor` (a Python number baked into the graph; use
    `scale_by_learning_rate` for a value that changes without a recompile).

    Args:
      factor: the multiplier.

    Returns:
      A stateless `Transform`.

    Example:
      >>> opt = optim.chain(optim.scale_by_adam(), optim.scale(-1e-3))
    """

    def update(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        u, spec = tree_lib.flatten(updates)
        return spec.unflatten(foreach.mul(u, factor)), state

    return Transform(lambda params: (), update, Traits(leafwise=True))


class ScaleByLearningRateState(NamedTuple):
    """Update counter, the learning rate used by the latest update (for logging), and `hyper`: the
    rate ("lr") or its schedule's constants."""

    count: torch.Tensor  # type: ignore[assignment]  # optax's field name (it shadows tuple.count)
    lr: torch.Tensor
    hyper: dict = {}


def _rate_tensor(rate: Any, count: torch.Tensor) -> torch.Tensor:
    """A learning-rate callable's answer as a tensor on the count's device (a Python number becomes a float32 one)."""
    if isinstance(rate, torch.Tensor):
        return rate
    if isinstance(rate, numbers.Real) and not isinstance(rate, bool):
        return torch.tensor(float(rate), dtype=torch.float32, device=count.device)
    raise TypeError(
        f"the learning-rate callable returned {type(rate).__name__}; return a float or a 0-d tensor "
        "(for example a functrain.optim schedule)"
    )


def rate_at(learning_rate: ScalarOrSchedule, count: torch.Tensor, hyper: dict) -> torch.Tensor:
    """The rate `scale_by_learning_rate(learning_rate)` uses at `count` with its state's constants `hyper`.

    Args:
      learning_rate: a float, a 0-d tensor, a `Schedule` or a callable `count -> float or 0-d tensor`.
      count: the number of updates done so far (int64 0-d tensor).
      hyper: the state's constants (a schedule's, or {"lr": ...} for a constant rate).

    Returns:
      A 0-d tensor.

    Example:
      >>> rate_at(optim.constant(1e-3), state.count, state.hyper)
    """
    if isinstance(learning_rate, Schedule):
        return learning_rate.at(count, hyper)
    if callable(learning_rate):
        return _rate_tensor(learning_rate(count), count)
    return hyper["lr"]


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, flip_sign: bool = True) -> Transform:
    """Multiplies updates by `-learning_rate(count)` (a descent step).

    Args:
      learning_rate: a float, a 0-d tensor, or a schedule `count -> lr` (see `optim.schedules`; any
        callable returning a float or a 0-d tensor) evaluated on the number of updates done so far
        (0 for the first update).
      flip_sign: negate (descent). Set False for ascent.

    Returns:
      A `Transform` with `ScaleByLearningRateState`; `optim.learning_rate(opt_state)` reads the
      rate of the latest update back from it.

    Example:
      >>> optim.scale_by_learning_rate(optim.warmup_cosine(3e-4, 100, 5000))
    """

    defaults: dict[str, Any]
    if isinstance(learning_rate, Schedule):
        defaults = learning_rate.hyper
    elif callable(learning_rate):  # a plain function: its constants are its own (not settable)
        defaults = {}
    else:
        defaults = {"lr": learning_rate}

    def lr_at(count: torch.Tensor, hyper: dict) -> torch.Tensor:
        return rate_at(learning_rate, count, hyper)

    def init(params: PyTree) -> PyTree:
        count = _count_like(params)
        return ScaleByLearningRateState(
            count=count, lr=torch.zeros((), dtype=torch.float32, device=count.device), hyper=_hyper(count, **defaults)
        )

    def update(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        rate = lr_at(state.count, state.hyper)
        (factor,) = ops.hoist(-rate if flip_sign else rate)
        u, spec = tree_lib.flatten(updates)
        out = foreach.mul(u, factor)
        lr = rate.to(torch.float32)
        return spec.unflatten(list(out)), ScaleByLearningRateState(state.count + 1, lr, state.hyper)

    return Transform(init, update, Traits(lambda state: {metric_names.LR: state.lr}, leafwise=True))


def learning_rate(opt_state: PyTree) -> torch.Tensor | None:
    """The learning rate of the latest update, found in `opt_state` (None if there is none).

    A convenience for states built by `scale_by_learning_rate`; the train step asks the optimizer
    instead (`optim.report`), which also covers custom schedule transforms.

    Args:
      opt_state: an optimizer state containing a `ScaleByLearningRateState`.

    Returns:
      A 0-d float32 tensor, or None.

    Example:
      >>> lr = optim.learning_rate(state.opt_state)
    """
    found = []

    def visit(node: Any) -> Any:
        if isinstance(node, ScaleByLearningRateState):
            found.append(node.lr)
            return True
        return False

    optree.tree_flatten(opt_state, is_leaf=visit)
    return found[0] if found else None
