"""functrain.optim against torch.optim (same model, same data) and against closed-form values."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from functrain import apply_gradients, init_state, optim, tree, value_and_grad
from functrain.models import gpt

pytestmark = pytest.mark.numeric

STEPS = 20


def _decay_mask(params):
    """Weight decay on matrices only (biases and LayerNorm scales get none)."""
    return {name: p.ndim >= 2 for name, p in params.items()}


def _torch_groups(model, weight_decay, masked):
    """torch param groups equivalent to `_decay_mask` (or one group when not masked)."""
    if not masked:
        return [{"params": list(model.parameters()), "weight_decay": weight_decay}]
    return [
        {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]


def _run_pair(model, data, opt, make_torch_opt, schedule, peak_lr, clip=None, loss_fn=None):
    """Trains `model` with functrain's optimizer and with torch.optim, side by side, on the SAME
    gradients: each step's gradient is taken once (at functrain's params) and given to both.

    So only the optimizers' arithmetic differs (well-conditioned; tests/_tol.py). Computing each
    side's own gradients would let Adam turn reduction-order noise in near-zero gradients into
    full-size steps, a difference of the two forward passes, not of the optimizers.

    Returns (functrain losses, torch losses, functrain grad norms, final functrain params,
    the torch reference module).
    """
    state = init_state(model, opt)
    ref = copy.deepcopy(model)
    topt = make_torch_opt(ref)
    sched = torch.optim.lr_scheduler.LambdaLR(topt, lambda k: float(schedule(torch.tensor(k))) / peak_lr)
    ours, theirs, gnorms = [], [], []
    for x, y in data:
        loss, _, grads = value_and_grad(loss_fn(model), state.params, (x, y), None)
        state, m = apply_gradients(state, grads, opt, aux={"loss": loss})
        ours.append(float(m["loss"]))
        gnorms.append(float(m["grad_norm"]))
        # The lr functrain reports is the one it used for this update: the same as torch's now.
        assert float(m["lr"]) == pytest.approx(topt.param_groups[0]["lr"], rel=1e-6, abs=1e-12)
        with torch.no_grad():
            theirs.append(float(gpt.cross_entropy(ref(x), y)))
        for name, p in ref.named_parameters():
            p.grad = grads[name].clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        topt.step()
        sched.step()
    assert int(state.step) == len(data)
    return ours, theirs, gnorms, state.params, ref


def _update_atol(peak_lr, params, steps=STEPS):
    """Per step: the two updates differ by a few ulp of the update (<= peak_lr in size), and
    `p + u` rounds by eps |p|; summed over the steps."""
    eps = torch.finfo(torch.float32).eps
    pmax = max(float(p.abs().max()) for p in params.values())
    return steps * (8 * eps * peak_lr + eps * pmax)


def _assert_params_close(params, ref, atol):
    names = [n for n, _ in ref.named_parameters()]
    assert list(params) == names  # same names, same (fixed) order
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("masked", [True, False], ids=["decay_mask", "decay_all"])
def test_adamw_clip_warmup_cosine_matches_torch(tiny_gpt, batches, gpt_loss_fn, masked):
    model = tiny_gpt(n_layer=1, bias=True)
    # b2 = 0.999 (torch's and adamw's default) is where float32 bias corrections drift from torch.
    peak, wd, clip, betas = 1e-2, 0.1, 0.5, (0.9, 0.999)
    schedule = optim.warmup_cosine(peak, warmup_steps=5, decay_steps=STEPS, end_value=1e-3)
    opt = optim.chain(
        optim.clip_by_global_norm(clip),
        optim.adamw(schedule, *betas, 1e-8, wd, mask=_decay_mask if masked else None),
    )

    def torch_opt(ref):
        return torch.optim.AdamW(_torch_groups(ref, wd, masked), lr=peak, betas=betas, eps=1e-8)

    ours, theirs, gnorms, params, ref = _run_pair(
        model, batches(model.cfg, STEPS), opt, torch_opt, schedule, peak, clip=clip, loss_fn=gpt_loss_fn
    )
    assert max(gnorms) > clip  # the clipping path is exercised
    atol = _update_atol(peak, params)
    _assert_params_close(params, ref, atol=atol)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=10 * atol)
    # Sanity: the run moved the weights far more than the tolerance.
    assert (params["wte.weight"] - model.wte.weight).abs().max() > 1e-2


@pytest.mark.parametrize(
    "momentum,nesterov,weight_decay",
    [(0.0, False, 0.0), (0.9, False, 0.05), (0.9, True, 0.05)],
    ids=["plain", "momentum_wd", "nesterov_wd"],
)
def test_sgd_matches_torch(tiny_gpt, batches, gpt_loss_fn, momentum, nesterov, weight_decay):
    model = tiny_gpt(n_layer=1, bias=True)
    lr = 0.1
    schedule = optim.linear_warmup(lr, warmup_steps=4)
    opt = optim.sgd(schedule, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, mask=_decay_mask)

    def torch_opt(ref):
        return torch.optim.SGD(_torch_groups(ref, weight_decay, True), lr=lr, momentum=momentum, nesterov=nesterov)

    ours, theirs, _, params, ref = _run_pair(
        model, batches(model.cfg, STEPS), opt, torch_opt, schedule, lr, loss_fn=gpt_loss_fn
    )
    atol = _update_atol(lr, params)
    _assert_params_close(params, ref, atol=atol)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=10 * atol)
    assert ours[-1] < ours[0]  # it actually trains


# ---------------------------------------------------------------------------------------------
# Schedules: closed form in Python floats.

COUNTS = [0, 1, 2, 5, 9, 10, 11, 50, 99, 100, 101, 250]


def _at(schedule, count):
    out = schedule(torch.tensor(count, dtype=torch.int64))
    assert out.shape == () and out.dtype == torch.float32
    return float(out)


def test_constant_schedule():
    for c in COUNTS:
        assert _at(optim.constant(3e-4), c) == pytest.approx(3e-4, rel=1e-6)


def test_linear_schedule():
    init, end, steps, begin = 1.0, 0.1, 90, 10
    sched = optim.linear(init, end, steps, transition_begin=begin)
    for c in COUNTS:
        frac = min(max((c - begin) / steps, 0.0), 1.0)
        assert _at(sched, c) == pytest.approx(init + (end - init) * frac, rel=1e-6), c
    with pytest.raises(ValueError):
        optim.linear(1.0, 0.0, 0)


def test_linear_warmup_schedule():
    sched = optim.linear_warmup(2e-3, warmup_steps=10, init_value=1e-4)
    for c in COUNTS:
        want = 1e-4 + (2e-3 - 1e-4) * min(c / 10, 1.0)
        assert _at(sched, c) == pytest.approx(want, rel=1e-6), c
    for c in COUNTS:  # no warm-up: constant
        assert _at(optim.linear_warmup(2e-3, 0), c) == pytest.approx(2e-3, rel=1e-6)


@pytest.mark.parametrize("warmup", [0, 10])
def test_warmup_cosine_schedule(warmup):
    peak, end, init, decay = 3e-3, 3e-4, 1e-5, 100
    sched = optim.warmup_cosine(peak, warmup, decay, end_value=end, init_value=init)

    def want(c):
        if c < warmup:
            return init + (peak - init) * c / warmup
        frac = min((c - warmup) / (decay - warmup), 1.0)
        return end + 0.5 * (peak - end) * (1 + math.cos(math.pi * frac))

    for c in COUNTS:
        assert _at(sched, c) == pytest.approx(want(c), rel=1e-5, abs=1e-9), c
    assert _at(sched, warmup) == pytest.approx(peak, rel=1e-6)
    assert _at(sched, decay) == pytest.approx(end, rel=1e-6)
    with pytest.raises(ValueError):
        optim.warmup_cosine(peak, 10, 10)


# ---------------------------------------------------------------------------------------------
# The algebra.


def _params():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=g),
        "b": torch.randn(4, generator=g),
        "ln.weight": torch.randn(4, generator=g),
    }


def _grads():
    g = torch.Generator().manual_seed(1)
    return {k: torch.randn(v.shape, generator=g) for k, v in _params().items()}


def test_masked_applies_inner_only_where_true():
    params, grads = _params(), _grads()
    mask = {"w": True, "b": False, "ln.weight": True}
    for m in (mask, lambda p: mask):  # a bool tree or a callable
        t = optim.masked(optim.scale(3.0), m)
        state = t.init(params)
        out, state = t.update(grads, state, params)
        assert list(out) == list(grads)
        torch.testing.assert_close(out["w"], 3.0 * grads["w"], rtol=0, atol=0)
        torch.testing.assert_close(out["ln.weight"], 3.0 * grads["ln.weight"], rtol=0, atol=0)
        assert torch.equal(out["b"], grads["b"])


def test_masked_inner_state_only_holds_selected_leaves():
    params, grads = _params(), _grads()
    t = optim.masked(optim.chain(optim.trace(0.5), optim.scale(1.0)), lambda p: {k: v.ndim >= 2 for k, v in p.items()})
    state = t.init(params)
    assert isinstance(state, optim.MaskedState)
    trace_state = state.inner[0]
    assert list(trace_state.trace) == ["w"]
    _, state = t.update(grads, state, params)
    _, state = t.update(grads, state, params)
    torch.testing.assert_close(state.inner[0].trace["w"], 1.5 * grads["w"])  # 0.5 g + g
    with pytest.raises(ValueError):
        t.update(grads, state)  # masked needs params


def test_chain_applies_in_order_and_keeps_a_tuple_of_states():
    params, grads = _params(), _grads()
    wd = optim.add_decayed_weights(0.5)
    a = optim.chain(wd, optim.scale(2.0))
    b = optim.chain(optim.scale(2.0), wd)
    sa, sb = a.init(params), b.init(params)
    assert isinstance(sa, tuple) and len(sa) == 2 and sa[1] == () and float(sa[0].hyper["weight_decay"]) == 0.5
    ua, _ = a.update(grads, sa, params)
    ub, _ = b.update(grads, sb, params)
    for k in params:
        torch.testing.assert_close(ua[k], 2.0 * (grads[k] + 0.5 * params[k]))
        torch.testing.assert_close(ub[k], 2.0 * grads[k] + 0.5 * params[k])
    s = optim.chain(optim.trace(0.9), optim.scale_by_learning_rate(0.1)).init(params)
    assert isinstance(s[0], optim.TraceState) and isinstance(s[1], optim.ScaleByLearningRateState)
    ident = optim.identity()
    out, st = ident.update(grads, ident.init(params))
    assert out is grads and st == ()


def test_add_decayed_weights_needs_params():
    t = optim.add_decayed_weights(0.1)
    with pytest.raises(ValueError):
        t.update(_grads(), t.init(_params()))


def test_apply_updates_adds_out_of_place_and_keeps_dtype():
    params = {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.arange(4.0)}
    before = tree.clone(params)
    updates = {"a": torch.full((3,), 0.5), "b": torch.full((4,), -1.0, dtype=torch.float64)}
    new = optim.apply_updates(params, updates)
    assert new["a"].dtype == torch.bfloat16 and new["b"].dtype == torch.float32
    assert torch.equal(new["a"], torch.full((3,), 1.5, dtype=torch.bfloat16))
    assert torch.equal(new["b"], torch.arange(4.0) - 1.0)
    for k in params:  # inputs untouched, outputs new storage
        assert torch.equal(params[k], before[k])
        assert new[k].data_ptr() != params[k].data_ptr()


def test_learning_rate_reads_the_latest_update():
    params, grads = _params(), _grads()
    sched = optim.linear(1.0, 0.0, 10)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(sched, momentum=0.9))
    state = opt.init(params)
    assert float(optim.learning_rate(state)) == 0.0  # nothing applied yet
    for k in range(4):
        _, state = opt.update(grads, state, params)
        assert float(optim.learning_rate(state)) == pytest.approx(1.0 - k / 10, rel=1e-6)
    assert optim.learning_rate(optim.scale_by_adam().init(params)) is None
    assert optim.learning_rate(()) is None
    # A tensor learning rate is used as given.
    t = optim.scale_by_learning_rate(torch.tensor(0.25))
    out, st = t.update(grads, t.init(params), params)
    torch.testing.assert_close(out["w"], -0.25 * grads["w"])
    assert float(optim.learning_rate(st)) == 0.25


@pytest.mark.parametrize("max_norm", [0.3, 1.0, 100.0])
def test_clip_by_global_norm_scales_like_clip_grad_norm(max_norm):
    grads = {k: v * 0.2 for k, v in _grads().items()}
    ps = [torch.nn.Parameter(torch.zeros_like(v)) for v in grads.values()]
    for p, g in zip(ps, grads.values()):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(ps, max_norm)
    t = optim.clip_by_global_norm(max_norm)
    out, _ = t.update(grads, t.init(grads))
    for (k, g), p in zip(out.items(), ps):
        torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=0, msg=k)
    clipped = float(total) > max_norm
    assert clipped == (max_norm < 1.0)  # the parametrization covers both branches
    assert float(tree.global_norm(out)) == pytest.approx(min(float(total), max_norm), rel=1e-5)
    if not clipped:
        for k in grads:
            assert torch.equal(out[k], grads[k])


def test_scale_by_adam_state_and_mu_dtype():
    params, grads = _params(), _grads()
    t = optim.scale_by_adam(0.9, 0.999, mu_dtype=torch.float64)
    s = t.init(params)
    assert int(s.count) == 0 and all(v.dtype == torch.float64 for v in s.mu.values())
    out, s = t.update(grads, s, params)
    assert int(s.count) == 1
    # First Adam step: m_hat / (sqrt(v_hat) + eps) = g / (|g| + eps) ~= sign(g).
    for k in grads:
        torch.testing.assert_close(out[k], (grads[k] / (grads[k].abs() + 1e-8)).double())


def test_sgd_nesterov_without_momentum_is_a_clear_error():
    with pytest.raises(ValueError, match=r"nesterov=True\) needs momentum > 0"):
        optim.sgd(0.1, nesterov=True)


def test_a_known_norm_reaches_the_first_transform_only():
    """`call_update(..., norm=)`: a leading clip uses the caller's norm instead of taking it again;
    later transforms (whose input is no longer the chain's input) and transforms that do not declare
    `Traits(takes_norm=True)` never see it, whatever their signature (declared, not sniffed)."""
    grads = {k: v * 0.2 for k, v in _grads().items()}
    seen = []

    def spy(name, declared):
        def update(updates, state, params=None, norm=None):
            seen.append((name, norm))
            return updates, state

        return optim.Transform(lambda p: (), update, optim.Traits(takes_norm=declared))

    fake = torch.tensor(1e6)  # a wrong norm on purpose: the clip must believe the caller
    opt = optim.chain(spy("first", True), spy("second", True), spy("third", False))
    assert opt.traits.takes_norm  # a chain takes the norm when its first transform does
    optim.call_update(opt, grads, opt.init(grads), grads, norm=fake)
    assert seen == [("first", fake), ("second", None), ("third", None)]
    seen.clear()
    undeclared = optim.chain(spy("undeclared", False), spy("second", True))
    assert not undeclared.traits.takes_norm
    optim.call_update(undeclared, grads, undeclared.init(grads), grads, norm=fake)
    assert seen == [("undeclared", None), ("second", None)]

    clip = optim.clip_by_global_norm(1.0)
    told, _ = optim.call_update(clip, grads, clip.init(grads), norm=fake)  # scaled by 1 / 1e6
    own, _ = clip.update(grads, clip.init(grads))
    for k in grads:
        torch.testing.assert_close(told[k], grads[k] / (1e6 + 1e-6))
    assert float(tree.global_norm(own)) == pytest.approx(min(float(tree.global_norm(grads)), 1.0), rel=1e-5)


# ---------------------------------------------------------------------------------------------
# Hyper-parameters as state.


def _build(h):
    """Clipped AdamW on a warm-up cosine schedule, from a dict of hyper-parameters."""
    sched = optim.warmup_cosine(h["lr"], h["warmup_steps"], h["decay_steps"], end_value=h["min_lr"])
    adamw = optim.adamw(
        sched, h["b1"], h["b2"], h["eps"], h["weight_decay"], mask=lambda p: {k: v.ndim > 1 for k, v in p.items()}
    )
    return optim.chain(optim.clip_by_global_norm(h["clip"]), adamw)


def test_set_hyperparams_equals_building_with_those_values():
    params, grads = _params(), _grads()
    a = dict(
        clip=1.0, lr=1e-2, min_lr=1e-3, warmup_steps=2, decay_steps=20, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1
    )
    b = dict(clip=0.5, lr=3e-2, min_lr=2e-3, warmup_steps=1, decay_steps=9, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.0)
    opt, ref = _build(a), _build(b)
    fresh = opt.init(params)
    state, ref_state = optim.set_hyperparams(fresh, **b), ref.init(params)
    assert optim.get_hyperparams(fresh) == {**a, "init_lr": 0.0}  # the input is not modified
    assert optim.get_hyperparams(state) == {**b, "init_lr": 0.0}
    for _ in range(4):  # the same bits as an optimizer built with those values
        u, state = opt.update(grads, state, params)
        v, ref_state = ref.update(grads, ref_state, params)
        assert all(torch.equal(u[k], v[k]) for k in u)
    assert optim.report(opt, state) == optim.report(ref, ref_state)
    with pytest.raises(KeyError, match="no hyper-parameter 'momentum'.*'b1'"):
        optim.set_hyperparams(state, momentum=0.9)
    sgd = optim.sgd(0.1, momentum=0.9, weight_decay=1e-4)
    assert optim.get_hyperparams(optim.set_hyperparams(sgd.init(params), momentum=0.5)) == {
        "weight_decay": 1e-4,
        "momentum": 0.5,
        "lr": 0.1,
    }


def test_hyperparams_are_float64_state_tensors_and_match_torch_adamw():
    """float64 so derived factors (1 - b2, bias corrections) round as torch.optim's Python floats."""
    params, grads = _params(), _grads()
    opt = optim.adamw(1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    state = opt.init(params)
    ours = dict(params)
    torch_params = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ref = torch.optim.AdamW(torch_params.values(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(3):
        u, state = opt.update(grads, state, ours)
        ours = optim.apply_updates(ours, u)
        for k, p in torch_params.items():
            p.grad = grads[k].clone()
        ref.step()
    hyper = [t for s in state if hasattr(s, "hyper") for t in s.hyper.values()]
    assert hyper and all(t.dtype == torch.float64 and t.shape == () for t in hyper)
    for k in params:  # one step of elementwise float32 math each: a few ulps
        torch.testing.assert_close(
            ours[k], torch_params[k].detach(), rtol=4 * torch.finfo(torch.float32).eps, atol=1e-7
        )


@pytest.mark.slow
def test_gpu_scalar_route_reads_no_scalar_on_the_host_and_computes_the_same_update():
    """On a GPU, a 0-d tensor scalar (Adam's betas, eps, the clip factor) given to a `_foreach_*`
    Scalar overload compiles to `.item()`: a device-to-host sync per call. Off the CPU, functrain's
    foreach ops pass it as broadcast views instead; `foreach.device_scalars()` forces that route
    here. Its compiled update has no `.item()` and equals the eager update of the usual route."""
    from _tol import assert_close, rtol
    from torch._inductor.utils import run_and_get_code

    from functrain import step as step_lib
    from functrain.ops import foreach

    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}
    grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    opt = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.adamw(optim.warmup_cosine(1e-2, 2, 10), weight_decay=0.1, mask=_decay_mask),
    )
    aux = {"loss": torch.tensor(1.0)}
    eager = step_lib.update_step(opt, donate=False, compile=False)
    compiled = step_lib.update_step(opt, donate=False)
    ref, _ = eager(eager(init_state(params, opt), grads, aux)[0], grads, aux)
    with foreach.device_scalars():
        state, _ = compiled(init_state(params, opt), grads, aux)
        (state, _), code = run_and_get_code(compiled, state, grads, aux)
    assert code and not any(".item()" in c for c in code), "a scalar is read on the host"
    n = sum(v.numel() for v in params.values())  # the global norm's reduction length
    assert_close(state.params, ref.params, rtol(n), msg="params")
    assert_close(state.opt_state, ref.opt_state, rtol(n), msg="opt_state")


def test_a_transform_is_init_and_update_with_optional_traits():
    plain = optim.Transform(lambda p: (), lambda u, s, p=None: (u, s))
    assert plain.traits == optim.Traits() and plain.report is None and plain.leafwise is False
    adamw = optim.adamw(1e-3)
    assert adamw._fields == ("init", "update", "traits")
    assert adamw.leafwise is True and adamw.report is not None
    assert adamw.fused is not None and not adamw.traits.fused_compiled  # the kernel in eager steps only
    assert optim.adamw(1e-3, fused=False).fused is None
    assert optim.adamw(1e-3, fused=True).fused is not None and optim.adamw(1e-3, fused=True).traits.fused_compiled
    clipped = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3, fused=True))
    assert clipped.traits.leafwise == "norm" and clipped.fused is not None
