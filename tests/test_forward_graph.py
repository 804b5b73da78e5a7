"""compile=True on one process: the loss's forward one graph, its backward AOTAutograd's, the gradients by autograd
(`functrain.step.grads.grads_by_autograd`), and `adamw(fused=True)`'s update through torch's kernel after it.

The route gives the one-graph route's numbers bit for bit (under `aot_eager` here; under inductor, the default
run's losses: docs/results.md, and tests/test_step_split.py against the whole step compiled as one graph),
calls one graph for every microbatch and never recompiles; with the fused optimizer nothing of the update is
compiled and the numbers equal the compiled update's to float32 rounding.
"""

from __future__ import annotations

import _tol
import pytest
import torch
from torch._dynamo.utils import counters

from functrain import config_checks, init_state, make_train_step, optim, tree
from functrain.models import lm
from functrain.step import grads as grads_lib
from functrain.step import steps as steps_lib
from functrain.trainer import defaults, optimizer_checks
from functrain.trainer import optimizer as trainer_optimizer

AOT = {"backend": "aot_eager"}


def _opt(fused: bool):
    """Clipped AdamW with decay on the matrices only and a schedule (two kernel calls: decayed and not)."""
    decay = lambda params: {k: v.ndim == 2 for k, v in params.items()}  # noqa: E731
    adamw = optim.adamw(optim.warmup_cosine(3e-2, 2, 20), weight_decay=0.1, mask=decay, fused=fused)
    return optim.chain(optim.clip_by_global_norm(0.05), adamw)


def _spy(monkeypatch) -> list:
    """Counts the calls of `grads_lib.grads_by_autograd` (the route this file is about)."""
    calls: list = []
    real = grads_lib.grads_by_autograd

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(grads_lib, "grads_by_autograd", spy)
    return calls


def _run(step, state, data):
    """(state, [metrics of each step])."""
    out = []
    for batch in data:
        state, m = step(state, batch)
        out.append({k: v.clone() for k, v in m.items()})
    return state, out


@pytest.mark.parametrize("accum", [1, 2])
def test_the_forward_graph_is_the_one_graph_route_bit_for_bit(tiny_gpt, batches, gpt_loss_fn, monkeypatch, accum):
    """Microbatches weighted by their target counts (a target masked in one of them), the update clipping: the
    metrics and every param and moment after each step equal the loss-and-grads-one-graph route's exactly."""
    model = tiny_gpt(n_layer=2)
    data = batches(model.cfg, 3)
    for _, y in data:
        y[: 2 * accum - 1, 3:] = -1  # microbatches of unequal target counts
    loss_fn = gpt_loss_fn(model)

    def build():
        return make_train_step(
            loss_fn, _opt(False), accum_steps=accum, compile_options=AOT, count_targets=lm.count_targets()
        )

    calls = _spy(monkeypatch)
    ours, ours_m = _run(build(), init_state(model, _opt(False), seed=0), data)
    assert len(calls) == len(data)  # the route under test ran at every step
    monkeypatch.setattr(steps_lib, "_forward_graph_takes", lambda spec: False)
    joint, joint_m = _run(build(), init_state(model, _opt(False), seed=0), data)
    assert len(calls) == len(data)  # and not for the reference
    for a, b in zip(ours_m, joint_m):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (k, float(a[k]), float(b[k]))
    assert float(ours_m[0]["targets"]) == 8 * 16 - (2 * accum - 1) * 13
    named = tree.named_leaves((ours.params, ours.opt_state))
    for (name, x), y in zip(named, tree.leaves((joint.params, joint.opt_state))):
        assert torch.equal(x, y), name


def test_every_microbatch_calls_one_graph_and_no_step_recompiles(tiny_gpt, batches, gpt_loss_fn):
    """With the fused update the step compiles the loss's forward only: one graph (its backward AOTAutograd's)."""
    model = tiny_gpt(n_layer=2)
    step = make_train_step(gpt_loss_fn(model), _opt(True), accum_steps=4, compile_options=AOT)
    state = init_state(model, _opt(True))
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        _run(step, state, batches(model.cfg, 3))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"], dict(counters["stats"])


