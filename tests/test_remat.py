"""functrain.step.staged: staged gradients (activation checkpointing) equal plain grad_and_value, eagerly,
through the train step and compiled; loss scaling; policies; the GPT stages."""

from __future__ import annotations

import re

import _tol
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from functrain import init_state, make_train_step, optim, rng, tree
from functrain.config_checks import parse_policy
from functrain.models import gpt
from functrain.models.gpt import gpt_hidden
from functrain.models.gpt import make_loss_fn as make_gpt_loss_fn
from functrain.step import value_and_grad
from functrain.step.staged import Stage, staged_loss

pytestmark = pytest.mark.numeric


def _gpt_problem(tiny_gpt, batches, *, n_layer=3, dropout=0.1, bias=True):
    """(model, params, batch, key) for a tiny GPT with dropout."""
    model = tiny_gpt(n_layer=n_layer, dropout=dropout, bias=bias)
    params = {n: p.detach() for n, p in model.named_parameters()}
    return model, params, batches(model.cfg, 1, batch_size=4)[0], rng.key(7)


def _assert_grads_close(got, want, n=4 * 16 * 4 * 32):
    """Same keys in the same order, the gradients equal to rounding (`n`: tokens x widest matmul)."""
    assert list(got) == list(want)
    _tol.assert_close(got, want, _tol.rtol(n), msg="grads")


# ---------------------------------------------------------------------------------------------
# GPT: staged value_and_grad == plain grad_and_value


@pytest.mark.parametrize("chunk_size", [0, 7], ids=["plain_ce", "chunked_ce"])
@pytest.mark.parametrize("policy", ["full", 2], ids=["full", "every2"])
def test_gpt_staged_grads_equal_plain_grad_and_value(tiny_gpt, batches, policy, chunk_size):
    model, params, batch, key = _gpt_problem(tiny_gpt, batches)
    plain = make_gpt_loss_fn(model, chunk_size=chunk_size)
    staged = make_gpt_loss_fn(model, chunk_size=chunk_size, remat=policy)
    assert not hasattr(plain, "value_and_grad") and hasattr(staged, "value_and_grad")

    want_loss, _, want = value_and_grad(plain, params, batch, key)  # torch.func.grad_and_value
    loss, aux, grads = staged.value_and_grad(params, batch, key)
    _tol.assert_close(loss, want_loss, _tol.rtol(4 * 16 * 64), msg="loss")
    assert aux == {} and not loss.requires_grad
    _assert_grads_close(grads, want)
    assert grads["wte.weight"].abs().sum() > 0 and grads["blocks.0.ln_1.weight"].abs().sum() > 0

    # The plain composition (eval, grad_and_value) is the same loss; dropout really is on.
    _tol.assert_close(staged(params, batch, key)[0], want_loss, _tol.rtol(4 * 16 * 64), msg="loss")
    no_dropout = staged(params, batch, None)[0]
    assert abs(float(no_dropout) - float(want_loss)) > 1e-4


def test_gpt_stages_compose_to_the_forward(tiny_gpt, batches):
    model, params, (x, _), key = _gpt_problem(tiny_gpt, batches, n_layer=2)
    st = gpt.stages(model)
    h = st.embed.fn(st.embed.params(params), x, key)
    for b in st.blocks:
        h = b.fn(b.params(params), h, key)
    hidden = st.final.fn(st.final.params(params), h, key)
    torch.testing.assert_close(hidden, gpt_hidden(model, params, x, key), atol=0, rtol=0)
    # Every parameter belongs to exactly one stage (the tied head adds wte.weight in losses).
    names = st.embed.names + sum((b.names for b in st.blocks), ()) + st.final.names
    assert sorted(names) == sorted(params)
    assert st.blocks[1].names[0].startswith("blocks.1.")


# ---------------------------------------------------------------------------------------------
# Loss scaling


@pytest.mark.parametrize("policy", ["full", 2])
def test_loss_scale_scales_grads_not_loss(tiny_gpt, batches, policy):
    model, params, batch, key = _gpt_problem(tiny_gpt, batches)
    staged = make_gpt_loss_fn(model, chunk_size=16, remat=policy)
    loss, _, grads = staged.value_and_grad(params, batch, key)
    scale = torch.tensor(1024.0)
    s_loss, _, s_grads = staged.value_and_grad(params, batch, key, loss_scale=scale)
    torch.testing.assert_close(s_loss, loss, atol=0, rtol=0)  # the loss stays unscaled
    _assert_grads_close(s_grads, {n: g * 1024.0 for n, g in grads.items()})


