"""make_train_step / make_eval_step: compiled == eager, the compile contract, accumulation,
determinism, donation, evaluation and errors."""

from __future__ import annotations

import _tol
import optree
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from functrain import (
    TrainState,
    apply_gradients,
    init_state,
    make_eval_step,
    make_train_step,
    optim,
    tree,
    update_step,
    value_and_grad,
)
from functrain.models import gpt

pytestmark = pytest.mark.numeric


def _opt():
    """The optimizer the tests train with: clipping, then AdamW with a warm-up/cosine schedule."""
    return optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.adamw(optim.warmup_cosine(1e-2, 3, 10, end_value=1e-3, init_value=1e-3), weight_decay=0.1),
    )


LR, MOMENTUM = 0.1, 0.9


def _sgd_opt():
    """Clipping + SGD with momentum and a schedule: for comparing trajectories (tests/_tol.py: its
    updates move with the gradient, where Adam turns rounding noise into full-size steps)."""
    return optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.sgd(optim.warmup_cosine(LR, 3, 10, end_value=LR / 10, init_value=LR / 10), momentum=MOMENTUM),
    )


def _n(model, batch_size):
    """Terms summed per gradient entry: tokens x the widest matmul (4 n_embd)."""
    return batch_size * model.cfg.block_size * 4 * model.cfg.n_embd


def _storages(state: TrainState, fields=("params", "opt_state", "step")):
    """data_ptr of every tensor leaf of the given state fields, but the hyper-parameters (read-only
    inputs the step passes through unchanged)."""

    def holds_hyper(node) -> bool:  # a transform state with hyper-parameters (its `hyper` field)
        return isinstance(node, tuple) and "hyper" in getattr(node, "_fields", ())

    states = [x for x in optree.tree_leaves(state, is_leaf=holds_hyper, none_is_leaf=False) if holds_hyper(x)]
    hyper = {v.data_ptr() for s in states for v in s.hyper.values()}
    return [x.data_ptr() for f in fields for x in tree.leaves(getattr(state, f)) if x.data_ptr() not in hyper]


def _assert_trees_equal(a, b):
    """Bit-identical trees (same structure, same values)."""
    assert tree.structure(a) == tree.structure(b)
    for (name, x), y in zip(tree.named_leaves(a), tree.leaves(b)):
        assert torch.equal(x, y), name


# ---------------------------------------------------------------------------------------------
# Compiled step: matches eager and honours the compile contract. The only compiling tests.


@pytest.mark.slow
@pytest.mark.parametrize("accum_steps", [1, 2], ids=["no_accum", "accum2_unroll"])
def test_compiled_step_matches_eager_with_no_recompiles(tiny_gpt, batches, gpt_loss_fn, accum_steps):
    # dropout=0: with dropout the cold compile costs ~3x more CPU (see the opt-in test below).
    model = tiny_gpt(n_layer=1)
    loss_fn = gpt_loss_fn(model)
    data = batches(model.cfg, 10, batch_size=4)
    state0 = init_state(model, _sgd_opt(), seed=0)

    torch._dynamo.reset()
    counters.clear()
    compiled = make_train_step(loss_fn, _sgd_opt(), accum_steps=accum_steps)  # donate=True
    eager = make_train_step(loss_fn, _sgd_opt(), accum_steps=accum_steps, compile=False)

    c_state, e_state = tree.clone(state0), tree.clone(state0)
    c_losses, e_losses = [], []
    tol = _tol.rtol(_n(model, 4))
    for i, batch in enumerate(data):
        if i == 5:  # hyper-parameters are state: changing them mid-run rebuilds nothing
            c_state = optim.set_hyperparams(c_state, lr=0.02, momentum=0.5)
            e_state = optim.set_hyperparams(e_state, lr=0.02, momentum=0.5)
        before = _storages(c_state)
        new_c, c_m = compiled(c_state, batch)
        # Donation under compile: the new state lives in the input's buffers.
        assert _storages(new_c) == before
        c_state = new_c
        e_state, e_m = eager(e_state, batch)
        c_losses.append(float(c_m["loss"]))
        e_losses.append(float(e_m["loss"]))
        for k in ("grad_norm", "update_norm", "lr"):
            _tol.assert_close(c_m[k], e_m[k], tol * (i + 1), msg=k)  # the trajectories drift linearly

    # the last step's rate follows the schedule with its new peak (the floor and warm-up unchanged)
    want = optim.warmup_cosine(0.02, 3, 10, end_value=LR / 10, init_value=LR / 10)(torch.tensor(9))
    assert float(c_m["lr"]) == pytest.approx(float(want), rel=1e-6) and float(e_m["lr"]) == pytest.approx(
        float(want), rel=1e-6
    )
    # The compile contract: the loss and its grads one graph, the update one more (one block: no groups to share
    # a graph), built once, never rebuilt.
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert not counters["graph_break"], dict(counters["graph_break"])

    _tol.assert_close(torch.tensor(c_losses), torch.tensor(e_losses), tol * len(data), msg="losses")
    assert e_losses[-1] < e_losses[0] - 0.1  # it trains (the comparison is not of constants)
    assert int(c_state.step) == int(e_state.step) == len(data)
    atol = _tol.trajectory_atol(steps=len(data), gain=_tol.sgd_gain(LR, MOMENTUM), grad_scale=1.0, n=_n(model, 4))
    _tol.assert_close(c_state.params, e_state.params, atol, absolute=True, msg="params")  # clipped: |g| <= 1


