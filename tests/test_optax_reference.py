"""functrain.optim against optax (the real package, on jax's CPU backend) on the same numbers: masks
(a dotted key beside a nested one, a prefix mask), the config's warm-up and a learning-rate callable
that returns a Python float."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import optax
import optree
import pytest
import torch

from functrain import optim
from functrain.trainer import optimizer as trainer_optimizer
from functrain.trainer.defaults import trainer_config as default_config

pytestmark = pytest.mark.numeric

STEPS = 8
EPS32 = float(np.finfo(np.float32).eps)


def _grads(tree, steps=STEPS, seed=0):
    """`steps` gradient trees shaped like `tree` (numpy float32), the same for both libraries."""
    rng = np.random.default_rng(seed)
    leaves, spec = optree.tree_flatten(tree)
    return [spec.unflatten([rng.standard_normal(np.shape(x)).astype(np.float32) for x in leaves]) for _ in range(steps)]


def _run(transform, params, grads, to_lib):
    """Updates of `transform` for each gradient tree, as numpy; leaves go in through `to_lib` (params fixed: the
    transforms read them only for masks and decay)."""
    p = optree.tree_map(to_lib, params)
    state = transform.init(p)
    out = []
    for g in grads:
        u, state = transform.update(optree.tree_map(to_lib, g), state, p)
        out.append(optree.tree_map(lambda x: np.asarray(x).copy(), u))
    return out


def _run_ours(transform, params, grads):
    """functrain.optim on torch tensors."""
    return _run(transform, params, grads, torch.from_numpy)


def _run_optax(transform, params, grads):
    """optax on jax arrays."""
    return _run(transform, params, grads, jnp.asarray)


def _assert_updates_close(ours, theirs, atol):
    for step, (a, b) in enumerate(zip(ours, theirs)):
        la, sa = optree.tree_flatten(a)
        lb, sb = optree.tree_flatten(b)
        assert sa == sb, (step, sa, sb)
        for x, y in zip(la, lb):
            np.testing.assert_allclose(x, y, rtol=0, atol=atol, err_msg=f"update {step}")


def _params():
    rng = np.random.default_rng(1)
    return {"a.b": rng.standard_normal(3).astype(np.float32), "a": {"b": rng.standard_normal(3).astype(np.float32)}}


def test_masked_keeps_a_dotted_key_and_a_nested_key_apart():
    """{"a.b": x, "a": {"b": y}}: both leaves are named "a.b"; each must get its own trace (optax's numbers)."""
    params = _params()
    grads = _grads(params)
    mask = {"a.b": True, "a": {"b": True}}
    ours = _run_ours(optim.masked(optim.trace(0.9), mask), params, grads)
    theirs = _run_optax(optax.masked(optax.trace(0.9), mask), params, grads)
    # a trace sums at most 1 / (1 - 0.9) = 10 unit-size gradients: a few ulp of 10 per step
    _assert_updates_close(ours, theirs, atol=STEPS * 4 * EPS32 * 10)
    assert not np.allclose(ours[-1]["a.b"], ours[-1]["a"]["b"])  # two different gradients, two different traces


def test_masked_with_one_leaf_of_a_clashing_name_selected():
    params = _params()
    grads = _grads(params, seed=2)
    for mask in ({"a.b": False, "a": {"b": True}}, {"a.b": True, "a": {"b": False}}):
        ours = _run_ours(optim.masked(optim.trace(0.9), mask), params, grads)
        theirs = _run_optax(optax.masked(optax.trace(0.9), mask), params, grads)
        _assert_updates_close(ours, theirs, atol=STEPS * 4 * EPS32 * 10)


@pytest.mark.parametrize(
    "mask, decayed",
    [
        ({"nested": False, "w": True}, {"w": True, "a": False, "b": False}),
        ({"nested": True, "w": False}, {"w": False, "a": True, "b": True}),
        ({"nested": {"a": True, "b": False}, "w": True}, {"w": True, "a": True, "b": False}),
    ],
    ids=["off", "on", "full"],
)
def test_a_prefix_mask_selects_whole_subtrees_as_optax_does(mask, decayed):
    rng = np.random.default_rng(3)
    params = {
        "w": rng.standard_normal((4, 3)).astype(np.float32),
        "nested": {"a": rng.standard_normal(3).astype(np.float32), "b": rng.standard_normal(2).astype(np.float32)},
    }
    grads = _grads(params, seed=4)
    lr, wd = 1e-2, 0.5
    ours = _run_ours(optim.adamw(lr, 0.9, 0.999, 1e-8, wd, mask=mask), params, grads)
    theirs = _run_optax(optax.adamw(lr, 0.9, 0.999, 1e-8, weight_decay=wd, mask=mask), params, grads)
    pmax = max(float(np.abs(x).max()) for x in optree.tree_leaves(params))
    _assert_updates_close(ours, theirs, atol=_adam_atol(lr, 0.999) + 4 * EPS32 * lr * wd * pmax)
    everywhere = _run_ours(optim.adamw(lr, 0.9, 0.999, 1e-8, wd), params, grads)[0]
    got = {"w": ours[0]["w"], "a": ours[0]["nested"]["a"], "b": ours[0]["nested"]["b"]}
    full = {"w": everywhere["w"], "a": everywhere["nested"]["a"], "b": everywhere["nested"]["b"]}
    assert {k: bool(np.array_equal(got[k], full[k])) for k in got} == decayed  # the decay is where the mask says


def _adam_atol(lr, b2):
    """Adam's step is <= lr, within a few ulp; optax rounds the bias correction 1 - b2^t to float32 (an error of
    eps32 / (1 - b2) relative at the first step, half of it after the square root) where functrain keeps float64."""
    return lr * (16 * EPS32 + EPS32 / (1 - b2))


def test_a_mask_that_is_no_prefix_of_the_params_is_one_line():
    params = {"w": torch.zeros(2), "nested": {"a": torch.zeros(2)}}
    opt = optim.masked(optim.trace(0.9), {"w": True, "other": False})
    with pytest.raises(ValueError, match=r"^optim mask: it does not fit the params it masks: 1 of its 2") as info:
        opt.init(params)
    assert "\n" not in str(info.value) and "(other)" in str(info.value) and "2 leaves (nested.a, w;" in str(info.value)
    adapters = {f"layer{i}.lora_A.weight": torch.randn(64, 64) for i in range(40)}
    base_mask = {f"layer{i}.weight": True for i in range(40)}  # a mask over the base, where LoRA trains the adapters
    opt = optim.adamw(1e-3, mask=base_mask)
    with pytest.raises(ValueError) as info:
        opt.update(adapters, opt.init(adapters), adapters)
    assert len(str(info.value)) < 500 and "tensor(" not in str(info.value) and "40 of its 40 leaves" in str(info.value)


def _config_lrs(steps, warmup, schedule, from_zero=None):
    c = default_config().optim
    c.schedule, c.warmup_steps, c.lr, c.min_lr = schedule, warmup, 6e-4, 6e-5
    if from_zero is not None:
        c.warmup_from_zero = from_zero
    sched = trainer_optimizer.schedule_from_config(c, steps)
    return [float(sched(torch.tensor(t))) for t in range(steps + 3)], c


def test_the_configs_warmup_starts_above_zero_as_nanogpt_does():
    """The first update's rate is lr / (W + 1) (nanoGPT's `lr * (it + 1) / (warmup_iters + 1)`), not 0."""
    steps, warmup = 50, 4
    lrs, c = _config_lrs(steps, warmup, "cosine")
    assert c.warmup_from_zero is False  # the default
    assert lrs[: warmup + 1] == pytest.approx(
        [6e-4 * (t + 1) / (warmup + 1) for t in range(warmup)] + [6e-4], rel=EPS32
    )
    assert lrs[0] > 0

    def nanogpt(it):  # nanoGPT train.py's get_lr (lr_decay_iters = steps)
        if it < warmup:
            return c.lr * (it + 1) / (warmup + 1)
        if it > steps:
            return c.min_lr
        ratio = (it - warmup) / (steps - warmup)
        return c.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c.lr - c.min_lr)

    assert lrs == pytest.approx([nanogpt(t) for t in range(steps + 3)], rel=4 * EPS32)
    theirs = optax.warmup_cosine_decay_schedule(c.lr / (warmup + 1), c.lr, warmup, steps, c.min_lr)
    assert lrs == pytest.approx([float(theirs(t)) for t in range(steps + 3)], rel=8 * EPS32)


