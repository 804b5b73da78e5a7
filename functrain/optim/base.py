"""The optimizer algebra: `Transform(init, update)`, `chain`, `masked`, `apply_updates`.

Internals: docs/internals.md "functrain.optim.base".

Example:
    >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(3e-4, weight_decay=0.1))
    >>> opt_state = opt.init(params)
    >>> updates, opt_state = opt.update(grads, opt_state, params)
    >>> params = optim.apply_updates(params, updates)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from functrain import tree as tree_lib
from functrain.ops import foreach

__all__ = [
    "Transform",
    "call_update",
    "report",
    "chain",
    "masked",
    "apply_updates",
    "identity",
    "MaskedState",
    "resolve_mask",
    "recording_masks",
    "is_leafwise",
    "Traits",
]

PyTree = Any
InitFn = Callable[[PyTree], PyTree]
UpdateFn = Callable[..., tuple[PyTree, PyTree]]
ReportFn = Callable[[PyTree], dict]


class Traits(NamedTuple):
    """What a transform may say of itself beyond `init` and `update` (every field optional).

    Attributes:
      report: `report(state) -> {metric name: 0-d tensor}`, the metrics it owns (e.g. the learning rate).
      leafwise: True, "norm" (leafwise once handed the global norm) or False (module docstring).
      scale: an eager shortcut (`functrain.optim.fused`): `scale(state, norm) -> 0-d tensor` for a
        transform whose update only multiplies every leaf by that one factor (`clip_by_global_norm`).
      fused: an in-place route through one of torch's fused optimizer kernels (`adamw(fused=...)`).
      fused_compiled: the route also runs after a compiled loss (`adamw(fused=True)`); False: in eager steps only
        (`adamw()`'s default), a compiled step compiling the update as written.
      takes_norm: `update` takes the keyword `norm` (the global L2 norm of its `updates`, when the
        caller has it): `call_update` passes it only then.

    Example:
      >>> optim.Transform(init, update, optim.Traits(leafwise=True))
    """

    report: ReportFn | None = None
    leafwise: bool | str = False
    scale: Callable[[PyTree, Any], Any] | None = None
    fused: Callable[..., Any] | None = None
    fused_compiled: bool = True
    takes_norm: bool = False


_NONE = Traits()


class _Pair(NamedTuple):
    init: InitFn
    update: UpdateFn
    traits: Traits = _NONE


class Transform(_Pair):
    """A gradient transformation: `init(params) -> state` and `update(updates, state, params=None) ->
    (updates, state)`, both pure, as optax's; optionally `traits` (`Traits`: its metrics, whether it
    is leafwise, its fused shortcuts). `t.report`, `t.leafwise`, `t.scale` and `t.fused` read them.

    Example:
      >>> t = optim.Transform(lambda params: (), lambda updates, state, params=None: (updates, state))
    """

    __slots__ = ()

    def __new__(cls, init: InitFn, update: UpdateFn, traits: Traits | None = None) -> Transform:
        return super().__new__(cls, init, update, _NONE if traits is None else traits)

    @property
    def report(self) -> ReportFn | None:
        """`traits.report`."""
        return self.traits.report

    @property
    def leafwise(self) -> bool | str:
        """`traits.leafwise`."""
        return self.traits.leafwise

    @property
    def scale(self) -> Callable[[PyTree, Any], Any] | None:
        """`traits.scale`."""
        return self.traits.scale

    @property
    def fused(self) -> Callable[..., Any] | None:
        """`traits.fused`."""
        return self.traits.fused


def is_leafwise(t: Transform) -> bool:
    """Whether `t` may update a subset of the params on its own when handed the global norm.

    Args:
      t: a transform.

    Returns:
      True when `t.leafwise` is True or "norm" (the train step always passes the norm).

    Example:
      >>> optim.is_leafwise(optim.adamw(1e-3))
      True
    """
    return t.leafwise is True or t.leafwise == "norm"


def report(t: Transform, state: PyTree) -> dict:
    """The metrics transform `t` reports for its state `state` (`{}` if it reports none).

    Args:
      t: a transform (a chain reports what its parts report).
      state: its state, e.g. `train_state.opt_state`.

    Returns:
      {metric name: 0-d tensor}.

    Example:
      >>> optim.report(optim.adamw(1e-3), opt_state)   # {'lr': tensor(0.001)} after an update
    """
    return dict(t.report(state)) if t.report is not None else {}


def call_update(
    t: Transform, updates: PyTree, state: PyTree, params: PyTree = None, *, norm: torch.Tensor | None = None
) -> tuple[PyTree, PyTree]:
    """`t.update(updates, state, params)`, passing `norm` (the global norm of `updates`) when given
    and `t` takes it (`Traits.takes_norm`).

    Args:
      t: the transform.
      updates, state, params: as for `t.update`.
      norm: the global L2 norm of `updates` if the caller has it, else None.

    Returns:
      `(updates, state)` from `t.update`.

    Example:
      >>> updates, opt_state = optim.call_update(opt, grads, opt_state, params, norm=tree.global_norm(grads))
    """
    if norm is not None and t.traits.takes_norm:
        return t.update(updates, state, params, norm=norm)
    return t.update(updates, state, params)


def identity() -> Transform:
    """The transform that leaves updates unchanged and keeps no state.

    Returns:
      A `Transform`.

    Example:
      >>> optim.chain(optim.identity(), optim.sgd(0.1))
    """
    return Transform(lambda params: (), lambda updates, state, params=None: (updates, state), Traits(leafwise=True))


def chain(*transforms: Transform) -> Transform:
    """Applies `transforms` one after the other; the state is the tuple of their states.

    Args:
      *transforms: the transforms, applied left to right.

    Returns:
      A `Transform` whose state is `tuple(t.init(params) for t in transforms)`.

    Example:
      >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.scale_by_adam(),
      ...                   optim.scale_by_learning_rate(1e-3))
    """

    def init(params: PyTree) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(updates: PyTree, state: tuple, params: PyTree = None, norm: torch.Tensor | None = None) -> tuple:
        new_state = []
        for i, (t, s) in enumerate(zip(transforms, state)):
            # `norm` is the norm of the chain's input: only the first transform still sees that.
            updates, s = call_update(t, updates, s, params, norm=norm if i == 0 else None)
            new_state.append(s)
        return updates, tuple(new_state)

    def report_all(state: tuple) -> dict:
        out: dict = {}
        for t, s in zip(transforms, state):
            out.update(report(t, s))
        return out

    # leafwise when every part is; a norm-reading first part keeps the chain norm-reading (the
    # chain passes the norm to its first transform only)
    first, rest = (transforms[0].leafwise, transforms[1:]) if transforms else (True, ())
    whole = (first if first in (True, "norm") else False) if all(t.leafwise is True for t in rest) else False
    fusable = transforms and transforms[-1].fused is not None and all(t.scale is not None for t in transforms[:-1])
    fused = _chain_fused(transforms) if fusable else None
    takes_norm = bool(transforms) and transforms[0].traits.takes_norm
    compiled = not transforms or transforms[-1].traits.fused_compiled
    return Transform(
        init, update, Traits(report_all, whole, fused=fused, fused_compiled=compiled, takes_norm=takes_norm)
    )


def _chain_fused(transforms: tuple) -> Callable[..., Any]:
    """The `fused` route of a chain of scale-only transforms ending in a fused one: the factors become the kernel's
    grad scale."""
    *scalers, last = transforms

    def fused(params: PyTree, grads: PyTree, state: tuple, *, norm: Any, found_inf: Any, grad_scale: Any = None) -> Any:
        for t, s in zip(scalers, state):
            factor = t.scale(s, norm)
            norm = norm * factor  # the norm the next transform sees
            grad_scale = 1.0 / factor if grad_scale is None else grad_scale / factor  # the kernel divides by it
        inner = last.fused(params, grads, state[-1], norm=norm, found_inf=found_inf, grad_scale=grad_scale)
        return None if inner is None else (*state[:-1], inner)

    return fused


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """Returns `params + updates`, leaf by leaf (one fused foreach add), keeping each param's dtype.

    Args:
      params: the parameter tree.
      updates: a tree with the same structure (e.g. from `Transform.update`).

    Returns:
      The new parameter tree (new tensors; the inputs are not modified).

    Example:
      >>> params = optim.apply_updates(params, updates)
    """
    p_leaves, spec = tree_lib.flatten(params)
    u_leaves = spec.flatten_up_to(updates)
    u_leaves = [u.to(p.dtype) for p, u in zip(p_leaves, u_leaves)]
    return spec.unflatten(foreach.add(p_leaves, u_leaves))


_MASK_LOG: list | None = None  # {leaf name: flag} per resolve_mask call inside `recording_masks`


@contextlib.contextmanager
def recording_masks() -> Iterator[list]:
    """Within it, every `resolve_mask` call appends {leaf name: flag} to the list it yields (a grouped update
    checks that masks resolved on a group of leaves give each leaf its flag on the whole tree).

    Example:
      >>> with recording_masks() as log:
      ...     opt.init(params)
    """
    global _MASK_LOG
    before, _MASK_LOG = _MASK_LOG, []
    try:
        yield _MASK_LOG
    finally:
        _MASK_LOG = before


def resolve_mask(mask: PyTree | Callable[[PyTree], PyTree], params: PyTree) -> list[bool]:
    """A mask as one Python bool per leaf of `params`, in flattening order.

    The mask may be the params' whole structure or a prefix of it: a bool where `params` has a
    subtree applies to every leaf below (as optax's masks do).

    Args:
      mask: a bool tree shaped like `params` (or like a prefix of it), or a callable params -> such a tree.
      params: the params (or updates) the mask selects from.

    Returns:
      A list of bools.

    Raises:
      ValueError: the mask's structure is not a prefix of the params' (one line naming both).

    Example:
      >>> resolve_mask({"blocks": True, "head": {"w": True, "b": False}}, params)
      [True, True, ..., False, True]
    """
    if callable(mask):
        mask = mask(params)
    flags, mask_spec = tree_lib.flatten(mask)
    try:
        subtrees = mask_spec.flatten_up_to(params)
    except (ValueError, TypeError):
        raise ValueError(_mask_mismatch(mask, params)) from None
    flat = []
    for flag, sub in zip(flags, subtrees):
        flat.extend([bool(flag)] * len(tree_lib.leaves(sub)))
    if _MASK_LOG is not None:  # functrain.step.update.plan_groups checks masks resolved on a group of leaves
        _MASK_LOG.append({n: f for (n, _), f in zip(tree_lib.named_leaves(params), flat)})
    return flat


def _mask_mismatch(mask: PyTree, params: PyTree) -> str:
    """One short line: the mask's names the optimized params lack, and the optimized params' own (a few of each)."""

    def few(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    mine = [n for n, _ in tree_lib.named_leaves(mask)]
    theirs = [n for n, _ in tree_lib.named_leaves(params)]
    extra = [n for n in mine if n not in set(theirs)]
    what = f"{len(extra)} of its {len(mine)} leaves are not among them ({few(extra)})" if extra else "another structure"
    return (
        f"optim mask: it does not fit the params it masks: {what}; the optimized params are {len(theirs)} leaves "
        f"({few(theirs)}; a LoRA run optimizes its adapters only); give a bool per leaf or per subtree of those, or "
        "a callable params -> mask"
    )


def _selected_names(params: PyTree, flags: list[bool]) -> list[tuple[int, str]]:
    """(position, name) of each selected leaf; a dotted name an earlier leaf has gets `#<position>` appended."""
    names = [n for n, _ in tree_lib.named_leaves(params)]
    used = set()
    out = []
    for i, n in enumerate(names):
        if n in used:
            while n in used or n in names:
                n = f"{n}#{i}"
        used.add(n)
        if flags[i]:
            out.append((i, n))
    return out


class MaskedState(NamedTuple):
    """State of `masked`: the inner transform's state over the selected leaves."""

    inner: PyTree


def masked(inner: Transform, mask: PyTree | Callable[[PyTree], PyTree]) -> Transform:
    """Applies `inner` only to the leaves where `mask` is True; other updates pass unchanged.

    The inner transform sees a dict {dotted leaf name: leaf} of the selected leaves, so its
    state keeps readable names (and checkpoints stay inspectable). Leaves are matched by their
    position in the tree, not by name: where two leaves share a dotted name (a key "a.b" beside
    a nested "a" -> "b"), the later one is seen as "a.b#<position>".

    Args:
      inner: the transform to apply to the selected leaves.
      mask: a tree of Python bools shaped like the params (or like a prefix of them: one bool for a
        whole subtree), or a callable `params -> mask`. It must not depend on tensor values (it is
        resolved outside the compiled graph's data).

    Returns:
      A `Transform`.

    Example:
      >>> no_norms = lambda p: {k: not k.endswith(("bias", "ln.weight")) for k in p}
      >>> optim.masked(optim.add_decayed_weights(0.1), no_norms)
    """

    def select(params: PyTree) -> PyTree:
        """(position, name) of the selected leaves."""
        return _selected_names(params, resolve_mask(mask, params))

    def init(params: PyTree) -> MaskedState:
        leaves = tree_lib.leaves(params)
        return MaskedState(inner.init({n: leaves[i] for i, n in select(params)}))

    def update(updates: PyTree, state: MaskedState, params: PyTree = None) -> tuple[PyTree, MaskedState]:
        if params is None:
            raise ValueError("optim.masked needs params: call update(updates, state, params)")
        chosen = select(params)
        p, spec = tree_lib.flatten(params)
        u = spec.flatten_up_to(updates)
        sub_updates, inner_state = inner.update({n: u[i] for i, n in chosen}, state.inner, {n: p[i] for i, n in chosen})
        merged = list(u)
        for i, n in chosen:
            merged[i] = sub_updates[n]
        return spec.unflatten(merged), MaskedState(inner_state)

    # leafwise when `inner` is (a norm-reading inner is not: masked does not pass the norm on); the
    # mask itself is checked against the full tree before a grouped update uses it
    return Transform(init, update, Traits(lambda state: report(inner, state.inner), inner.leafwise is True))