@pytest.mark.slow
def test_compiled_adamw_update_matches_eager_and_has_no_atomic_adds():
    """The optimizer half compiled alone (clip + AdamW + non-finite guard + donation) on the same
    gradients as eager: elementwise math, so only op fusion differs (a few ulp per step)."""
    from torch._inductor.utils import run_and_get_code

    g = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(64, 48, generator=g),
        "b": torch.randn(48, generator=g),
        "e": torch.randn(33, 8, generator=g),
    }
    grads = [{k: torch.randn(v.shape, generator=g) * 0.1 for k, v in params.items()} for _ in range(6)]
    grads[3] = {k: v * float("nan") for k, v in grads[3].items()}  # one skipped update
    opt = _opt()

    def update(state, grads):
        new, m = apply_gradients(state, grads, opt, aux={"loss": torch.zeros(())})
        return new, m

    torch._dynamo.reset()
    compiled = torch.compile(update, fullgraph=True, dynamic=False)
    c_state = e_state = init_state(params, opt)
    codes = []
    for i, gr in enumerate(grads):
        if i == 0:
            (c_state, c_m), codes = run_and_get_code(compiled, c_state, gr)
        else:
            c_state, c_m = compiled(c_state, gr)
        e_state, e_m = update(e_state, gr)
        assert float(c_m["skipped"]) == float(e_m["skipped"]) == (1.0 if i == 3 else 0.0)
        tol = _tol.rtol(48) * (i + 1)  # norms sum 48-wide rows; elementwise otherwise
        _tol.assert_close(c_state.params, e_state.params, tol, msg=f"step {i} params")
        _tol.assert_close(c_state.opt_state, e_state.opt_state, tol, msg=f"step {i} opt_state")
        for k in ("grad_norm", "update_norm", "lr"):
            if i != 3:
                _tol.assert_close(c_m[k], e_m[k], tol, msg=k)
    assert codes and not any("atomic_add" in code for code in codes)  # deterministic kernels only


