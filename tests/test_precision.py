"""Mixed precision: bf16/fp16 compute with fp32 master params and optimizer state, in one step."""

from __future__ import annotations

import _tol
import pytest
import torch

from functrain import init_state, make_train_step, optim, tree
from functrain.state import init_guard
from functrain.step import precision

pytestmark = pytest.mark.numeric

STEPS = 20


def _run(model, loss_fn, batches, prec, *, opt=None, compile=False, steps=STEPS):
    """Losses and final state of `steps` steps of AdamW at precision `prec` (fresh state each call)."""
    opt = opt or optim.adamw(3e-3, weight_decay=0.1)
    state = init_state(model, opt, seed=0)
    step = make_train_step(loss_fn, opt, precision=prec, compile=compile)
    losses = []
    for i in range(steps):
        state, m = step(state, batches[i % len(batches)])
        losses.append(float(m["loss"]))
    return losses, state, m


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_low_precision_run_tracks_fp32_and_keeps_fp32_masters(tiny_gpt, batches, gpt_loss_fn, prec):
    model = tiny_gpt(n_layer=2)
    data = batches(model.cfg, 4)
    ref, ref_state, _ = _run(model, gpt_loss_fn(model), data, "fp32")
    low, state, m = _run(model, gpt_loss_fn(model), data, prec)

    # Loss within tolerance of the fp32 run at every step, and it trains as fp32 does.
    diffs = [abs(a - b) for a, b in zip(ref, low)]
    assert max(diffs) < 0.05 * max(ref), (ref, low)
    assert low[-1] < low[0] - 0.5 and abs(low[-1] - ref[-1]) < 0.05
    # ... but it really computed in low precision: not bit-equal to fp32.
    assert ref != low
    # Master params and Adam moments stay fp32.
    assert {p.dtype for p in tree.leaves(state.params)} == {torch.float32}
    adam = state.opt_state[0]
    assert {x.dtype for x in tree.leaves((adam.mu, adam.nu))} == {torch.float32}
    # (The params are not compared: after 20 Adam steps they differ wherever a gradient is near zero,
    # in any two runs; the losses above are the well-conditioned comparison. tests/_tol.py.)
    assert int(state.guard.skipped) == 0
    if prec == "fp16":
        assert float(m["loss_scale"]) == 2.0**16
    else:
        assert "loss_scale" not in m


def test_bf16_compute_runs_the_model_in_bf16(tiny_gpt, batches):
    """The loss function sees bf16 params and gets fp32 master grads back through the step."""
    model = tiny_gpt()
    seen = {}

    def loss_fn(params, batch, key):
        x, y = batch
        seen["dtypes"] = {p.dtype for p in params.values()}
        logits = torch.func.functional_call(model, params, (x,))
        seen["logits"] = logits.dtype
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten()), {}

    state = init_state(model, optim.sgd(0.1), seed=0)
    step = make_train_step(loss_fn, optim.sgd(0.1), precision="bf16", compile=False, donate=False)
    new, _ = step(state, batches(model.cfg, 1)[0])
    assert seen == {"dtypes": {torch.bfloat16}, "logits": torch.bfloat16}
    assert {p.dtype for p in new.params.values()} == {torch.float32}
    # SGD: the fp32 master moved by lr * grad, a change finer than bf16 can represent for some.
    changed = [not torch.equal(new.params[k], state.params[k]) for k in state.params]
    assert all(changed)


def test_fp16_overflow_skips_the_step_and_backs_off_the_scale(tiny_gpt, batches, gpt_loss_fn):
    model = tiny_gpt()
    opt = optim.adamw(1e-3)
    state = init_state(model, opt, seed=0)
    # A scale this large overflows fp16 in the backward: the update must be skipped.
    state = state.replace(guard=init_guard(loss_scale=2.0**40))
    before = tree.map(torch.clone, state)
    prec = precision.Precision(torch.float16, loss_scaling=True, growth_interval=2)
    step = make_train_step(gpt_loss_fn(model), opt, precision=prec, compile=False, donate=True)
    data = batches(model.cfg, 1)[0]
    state, m = step(state, data)
    assert float(m["skipped"]) == 1.0 and float(m["loss_scale"]) == 2.0**40
    for a, b in zip(tree.leaves((state.params, state.opt_state)), tree.leaves((before.params, before.opt_state))):
        assert torch.equal(a, b)
    assert float(state.guard.loss_scale) == 2.0**39 and int(state.step) == 1
    # Back off until the gradients fit, then two good steps double the scale once.
    while float(m["skipped"]):
        state, m = step(state, data)
    scale = float(state.guard.loss_scale)
    assert scale <= 2.0**20
    state, m = step(state, data)
    assert float(m["skipped"]) == 0 and float(state.guard.loss_scale) == 2 * scale
    assert int(state.guard.good_steps) == 0


