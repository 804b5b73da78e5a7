"""The optimizer update group by group (functrain.step.update, compile="blocks").

The reference is `apply_gradients` over the whole tree, run eagerly on the same numbers: without
clipping the grouped update is the same per-element arithmetic, so params and optimizer state must
be bit-identical; with clipping the grad norm is summed in another order (tolerance from _tol.py).
These run the phases eagerly (no compile); test_compile_blocks.py runs them compiled.
"""

from __future__ import annotations

import re

import _tol
import optree
import pytest
import torch

from functrain import init_state, optim
from functrain.models.gpt import make_loss_fn
from functrain.optim.transforms import ScaleByAdamState
from functrain.parallel import LOCAL
from functrain.step import precision as precision_lib
from functrain.step import update as update_lib
from functrain.step.update import apply_gradients, to_master

N_LAYER = 3
NO_NORMS = lambda p: {k: p[k].ndim >= 2 for k in p}  # noqa: E731  # decay matrices only


def _adamw(clip: float | None = None):
    """AdamW with a masked decay and a masked momentum on the MLPs (two kinds of mask), optionally clipped."""
    mlp = lambda p: {k: bool(re.search(r"blocks\.\d+\.mlp\.", k)) for k in p}  # noqa: E731
    parts = [
        optim.masked(optim.trace(0.5), mlp),
        optim.adamw(optim.warmup_cosine(1e-2, 2, 10), weight_decay=0.1, mask=NO_NORMS),
    ]
    return optim.chain(*([optim.clip_by_global_norm(clip)] if clip else []), *parts)


def _setup(tiny_gpt, opt, seed=1):
    """(staged loss, state after one update so the moments are not zero, grads) of a 3-block GPT."""
    model = tiny_gpt(n_layer=N_LAYER, n_embd=32, block_size=16)
    state = init_state(model, opt, seed=0)
    g = torch.Generator().manual_seed(seed)
    grads = lambda: {k: torch.randn(v.shape, generator=g) for k, v in state.params.items()}  # noqa: E731
    state, _ = apply_gradients(state, grads(), opt)
    return make_loss_fn(model, staged=True), state, grads()


def _clone(tree):
    return optree.tree_map(lambda x: x.clone(), tree)


def _finish(opt, groups, *, donate=True, prec="fp32"):
    return update_lib.grouped_update(
        opt, groups, LOCAL, donate=donate, guarded=True, prec=precision_lib.get(prec), piece=lambda f: f
    )


def _exactly_equal(a, b, msg):
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    assert sa == sb, msg
    bad = [i for i, (x, y) in enumerate(zip(la, lb)) if not torch.equal(x, y)]
    assert not bad, f"{msg}: {len(bad)} of {len(la)} leaves differ"


def test_plan_groups_every_block_under_block_0s_names_and_the_rest_apart(tiny_gpt):
    opt = _adamw(clip=1.0)
    loss_fn, state, _ = _setup(tiny_gpt, opt)
    groups, why = update_lib.plan_groups(state.params, loss_fn.blocks, opt)
    assert why == "" and [g.kind for g in groups] == [0] * N_LAYER + [1]
    names = [n for g in groups for n in g.names]
    assert sorted(names) == sorted(state.params) and len(names) == len(set(names))  # each once
    lead = groups[0].as_names
    for i, g in enumerate(groups[:N_LAYER]):
        assert all(n.startswith(f"blocks.{i}.") for n in g.names) and g.as_names == lead
    assert groups[-1].as_names == groups[-1].names and not any(n.startswith("blocks.") for n in groups[-1].names)


@pytest.mark.parametrize("prec", ["fp32", "fp16"])
def test_grouped_update_is_bit_identical_to_the_whole_tree_update(tiny_gpt, prec):
    opt = _adamw()
    loss_fn, state, grads = _setup(tiny_gpt, opt)
    p = precision_lib.get(prec)
    if p.loss_scaling:  # grads as the backward leaves them: scaled (fp16-sized), in fp16
        grads = {k: (g * 1e-3 * state.guard.loss_scale).to(torch.float16) for k, g in grads.items()}
    aux = {"loss": torch.tensor(2.5)}
    master = to_master(grads, state.params, state.guard.loss_scale if p.loss_scaling else None)
    want, want_m = apply_gradients(_clone(state), master, opt, aux=aux, precision=p)
    assert float(want_m["skipped"]) == 0.0
    groups, _ = update_lib.plan_groups(state.params, loss_fn.blocks, opt)
    old = _clone(state)
    got, got_m = _finish(opt, groups, prec=prec)(old, dict(aux), grads)
    _exactly_equal(got.params, want.params, "params")
    _exactly_equal(got.opt_state, want.opt_state, "optimizer state")
    _exactly_equal((got.step, got.guard), (want.step, want.guard), "step and guard")
    assert list(got.params) == list(state.params)  # the input's key order
    assert all(got.params[k] is old.params[k] for k in old.params)  # donated: written in place
    assert set(got_m) == set(want_m)
    for k in want_m:  # the norms are summed per group, then over groups
        _tol.assert_close(got_m[k], want_m[k], _tol.rtol(sum(x.numel() for x in master.values())), msg=k)