def test_float64_hyperparameters_trace_once_and_come_back_as_the_callers_tensors():
    """The optimizer's float64 0-d hyper-parameters reach the compiled graph as (1,) views
    (compiler.compile._lift): one Dynamo trace, not two (torch 2.13 restarts the trace when it meets float64
    scalar inputs), no recompile when one changes, and the state that comes back holds the
    caller's own 0-d tensors. aot_eager: the restart happens in AOTAutograd, no inductor needed."""
    from torch._dynamo.utils import compilation_time_metrics

    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(4)]
    opt = _opt()
    state = init_state(params, opt)
    hypers = [x for x in tree.leaves(state.opt_state) if x.dtype == torch.float64]
    assert hypers and all(x.ndim == 0 for x in hypers)  # what this test is about

    torch._dynamo.reset()
    counters.clear()
    compilation_time_metrics.clear()
    compiled = update_step(opt, compile_options={"backend": "aot_eager"})
    eager = update_step(opt, compile=False)
    c_state, e_state = state, tree.clone(state)
    for i, gr in enumerate(grads):
        if i == 2:  # a new learning rate: a new tensor, the same graph
            c_state, e_state = (optim.set_hyperparams(s, lr=0.05) for s in (c_state, e_state))
        ids = {id(x) for x in tree.leaves(c_state.opt_state) if x.dtype == torch.float64}
        c_state, c_m = compiled(c_state, gr, {"loss": torch.zeros(())})
        e_state, e_m = eager(e_state, gr, {"loss": torch.zeros(())})
        back = [x for x in tree.leaves(c_state.opt_state) if x.dtype == torch.float64]
        assert {id(x) for x in back} == ids and all(x.ndim == 0 for x in back)  # the caller's own
        _tol.assert_close(c_state.params, e_state.params, _tol.rtol(16) * (i + 1), msg=f"step {i}")
        _tol.assert_close(c_m["lr"], e_m["lr"], _tol.rtol(1), msg="lr")
    assert 0.02 < float(c_m["lr"]) < 0.0501 and int(c_state.step) == len(grads)  # the new peak (was 1e-2)
    attempts = sorted(k for k in compilation_time_metrics if k.startswith("compile_attempt_"))
    assert attempts == ["compile_attempt_0"], attempts  # traced once: no restart
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"], dict(counters["recompiles"])


@pytest.mark.slow
@pytest.mark.exhaustive  # compiles a dropout step (~2 min CPU cold)
def test_compiled_dropout_step_matches_eager_and_repeats_bit_identically(tiny_gpt, batches, gpt_loss_fn):
    model = tiny_gpt(n_layer=1, dropout=0.1)
    loss_fn = gpt_loss_fn(model)
    data = batches(model.cfg, 4, batch_size=4)
    state0 = init_state(model, _sgd_opt(), seed=0)
    # Bit-identical compiled reruns with no global deterministic switch: the embedding's backward
    # is a deterministic kernel (functrain.ops.embedding).
    torch._dynamo.reset()
    counters.clear()
    compiled = make_train_step(loss_fn, _sgd_opt(), donate=False)
    eager = make_train_step(loss_fn, _sgd_opt(), compile=False)
    c_state, e_state = tree.clone(state0), tree.clone(state0)
    for batch in data:
        snapshot = tree.clone(c_state)
        again, m_again = compiled(c_state, batch)
        _assert_trees_equal(c_state, snapshot)  # donate=False, compiled: the input is untouched
        assert not set(_storages(again)) & set(_storages(c_state))
        c_state, c_m = compiled(c_state, batch)
        _assert_trees_equal(c_state, again)  # same (state, batch): bit-identical, compiled
        _assert_trees_equal(c_m, m_again)
        e_state, e_m = eager(e_state, batch)
        _tol.assert_close(c_m["loss"], e_m["loss"], _tol.rtol(_n(model, 4)) * 4, msg="loss")
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # the loss and grads, the update
    assert not counters["recompiles"], dict(counters["recompiles"])
    atol = _tol.trajectory_atol(steps=len(data), gain=_tol.sgd_gain(LR, MOMENTUM), grad_scale=1.0, n=_n(model, 4))
    _tol.assert_close(c_state.params, e_state.params, atol, absolute=True, msg="params")


# ---------------------------------------------------------------------------------------------
# Gradient accumulation (eager).


def _one_step(model, loss_fn, batch, opt, **kw):
    state = init_state(model, opt)
    step = make_train_step(loss_fn, opt, compile=False, donate=False, **kw)
    new, m = step(state, batch)
    return state, new, m