def test_loss_scale_does_not_change_the_update(tiny_gpt, batches, gpt_loss_fn):
    """Scaling the loss by 2^16 and dividing the grads by it changes nothing but rounding in fp32."""
    model = tiny_gpt()
    opt = optim.sgd(1.0)  # the update is the gradient
    data = batches(model.cfg, 1)[0]
    prec = precision.Precision(torch.float32, loss_scaling=True)
    state = init_state(model, opt)
    ref = make_train_step(gpt_loss_fn(model), opt, compile=False, donate=False)(state, data)[0]
    scaled = make_train_step(gpt_loss_fn(model), opt, precision=prec, compile=False, donate=False)(state, data)[0]
    n = 8 * model.cfg.block_size * 4 * model.cfg.n_embd
    grads = lambda new: {k: state.params[k] - new.params[k] for k in state.params}  # noqa: E731
    _tol.assert_close(grads(scaled), grads(ref), _tol.rtol(n), msg="unscaled grads")


def test_adam_moments_in_bf16(tiny_gpt, batches, gpt_loss_fn):
    model = tiny_gpt()
    data = batches(model.cfg, 4)
    ref, _, _ = _run(model, gpt_loss_fn(model), data, "fp32", steps=10)
    opt = optim.adamw(3e-3, weight_decay=0.1, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16)
    low, state, _ = _run(model, gpt_loss_fn(model), data, "fp32", opt=opt, steps=10)
    adam = state.opt_state[0]
    assert {x.dtype for x in tree.leaves((adam.mu, adam.nu))} == {torch.bfloat16}
    assert {p.dtype for p in state.params.values()} == {torch.float32}
    assert ref != low and max(abs(a - b) for a, b in zip(ref, low)) < 0.05


def test_unknown_precision_is_a_clear_error():
    with pytest.raises(ValueError, match="precision 'fp8' is not known; use 'fp32', 'bf16' or 'fp16'"):
        precision.get("fp8")


@pytest.mark.slow
def test_compiled_fp16_step_matches_eager_with_no_recompiles(tiny_gpt, batches, gpt_loss_fn):
    """Casting and loss scaling live in the loss's compiled graph, the finite check and the update in the next."""
    from torch._dynamo.utils import counters

    model = tiny_gpt()
    data = batches(model.cfg, 2)
    torch._dynamo.reset()
    counters.clear()
    opt = optim.sgd(0.1, momentum=0.9)  # trajectories comparable to rounding (tests/_tol.py)
    eager, _, _ = _run(model, gpt_loss_fn(model), data, "fp16", opt=opt, steps=4)
    compiled, state, _ = _run(model, gpt_loss_fn(model), data, "fp16", opt=opt, steps=4, compile=True)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # the loss and grads, the update
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    # Eager rounds every fp16 op's output, inductor keeps fused intermediates in fp32: the logits
    # differ by fp16 rounding, which moves the (fp32) cross-entropy by at most eps16 relative per step.
    eps16 = torch.finfo(torch.float16).eps
    for i, (a, b) in enumerate(zip(eager, compiled)):
        assert abs(a - b) <= (i + 1) * eps16 * abs(a), (eager, compiled)
    assert {p.dtype for p in state.params.values()} == {torch.float32}


def test_bf16_composes_with_remat_and_the_chunked_loss(tiny_gpt, batches):
    """bf16 + recomputed blocks + chunked CE: the same steps as bf16 with the plain route."""
    from functrain.models.gpt import make_loss_fn as make_gpt_loss_fn

    model = tiny_gpt(n_layer=2, dropout=0.1)
    data = batches(model.cfg, 3)
    opt = optim.sgd(0.1, momentum=0.9)  # trajectories comparable to rounding (tests/_tol.py)
    plain, s_plain, _ = _run(model, make_gpt_loss_fn(model, chunk_size=32), data, "bf16", opt=opt, steps=3)
    remat, s_remat, _ = _run(
        model, make_gpt_loss_fn(model, chunk_size=32, remat="full"), data, "bf16", opt=opt, steps=3
    )
    # Both routes compute in bf16: the reduction-order noise is bf16's (the sums themselves are fp32).
    n = 8 * model.cfg.block_size * 4 * model.cfg.n_embd
    _tol.assert_close(torch.tensor(remat), torch.tensor(plain), _tol.rtol(n, torch.bfloat16) * 3, msg="losses")
    atol = _tol.trajectory_atol(steps=3, gain=_tol.sgd_gain(0.1, 0.9), grad_scale=1.0, n=n, dtype=torch.bfloat16)
    _tol.assert_close(s_remat.params, s_plain.params, atol, absolute=True, msg="params")