def test_loss_scale_with_policy_none_uses_grad_and_value():
    embed, blocks, head, params, batch = _toy()
    loss_fn = staged_loss(embed, blocks, head, policy="none")
    loss, aux, grads = loss_fn.value_and_grad(params, batch, None)
    s_loss, s_aux, s_grads = loss_fn.value_and_grad(params, batch, None, loss_scale=torch.tensor(0.5))
    torch.testing.assert_close(s_loss, loss, atol=0, rtol=0)
    assert set(aux) == set(s_aux) == {"h_norm"}
    _assert_grads_close(s_grads, {n: g * 0.5 for n, g in grads.items()})


# ---------------------------------------------------------------------------------------------
# The staged route on a toy model: recomputation happens where the policy says, ties are summed


def _toy(n_blocks=4, calls=None):
    """Stages of a small tied MLP stack: embed reads `emb`, blocks `w{i}`, head `emb` again and
    `unused` is read by no stage. `calls[i]` counts block i's runs."""
    g = torch.Generator().manual_seed(0)
    params = {"emb": torch.randn(5, 8, generator=g), "unused": torch.randn(3, generator=g)}
    params.update({f"w{i}": torch.randn(8, 8, generator=g) * 0.3 for i in range(n_blocks)})
    batch = (torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g))

    def block_stage(i):
        def fn(p, h, key):
            if calls is not None:
                calls[i] += 1
            return h + torch.tanh(h @ p[f"w{i}"])

        return Stage((f"w{i}",), fn)

    embed = Stage(("emb",), lambda p, batch, key: batch[0] @ p["emb"])  # (6, 8)
    head = Stage(
        ("emb",), lambda p, h, batch, key: (((h @ p["emb"].T - batch[1]) ** 2).mean(), {"h_norm": h.detach().norm()})
    )
    return embed, [block_stage(i) for i in range(n_blocks)], head, params, batch


@pytest.mark.parametrize(
    "policy, runs", [("full", [2, 2, 2, 2]), (2, [1, 2, 1, 2]), (3, [1, 1, 2, 1]), ("none", [1, 1, 1, 1])]
)
def test_policy_recomputes_exactly_its_blocks(policy, runs):
    calls = [0] * 4
    embed, blocks, head, params, batch = _toy(calls=calls)
    loss_fn = staged_loss(embed, blocks, head, policy=policy)
    loss, aux, grads = loss_fn.value_and_grad(params, batch, None)
    assert calls == runs

    want, (want_loss, want_aux) = torch.func.grad_and_value(lambda p: loss_fn(p, batch, None), has_aux=True)(params)
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(aux["h_norm"], want_aux["h_norm"], atol=1e-6, rtol=1e-6)
    _assert_grads_close(grads, want)  # tied "emb": embed + head summed; "unused": zeros
    assert torch.equal(grads["unused"], torch.zeros(3))


# ---------------------------------------------------------------------------------------------
# Through the train step


LR, MOMENTUM = 0.1, 0.9


def _opt():
    """Clipping + SGD with momentum: trajectories comparable to rounding (tests/_tol.py)."""
    return optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(optim.warmup_cosine(LR, 2, 10), momentum=MOMENTUM))


def _n(model, batch_size):
    """Terms summed per gradient entry: tokens x the widest matmul."""
    return batch_size * model.cfg.block_size * 4 * model.cfg.n_embd


def test_train_step_with_accumulation_equals_non_remat(tiny_gpt, batches):
    model = tiny_gpt(n_layer=2, dropout=0.1)
    data = batches(model.cfg, 3, batch_size=4)
    state0 = init_state(model, _opt(), seed=0)
    runs = {}
    for remat in ("none", "full", 2):
        step = make_train_step(
            make_gpt_loss_fn(model, chunk_size=8, remat=remat), _opt(), accum_steps=2, compile=False, donate=False
        )
        state, losses = state0, []
        for b in data:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        runs[remat] = (state, losses)
    ref_state, ref_losses = runs["none"]
    assert ref_losses[-1] < ref_losses[0]
    n = _n(model, 4)
    for remat in ("full", 2):
        state, losses = runs[remat]
        _tol.assert_close(torch.tensor(losses), torch.tensor(ref_losses), _tol.rtol(n) * 3, msg=f"{remat} losses")
        assert int(state.step) == 3
        atol = _tol.trajectory_atol(steps=3, gain=_tol.sgd_gain(LR, MOMENTUM), grad_scale=1.0, n=n)
        _tol.assert_close(state.params, ref_state.params, atol, absolute=True, msg=f"{remat} params")
        _tol.assert_close(state.opt_state, ref_state.opt_state, atol, absolute=True, msg=f"{remat} opt_state")