def test_the_old_warmup_from_zero_is_still_reachable():
    steps, warmup = 50, 4
    lrs, c = _config_lrs(steps, warmup, "cosine", from_zero=True)
    assert lrs[: warmup + 1] == pytest.approx([6e-4 * t / warmup for t in range(warmup + 1)], rel=EPS32, abs=0)
    assert lrs[0] == 0.0
    theirs = optax.warmup_cosine_decay_schedule(0.0, c.lr, warmup, steps, c.min_lr)
    assert lrs == pytest.approx([float(theirs(t)) for t in range(steps + 3)], rel=8 * EPS32)


@pytest.mark.parametrize("schedule", ["constant", "linear"])
def test_every_config_schedule_warms_up_from_the_same_first_rate(schedule):
    warmup = 4
    lrs, c = _config_lrs(50, warmup, schedule)
    assert lrs[: warmup + 1] == pytest.approx(
        [c.lr * (t + 1) / (warmup + 1) for t in range(warmup)] + [c.lr], rel=EPS32
    )
    lrs0, _ = _config_lrs(50, warmup, schedule, from_zero=True)
    assert lrs0[0] == 0.0 and lrs0[warmup] == pytest.approx(c.lr, rel=EPS32)


def test_the_first_update_of_a_config_optimizer_moves_the_params():
    c = default_config().optim
    opt = trainer_optimizer.from_config(c, 1000)
    params = {"w": torch.ones(3, 3)}
    state = opt.init(params)
    updates, _ = opt.update({"w": torch.full((3, 3), 0.5)}, state, params)
    assert float(updates["w"].abs().min()) > 0


def test_a_learning_rate_callable_may_return_a_python_float():
    params = {"w": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)}
    grads = _grads(params, seed=5)
    ours = _run_ours(optim.sgd(lambda count: 0.1, momentum=0.9), params, grads)
    theirs = _run_optax(optax.sgd(lambda count: 0.1, momentum=0.9), params, grads)
    _assert_updates_close(ours, theirs, atol=STEPS * 4 * EPS32 * 0.1 * 10)
    ours = _run_ours(optim.adamw(lambda count: 1e-2, weight_decay=0.0), params, grads)
    theirs = _run_optax(optax.adamw(lambda count: 1e-2, weight_decay=0.0), params, grads)
    _assert_updates_close(ours, theirs, atol=_adam_atol(1e-2, 0.999))


def test_a_learning_rate_callable_returning_something_else_is_one_line():
    opt = optim.sgd(lambda count: "0.1")
    params = {"w": torch.zeros(2)}
    with pytest.raises(TypeError, match="^the learning-rate callable returned str; return a float or a 0-d tensor"):
        opt.update({"w": torch.ones(2)}, opt.init(params), params)