def test_the_compiled_fused_step_runs_torchs_kernel_and_equals_the_compiled_update(tiny_gpt, batches, gpt_loss_fn):
    """adamw(fused=True) compiled: the params and moments updated in place by the kernel (no update_norm, no
    update graph); the losses, grad norms and moments equal the compiled update's to float32 rounding (the loss
    graph is the same: the first step's loss is equal)."""
    model = tiny_gpt(n_layer=2)
    data = batches(model.cfg, 4)
    fused, plain = (make_train_step(gpt_loss_fn(model), _opt(f), compile_options=AOT) for f in (True, False))
    a, b = init_state(model, _opt(True), seed=0), init_state(model, _opt(False), seed=0)
    before = [x.data_ptr() for x in tree.leaves((a.params, a.opt_state))]
    counters.clear()
    a, ma = _run(fused, a, data)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # the forward only
    b, mb = _run(plain, b, data)
    assert [x.data_ptr() for x in tree.leaves((a.params, a.opt_state))] == before  # in place
    assert all("update_norm" not in m for m in ma) and all("update_norm" in m for m in mb)
    assert torch.equal(ma[0]["loss"], mb[0]["loss"])
    n = 8 * 16 * 32  # the widest reduction a gradient went through (tokens x width)
    for x, y in zip(ma, mb):
        for k in ("loss", "grad_norm", "lr"):
            _tol.assert_close(x[k], y[k], _tol.rtol(n), msg=k)
    adam_a, adam_b = a.opt_state[1][0], b.opt_state[1][0]
    _tol.assert_close(adam_a.mu, adam_b.mu, _tol.rtol(n), msg="mu")
    _tol.assert_close(adam_a.nu, adam_b.nu, _tol.rtol(n), msg="nu")
    assert int(adam_a.count) == int(adam_b.count) == len(data)


def test_tensors_the_kernel_does_not_take_get_the_compiled_update():
    """Two dtypes among the params: torch's kernel refuses them and the step runs the compiled update."""
    params = {"w": torch.randn(4, 4), "b": torch.randn(4, dtype=torch.float64)}

    def loss_fn(p, batch, key):
        return ((batch @ p["w"]).double() + p["b"]).pow(2).mean()

    step = make_train_step(loss_fn, _opt(True), compile_options=AOT)
    state = init_state(tree.clone(params), _opt(True))
    counters.clear()
    for _ in range(2):  # (the schedule's first rate is 0)
        state, m = step(state, torch.randn(8, 4))
    assert "update_norm" in m and counters["stats"]["unique_graphs"] == 2  # the forward, the whole update
    assert not torch.equal(state.params["w"], params["w"])


def test_the_config_key_checks_its_optimizer_and_moments():
    c = defaults.trainer_config()
    assert c.optim.fused is None  # the default run keeps its compiled update (and its numbers); eager steps the kernel
    unset = trainer_optimizer.from_config(c.optim, 10)
    assert unset.fused is not None and not unset.traits.fused_compiled
    c.optim.fused = False
    assert trainer_optimizer.from_config(c.optim, 10).fused is None
    c.optim.fused = True
    config_checks.check_all(c, optimizer_checks.CHECKS)  # adamw, float32 moments: fine
    assert trainer_optimizer.from_config(c.optim, 10).fused is not None  # the chain ends in the fused kernel
    c.optim.name = "sgd"
    with pytest.raises(ValueError, match=r"^optim.fused=True, optim.name='sgd': the fused update is torch's AdamW"):
        config_checks.check_all(c, optimizer_checks.CHECKS)
    c.optim.name, c.optim.nu_dtype = "adamw", "bfloat16"
    with pytest.raises(ValueError, match=r"optim.nu_dtype='bfloat16': torch's fused AdamW kernel keeps the moments"):
        config_checks.check_all(c, optimizer_checks.CHECKS)