def test_grouped_update_with_clipping_equals_the_whole_tree_to_rounding(tiny_gpt):
    opt = _adamw(clip=0.5)  # the clip factor is < 1 here: it scales every update
    loss_fn, state, grads = _setup(tiny_gpt, opt)
    n = sum(x.numel() for x in grads.values())
    want, want_m = apply_gradients(_clone(state), grads, opt)
    assert want_m["grad_norm"] > 0.5
    groups, _ = update_lib.plan_groups(state.params, loss_fn.blocks, opt)
    got, got_m = _finish(opt, groups, donate=False)(state, {}, grads)
    for k in ("grad_norm", "update_norm", "lr"):
        _tol.assert_close(got_m[k], want_m[k], _tol.rtol(n), msg=k)
    # the update is lr-sized and its clip factor is off by rtol(n) at most
    atol = 2 * 1e-2 * _tol.rtol(n)
    _tol.assert_close(got.params, want.params, atol, absolute=True, msg="params")
    _tol.assert_close(got.opt_state, want.opt_state, _tol.rtol(n), msg="optimizer state")


def test_a_non_finite_gradient_skips_every_group(tiny_gpt):
    opt = _adamw(clip=1.0)
    loss_fn, state, grads = _setup(tiny_gpt, opt)
    grads["blocks.1.mlp.fc.weight"][0, 0] = float("nan")
    groups, _ = update_lib.plan_groups(state.params, loss_fn.blocks, opt)
    before = _clone(state)
    got, m = _finish(opt, groups)(state, {"loss": torch.tensor(1.0)}, grads)
    _exactly_equal(got.params, before.params, "params")
    _exactly_equal(got.opt_state, before.opt_state, "optimizer state")
    assert int(got.step) == int(before.step) + 1 and float(m["skipped"]) == 1.0 and int(got.guard.skipped) == 1


def test_plan_keeps_the_whole_tree_update_when_grouping_could_change_the_result(tiny_gpt):
    opt = _adamw()
    loss_fn, state, _ = _setup(tiny_gpt, opt)
    # a mask that singles out block 0: block 0's names are what every block's graph sees
    first = optim.adamw(1e-3, weight_decay=0.1, mask=lambda p: {k: not k.startswith("blocks.0.") for k in p})
    groups, why = update_lib.plan_groups(state.params, loss_fn.blocks, first)
    assert groups is None and "mask" in why and "blocks.1." in why
    # a transform that does not declare itself leafwise (e.g. one normalizing by a global statistic)
    custom = optim.Transform(lambda p: (), lambda u, s, p=None: (u, s))
    groups, why = update_lib.plan_groups(state.params, loss_fn.blocks, optim.chain(custom, optim.sgd(0.1)))
    assert groups is None and "leafwise" in why


def test_leafwise_declarations_compose():
    clip, adamw = optim.clip_by_global_norm(1.0), optim.adamw(1e-3)
    assert adamw.leafwise is True and optim.chain(clip, adamw).leafwise == "norm"
    assert optim.is_leafwise(optim.chain(clip, adamw))
    # clip after another transform sees an unknown norm (the chain passes it to its first part only)
    assert not optim.is_leafwise(optim.chain(adamw, clip))
    assert not optim.is_leafwise(optim.masked(clip, lambda p: p))  # masked does not pass the norm on
    assert optim.is_leafwise(optim.masked(adamw, lambda p: p))


def _optree_nodes(state, names):
    """The reference split: optree's flatten with the full "dict of parameter names" predicate."""
    known = set(names)
    return optree.tree_flatten(
        state, is_leaf=lambda x: isinstance(x, dict) and all(k in known for k in x), none_is_leaf=True
    )


@pytest.mark.parametrize("odd", [False, True])
def test_split_walks_the_state_as_optree_does(odd):
    # the plain-Python walk gives optree's
    # nodes in optree's order and rebuilds the state; a dict whose first key is a parameter name but
    # not all its keys ("odd") makes the split fall back to the full predicate, as it must
    names = ["b.w", "a.w"]

    def t():
        return torch.randn(2)

    inner = {"b.w": t(), "a.w": t()}
    state = (
        ScaleByAdamState(count=torch.zeros((), dtype=torch.int32), mu=dict(inner), nu=dict(inner)),
        [None, {"lr": torch.tensor(0.1)}, (t(), {})],
    )
    if odd:
        state = (*state, {"b.w": t(), "count": t()})
    split = update_lib._Split(state, names)
    nodes, spec = split.flatten(state)
    want, want_spec = _optree_nodes(state, names)
    assert len(nodes) == len(want) and all(a is b for a, b in zip(nodes, want))
    assert split.dicts == [isinstance(x, dict) and all(k in names for k in x) for x in want]
    rebuilt = spec.unflatten(nodes)
    assert optree.tree_structure(rebuilt, none_is_leaf=True) == optree.tree_structure(state, none_is_leaf=True)
    assert all(a is b for a, b in zip(optree.tree_leaves(rebuilt), optree.tree_leaves(state)))
