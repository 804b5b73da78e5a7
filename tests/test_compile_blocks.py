"""make_train_step(..., compile="blocks"): a graph per stage kind, one block graph for every block.

The contract: the step equals the eager step (to rounding), the number of graphs does not grow with
depth nor change from step to step, and bad uses are one clear error. Most checks use the
"aot_eager" backend (Dynamo + AOTAutograd, the same graphs and autograd, no code generation) to stay
fast; one runs inductor for real.
"""

from __future__ import annotations

import _tol
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from functrain import init_state, make_eval_step, make_train_step, optim
from functrain.models.gpt import make_loss_fn as make_gpt_loss_fn
from functrain.step.staged import Stage, staged_loss

LR, MOMENTUM = 0.05, 0.9


def _opt():
    """Clipping + SGD with momentum: trajectories comparable to rounding (tests/_tol.py)."""
    return optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(optim.warmup_cosine(LR, 2, 10), momentum=MOMENTUM))


def _run(tiny_gpt, batches, n_layer, policy, compile, options=None, steps=3, wrap=lambda step: step):
    """(final state, per-step metrics, dynamo stats) of `steps` steps of a tiny GPT with dropout."""
    model = tiny_gpt(n_layer=n_layer, n_embd=32, block_size=16, dropout=0.1)
    loss_fn = make_gpt_loss_fn(model, remat=policy, staged=True)
    torch._dynamo.reset()
    counters.clear()
    step = wrap(make_train_step(loss_fn, _opt(), compile=compile, compile_options=options))
    state, hist = init_state(model, _opt(), seed=0), []
    for b in batches(model.cfg, steps, batch_size=4):
        state, m = step(state, b)
        hist.append({k: float(v) for k, v in m.items()})
    stats = {
        "graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(counters["recompiles"].values()),
        "breaks": sum(counters["graph_break"].values()),
    }
    return state, hist, stats, model


def _assert_same_run(got, want, model, steps=3):
    """Losses, norms and params of two runs equal to rounding (tolerances from tests/_tol.py)."""
    (g_state, g_hist), (w_state, w_hist) = got, want
    n = 4 * model.cfg.block_size * 4 * model.cfg.n_embd  # tokens x the widest matmul
    for i, (g, w) in enumerate(zip(g_hist, w_hist)):
        for k in ("loss", "grad_norm", "update_norm"):
            _tol.assert_close(torch.tensor(g[k]), torch.tensor(w[k]), _tol.rtol(n) * (i + 1), msg=k)
    atol = _tol.trajectory_atol(steps=steps, gain=_tol.sgd_gain(LR, MOMENTUM), grad_scale=1.0, n=n)
    _tol.assert_close(g_state.params, w_state.params, atol, absolute=True, msg="params")
    _tol.assert_close(g_state.opt_state, w_state.opt_state, atol, absolute=True, msg="opt_state")


# graphs: prepare, embedding, block (with grad), head; + the no-grad block for recomputation; the
# optimizer update group by group (functrain.step.update.grouped_update): one graph for every block, one for the
# rest. Every 2nd block recomputed covers kept and recomputed blocks (remat "none" alone: the 2-rank
# blocks_kept_fsdp case in tests/test_parallel_dist.py).
GRAPHS = 5 + 2


@pytest.mark.slow
@pytest.mark.parametrize("policy, graphs", [(2, GRAPHS)], ids=["every2"])
def test_blocks_equal_eager_with_as_many_graphs_at_any_depth(tiny_gpt, batches, policy, graphs):
    _, _, stats, _ = _run(tiny_gpt, batches, 2, policy, "blocks", {"backend": "aot_eager"})
    assert stats == {"graphs": graphs, "recompiles": 0, "breaks": 0}, stats
    state, hist, stats, model = _run(tiny_gpt, batches, 4, policy, "blocks", {"backend": "aot_eager"})
    assert stats == {"graphs": graphs, "recompiles": 0, "breaks": 0}, stats  # not one more per block
    e_state, e_hist, _, _ = _run(tiny_gpt, batches, 4, policy, False)
    _assert_same_run((state, hist), (e_state, e_hist), model)
    assert hist[-1]["loss"] < hist[0]["loss"]