@pytest.mark.parametrize("accum_steps", [2, 4])
def test_accumulation_equals_full_batch(tiny_gpt, batches, gpt_loss_fn, accum_steps):
    model = tiny_gpt(n_layer=1)
    loss_fn = gpt_loss_fn(model)
    batch = batches(model.cfg, 1, batch_size=8)[0]
    # sgd(1.0): the update is exactly -grad, so the new params expose the accumulated gradient.
    sgd = optim.sgd(1.0)
    old, full, m_full = _one_step(model, loss_fn, batch, sgd)
    _, acc, m_acc = _one_step(model, loss_fn, batch, sgd, accum_steps=accum_steps)
    _, _, grads = value_and_grad(loss_fn, old.params, batch, None)  # full-batch reference
    tol = _tol.rtol(_n(model, 8))
    _tol.assert_close({k: p - acc.params[k] for k, p in old.params.items()}, grads, tol, msg="accumulated grads")
    _tol.assert_close({k: p - full.params[k] for k, p in old.params.items()}, grads, tol, msg="full grads")
    _tol.assert_close(m_acc["loss"], m_full["loss"], tol, msg="loss")
    _tol.assert_close(m_acc["grad_norm"], m_full["grad_norm"], tol, msg="grad_norm")
    # And through a stateful optimizer (momentum: the trace is the accumulated gradient too).
    _, full, _ = _one_step(model, loss_fn, batch, _sgd_opt())
    _, acc, _ = _one_step(model, loss_fn, batch, _sgd_opt(), accum_steps=accum_steps)
    _tol.assert_close(acc.opt_state, full.opt_state, tol, msg="opt_state")
    _tol.assert_close(
        acc.params,
        full.params,
        _tol.trajectory_atol(steps=1, gain=LR, grad_scale=1.0, n=_n(model, 8)),
        absolute=True,
        msg="params",
    )


def _assert_close_trees(a, b, atol):
    assert tree.structure(a) == tree.structure(b)
    for (name, x), y in zip(tree.named_leaves(a), tree.leaves(b)):
        torch.testing.assert_close(x, y, rtol=0, atol=atol, msg=name)


def test_scan_accumulation_equals_unroll(tiny_gpt, batches, gpt_loss_fn):
    model = tiny_gpt(n_layer=1, dropout=0.1)  # per-microbatch dropout keys must agree too
    loss_fn = gpt_loss_fn(model)
    batch = batches(model.cfg, 1, batch_size=8)[0]
    _, unroll, m_unroll = _one_step(model, loss_fn, batch, _sgd_opt(), accum_steps=4)
    _, scan, m_scan = _one_step(model, loss_fn, batch, _sgd_opt(), accum_steps=4, accum_impl="scan")
    tol = _tol.rtol(_n(model, 8))
    _tol.assert_close(scan.opt_state, unroll.opt_state, tol, msg="momentum = accumulated grads")
    _tol.assert_close(
        scan.params,
        unroll.params,
        _tol.trajectory_atol(steps=1, gain=LR, grad_scale=1.0, n=_n(model, 8)),
        absolute=True,
        msg="params",
    )
    for k in m_unroll:
        _tol.assert_close(m_scan[k], m_unroll[k], tol, msg=k)


def test_batch_not_divisible_by_accum_steps_is_a_clear_error(tiny_gpt, batches, gpt_loss_fn):
    model = tiny_gpt(n_layer=1)
    batch = batches(model.cfg, 1, batch_size=6)[0]
    state = init_state(model, _opt())
    step = make_train_step(gpt_loss_fn(model), _opt(), accum_steps=4, compile=False)
    with pytest.raises(ValueError, match=r"6 is not divisible by accum_steps=4"):
        step(state, batch)
    with pytest.raises(ValueError, match="accum_steps"):
        make_train_step(gpt_loss_fn(model), _opt(), accum_steps=0)
    with pytest.raises(ValueError, match="accum_impl"):
        make_train_step(gpt_loss_fn(model), _opt(), accum_impl="loop")


# ---------------------------------------------------------------------------------------------
# Metrics, determinism, dropout keys.