@pytest.mark.slow
def test_compiled_staged_step_matches_eager_with_no_recompiles(tiny_gpt, batches):
    # every-2 on 2 blocks: block 0 kept (vjp closure), block 1 recomputed behind the barrier.
    model = tiny_gpt(n_layer=2, n_embd=32, block_size=16)
    loss_fn = make_gpt_loss_fn(model, remat=2)
    data = batches(model.cfg, 3, batch_size=4)
    state0 = init_state(model, _opt(), seed=0)

    torch._dynamo.reset()
    counters.clear()
    compiled = make_train_step(loss_fn, _opt())
    eager = make_train_step(loss_fn, _opt(), compile=False)
    c_state, e_state = tree.clone(state0), tree.clone(state0)
    n = _n(model, 4)
    for i, b in enumerate(data):
        c_state, c_m = compiled(c_state, b)
        e_state, e_m = eager(e_state, b)
        for k in ("loss", "grad_norm", "update_norm"):
            _tol.assert_close(c_m[k], e_m[k], _tol.rtol(n) * (i + 1), msg=k)
    # the loss and grads; per update group kind (the blocks', the rest's) squared norms and update; the norm
    assert counters["stats"]["unique_graphs"] == 6, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    atol = _tol.trajectory_atol(steps=len(data), gain=_tol.sgd_gain(LR, MOMENTUM), grad_scale=1.0, n=n)
    _tol.assert_close(c_state.params, e_state.params, atol, absolute=True, msg="params")


# ---------------------------------------------------------------------------------------------
# Policies


@pytest.mark.parametrize("policy, want", [("none", "none"), ("full", "full"), (1, 1), (3, 3), ("2", 2)])
def test_parse_policy(policy, want):
    assert parse_policy(policy) == want


@pytest.mark.parametrize("bad", ["half", "", 0, -2, True, 1.5, None, "every2"])
def test_bad_policy_is_a_clear_value_error(tiny_gpt, bad):
    with pytest.raises(ValueError, match=r"'none', 'full' or a positive int N.*got " + re.escape(repr(bad))):
        make_gpt_loss_fn(tiny_gpt(), remat=bad)
    embed, blocks, head, _, _ = _toy()
    with pytest.raises(ValueError, match="remat policy"):
        staged_loss(embed, blocks, head, policy=bad)


# ---------------------------------------------------------------------------------------------
# The engine's halves: what a pipeline rank runs over its own slice of the blocks


@pytest.mark.parametrize("policy", ["none", "full", 2])
def test_the_engine_run_in_two_slices_equals_value_and_grad(tiny_gpt, batches, policy):
    # forward_blocks / backward_blocks over blocks [0, 2) and [2, 4), as two pipeline ranks run them, with
    # the embedding and head around them, give value_and_grad's loss and gradients bit for bit
    model, params, batch, key = _gpt_problem(tiny_gpt, batches, n_layer=4)
    staged = make_gpt_loss_fn(model, remat=policy, staged=True)
    want_loss, _, want = staged.value_and_grad(params, batch, key)
    run = staged.runner

    def params_of(stage, after=None):
        return stage.params(params)

    grads: dict = {}

    def add(stage, g):
        for n, x in g.items():
            grads[n] = x if n not in grads else grads[n] + x

    h, embed_vjp = run.vjp(run.embed, (staged.embed.params(params),), batch, key)
    h, first = staged.forward_blocks(range(0, 2), h, key, params_of)
    h, second = staged.forward_blocks(range(2, 4), h, key, params_of)
    loss, head_vjp, _ = run.vjp(run.head, (staged.head.params(params), h), batch, key, has_aux=True)
    g_head, g = head_vjp(torch.ones_like(loss))
    add(staged.head, g_head)
    box = [g]
    del g
    g = staged.backward_blocks(range(2, 4), second, box, key, params_of, add)
    assert box == []  # taken: the caller holds no reference to the cotangent it passed
    g = staged.backward_blocks(range(0, 2), first, [g], key, params_of, add)
    add(staged.embed, embed_vjp(g)[0])
    assert first == [None, None] and second == [None, None]  # each block's closure freed once used
    assert torch.equal(loss, want_loss)
    assert sorted(grads) == sorted(want)
    for n in want:
        assert torch.equal(grads[n], want[n]), n

    # grad=False (eval): the same output, nothing kept
    with torch.no_grad():
        h0 = run.embed(staged.embed.params(params), batch, key)
    out, kept = staged.forward_blocks(range(4), h0, key, params_of, grad=False)
    h1, _ = staged.forward_blocks(range(4), h0, key, params_of)
    assert torch.equal(out, h1) and kept == [None] * 4