@pytest.mark.slow
def test_blocks_with_inductor_equal_eager(tiny_gpt, batches):
    # every-2 on 2 blocks: block 0 kept (autograd through its compiled forward), block 1 recomputed.
    state, hist, stats, model = _run(tiny_gpt, batches, 2, 2, "blocks")
    assert stats == {"graphs": GRAPHS, "recompiles": 0, "breaks": 0}, stats
    e_state, e_hist, _, _ = _run(tiny_gpt, batches, 2, 2, False)
    _assert_same_run((state, hist), (e_state, e_hist), model)


def test_blocks_eval_step_uses_the_stage_graphs(tiny_gpt, batches):
    model = tiny_gpt(n_layer=3, n_embd=32, block_size=16, dropout=0.1)
    loss_fn = make_gpt_loss_fn(model, remat="full")
    state = init_state(model, _opt(), seed=0)
    (b,) = batches(model.cfg, 1, batch_size=4)
    torch._dynamo.reset()
    counters.clear()
    got = make_eval_step(loss_fn, compile="blocks", compile_options={"backend": "aot_eager"})(state, b)
    want = make_eval_step(loss_fn, compile=False)(state, b)
    _tol.assert_close(got["loss"], want["loss"], _tol.rtol(4 * 16 * 128), msg="eval loss")
    assert counters["stats"]["unique_graphs"] == 3  # embedding, block, head (no grad): not one per block


def _toy_stages(shared: bool, policy="full"):
    """A 3-block toy staged loss; its blocks share one function only when `shared`."""

    def block_fn(own, h, key, index):
        return h + torch.tanh(h @ own["w"])

    blocks = [
        Stage(
            (f"b{i}.w",),
            lambda p, h, key, i=i: block_fn({"w": p[f"b{i}.w"]}, h, key, i),
            block_fn if shared else None,
            f"b{i}.",
            i,
        )
        for i in range(3)
    ]
    embed = Stage(("e",), lambda p, batch, key: batch @ p["e"])
    head = Stage((), lambda p, h, batch, key: h.square().mean())
    return staged_loss(embed, blocks, head, policy=policy)


def test_toy_blocks_share_one_graph_and_equal_eager():
    params = {"e": torch.randn(4, 8), **{f"b{i}.w": torch.randn(8, 8) / 3 for i in range(3)}}
    batch = torch.randn(5, 4)
    loss_fn = _toy_stages(shared=True)
    torch._dynamo.reset()
    counters.clear()
    loss, _, grads = loss_fn.compile_stages({"backend": "aot_eager"}).value_and_grad(params, batch, None)
    want_loss, _, want = loss_fn.value_and_grad(params, batch, None)
    _tol.assert_close(loss, want_loss, _tol.rtol(8), msg="loss")
    _tol.assert_close(grads, want, _tol.rtol(8 * 5), msg="grads")
    assert counters["stats"]["unique_graphs"] == 4  # embedding, block (no grad, with grad), head


def test_blocks_without_a_shared_function_is_a_clear_error():
    with pytest.raises(ValueError, match="same Stage.shared"):
        _toy_stages(shared=False).compile_stages()


def test_blocks_needs_a_staged_loss_and_unrolled_accumulation(tiny_gpt):
    model = tiny_gpt(n_layer=1)
    with pytest.raises(ValueError, match="has no stages.*staged=True"):
        make_train_step(make_gpt_loss_fn(model), _opt(), compile="blocks")
    with pytest.raises(ValueError, match="accum_impl='unroll'"):
        make_train_step(
            make_gpt_loss_fn(model, staged=True), _opt(), compile="blocks", accum_steps=2, accum_impl="scan"
        )
    with pytest.raises(ValueError, match="compile must be"):
        make_train_step(make_gpt_loss_fn(model), _opt(), compile="block")