def test_metrics_match_their_definitions(tiny_gpt, batches, gpt_loss_fn):
    model = tiny_gpt(n_layer=1)
    loss_fn = gpt_loss_fn(model)
    batch = batches(model.cfg, 1)[0]
    old, new, m = _one_step(model, loss_fn, batch, _opt())
    assert {"loss", "grad_norm", "update_norm", "lr"} <= set(m) and "param_norm" not in m  # a log-time pass
    x, y = batch
    torch.testing.assert_close(m["loss"], gpt.cross_entropy(model(x), y).detach())
    _, _, grads = value_and_grad(loss_fn, old.params, batch, None)
    flat = lambda t: torch.cat([v.flatten() for v in t.values()])  # noqa: E731
    n = flat(grads).numel()  # norms sum this many squares
    _tol.assert_close(m["grad_norm"], torch.linalg.vector_norm(flat(grads)), _tol.rtol(n), msg="grad_norm")
    # new - old loses up to eps * |p| per entry, so the norm of the difference is off by eps * ||p||.
    delta = {k: new.params[k] - old.params[k] for k in old.params}
    p_norm = float(torch.linalg.vector_norm(flat(new.params)))
    atol = 2 * torch.finfo(torch.float32).eps * p_norm + _tol.rtol(n) * float(m["update_norm"])
    _tol.assert_close(m["update_norm"], torch.linalg.vector_norm(flat(delta)), atol, absolute=True, msg="update_norm")
    assert float(m["lr"]) == pytest.approx(1e-3)  # the first update's lr: the warm-up's start


def test_same_state_and_batch_give_bit_identical_results(tiny_gpt, batches, gpt_loss_fn):
    model = tiny_gpt(n_layer=1, dropout=0.2)
    batch = batches(model.cfg, 1)[0]
    step = make_train_step(gpt_loss_fn(model), _opt(), accum_steps=2, compile=False, donate=False)
    state = init_state(model, _opt(), seed=3)
    state, _ = step(state, batch)  # a non-trivial state (step 1, non-zero moments)
    a, ma = step(tree.clone(state), batch)
    b, mb = step(tree.clone(state), batch)
    _assert_trees_equal(a, b)
    _assert_trees_equal(ma, mb)


def test_dropout_masks_change_with_the_step_and_repeat_for_the_same_step(tiny_gpt, batches, gpt_loss_fn):
    def losses_at_steps(dropout):
        model = tiny_gpt(n_layer=1, dropout=dropout)
        batch = batches(model.cfg, 1)[0]
        step = make_train_step(gpt_loss_fn(model), _opt(), compile=False, donate=False)
        s0 = init_state(model, _opt(), seed=0)
        s1 = s0.replace(step=torch.ones_like(s0.step))  # same params, the step-1 key
        return [float(step(s, batch)[1]["loss"]) for s in (s0, s0, s1)]

    a0, a0_again, a1 = losses_at_steps(0.3)
    assert a0 == a0_again  # same step -> same masks
    assert a0 != a1  # another step -> other masks
    b0, _, b1 = losses_at_steps(0.0)  # control: without dropout the key does not matter
    assert b0 == b1
    assert a0 != b0  # and dropout did something


# ---------------------------------------------------------------------------------------------
# Donation (eager; the compiled case is covered above).


def test_donate_true_reuses_the_input_buffers(tiny_gpt, batches, gpt_loss_fn):
    model = tiny_gpt(n_layer=1)
    batch = batches(model.cfg, 1)[0]
    step = make_train_step(gpt_loss_fn(model), _opt(), compile=False, donate=True)
    state = init_state(model, _opt())
    ref_step = make_train_step(gpt_loss_fn(model), _opt(), compile=False, donate=False)
    want, _ = ref_step(tree.clone(state), batch)
    before = _storages(state)
    new, _ = step(state, batch)
    assert _storages(new) == before
    _assert_trees_equal(new, want)  # donation changes where the result lives, not what it is
    # The state does not alias the module it was built from (init_state copies by default).
    assert new.params["wte.weight"].data_ptr() != model.wte.weight.data_ptr()


def test_donate_false_leaves_the_input_untouched(tiny_gpt, batches, gpt_loss_fn):
    model = tiny_gpt(n_layer=1)
    batch = batches(model.cfg, 1)[0]
    step = make_train_step(gpt_loss_fn(model), _opt(), compile=False, donate=False)
    state = init_state(model, _opt())
    snapshot = tree.clone(state)
    new, _ = step(state, batch)
    _assert_trees_equal(state, snapshot)
    assert not set(_storages(new)) & set(_storages(state))
    assert int(new.step) == 1 and int(state.step) == 0
    assert not torch.equal(new.params["wte.weight"], state.params["wte.weight"])


# ---------------------------------------------------------------------------------------------
# Eval.


def test_eval_step_returns_the_loss_and_keeps_the_state(tiny_gpt, batches, gpt_loss_fn):
    model = tiny_gpt(n_layer=1, dropout=0.5)  # eval must not drop anything
    x, y = batches(model.cfg, 1)[0]
    state = init_state(model, _opt())
    snapshot = tree.clone(state)
    eval_step = make_eval_step(gpt_loss_fn(model), compile=False)
    m = eval_step(state, (x, y))
    torch.testing.assert_close(m["loss"], gpt.cross_entropy(model(x), y).detach(), rtol=0, atol=0)
    assert not m["loss"].requires_grad
    _assert_trees_equal(state, snapshot)
    assert float(eval_step(state, (x, y))["loss"]) == float(m["loss"])


def test_eager_value_and_grad_by_autograd_equals_torch_func(tiny_gpt, batches, gpt_loss_fn):
    """Eagerly the gradients come from plain autograd; they are torch.func.grad_and_value's, bit for bit
    (the same backward kernels), with dropout, a loss scale and a param the loss never reads."""
    from functrain import compiler, rng
    from functrain.nn.model_state import loss_and_aux

    model = tiny_gpt(n_layer=2, dropout=0.1)
    loss_fn = gpt_loss_fn(model)
    params = {**dict(model.named_parameters()), "unused": torch.ones(3)}
    params = {k: v.detach() for k, v in params.items()}
    batch, key, scale = batches(model.cfg, 1)[0], rng.key(7), torch.tensor(8.0)

    def fn(p, b, k):
        return loss_fn({n: x for n, x in p.items() if n != "unused"}, b, k)

    assert compiler.eager_autograd_ok()
    loss, aux, grads = value_and_grad(fn, params, batch, key, loss_scale=scale)

    def f(p):
        out, extra = loss_and_aux(fn(p, batch, key))
        return out * scale, (out.detach(), extra)

    ref, (_, (ref_loss, ref_aux)) = torch.func.grad_and_value(f, has_aux=True)(params)
    assert torch.equal(loss, ref_loss) and aux.keys() == ref_aux.keys()
    _assert_trees_equal(grads, ref)
    assert torch.equal(grads["unused"], torch.zeros(3)) and float(grads["wte.weight"].abs().sum()) > 0
    assert not any(g.requires_grad for g in grads.values()) and not loss.requires_grad
    assert not any(p.requires_grad for p in params.values())  # the caller's tensors are not touched

    inside = torch.func.vmap(lambda x: torch.tensor(compiler.eager_autograd_ok()))(torch.ones(2))
    assert not inside.any()  # inside a transform the torch.func route runs


def test_value_and_grad_compiles_on_its_own_with_and_without_a_key():
    # the public value_and_grad under torch.compile, outside any train step (no model state given)
    torch._dynamo.reset()

    def loss_fn(p, b, k):
        return (p["w"] * b).pow(2).sum(), {"first": p["w"][0] * 1.0}

    params, batch = {"w": torch.linspace(-1, 1, 5)}, torch.arange(5.0)
    for key in (torch.zeros(2, dtype=torch.int64), None):
        want = value_and_grad(loss_fn, params, batch, key)
        compiled = torch.compile(
            lambda p, b, key=key: value_and_grad(loss_fn, p, b, key), backend="aot_eager", fullgraph=True
        )
        got = compiled(params, batch)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1]["first"], want[1]["first"])
        assert torch.equal(got[2]["w"], want[2]["w"])
