"""compile=True on one process: the loss and its gradients one graph, the update group by group after it.

The params' numbered blocks (`update_groups.blocks_by_name`) that are alike share the update's graphs, and
the grad norm is summed as the whole step sums it: the same numbers, bit for bit, as the whole step
compiled as one graph (inductor), and the eager step's to rounding (aot_eager). Graph counts: the loss
and grads; per update group kind (the blocks', the rest's) the grads' squared norms and the update; the
norm (docs/compiler.md "Compile units").
"""

from __future__ import annotations

import functools

import _tol
import pytest
import torch
from torch._dynamo.utils import counters

from functrain import init_state, make_train_step, optim, tree
from functrain.step import steps as steps_lib
from functrain.step import update_groups


def test_blocks_by_name_finds_the_numbered_container_with_the_most_blocks():
    names = ["wte.weight", "blocks.0.ln.weight", "blocks.0.fc.weight", "blocks.1.ln.weight", "blocks.1.fc.weight"]
    blocks = update_groups.blocks_by_name(dict.fromkeys(names))
    assert blocks == [
        update_groups.Block(("blocks.0.ln.weight", "blocks.0.fc.weight"), "blocks.0."),
        update_groups.Block(("blocks.1.ln.weight", "blocks.1.fc.weight"), "blocks.1."),
    ]
    hf = ["model.embed.weight", *(f"model.layers.{i}.mlp.experts.{e}.w" for i in range(3) for e in range(2))]
    found = update_groups.blocks_by_name(dict.fromkeys(hf + ["heads.0.w"]))
    assert [b.prefix for b in found] == ["model.layers.0.", "model.layers.1.", "model.layers.2."]  # the first number
    assert found[1].names == ("model.layers.1.mlp.experts.0.w", "model.layers.1.mlp.experts.1.w")
    assert [b.prefix for b in update_groups.blocks_by_name(dict.fromkeys(["0.weight", "2.weight"]))] == ["0.", "2."]
    assert update_groups.blocks_by_name(dict.fromkeys(["fc1.weight", "layer10.bias"])) == []  # not a part alone


def _opt(clip: float = 0.05):
    """Clipped AdamW with decay on the matrices only (a mask) and a schedule: every part of the finish."""
    decay = lambda params: {k: v.ndim == 2 for k, v in params.items()}  # noqa: E731
    return optim.chain(
        optim.clip_by_global_norm(clip), optim.adamw(optim.warmup_cosine(3e-2, 2, 20), weight_decay=0.1, mask=decay)
    )


def _whole_one_graph(loss_fn, opt):
    """The step compiled as one graph, as compile=True did before the update was split off."""
    spec = steps_lib._train_spec(
        loss_fn,
        opt,
        accum_steps=1,
        accum_impl="unroll",
        precision=None,
        skip_nonfinite=True,
        donate=True,
        fullgraph=True,
        model_state_sync="broadcast",
        count_targets=None,
    )
    build, wrap = steps_lib._one_graph_route(spec, None, compiled=True)
    return functools.partial(steps_lib._checked_step, loss_fn, steps_lib._PerLayout(build, wrap))


def test_the_split_step_equals_eager_in_six_graphs(tiny_gpt, batches, gpt_loss_fn):
    model = tiny_gpt(n_layer=2)
    data = batches(model.cfg, 3, batch_size=4)
    loss_fn, state = gpt_loss_fn(model), init_state(model, _opt(), seed=0)
    torch._dynamo.reset()
    counters.clear()
    compiled = make_train_step(loss_fn, _opt(), compile_options={"backend": "aot_eager"})
    eager = make_train_step(loss_fn, _opt(), compile=False)
    c, e = state, tree.clone(state)
    for i, b in enumerate(data):
        c, cm = compiled(c, b)
        e, em = eager(e, b)
        for k in ("loss", "grad_norm", "update_norm", "lr"):
            _tol.assert_close(cm[k], em[k], _tol.rtol(4 * 16 * 4 * 32) * (i + 1), msg=k)
    _tol.assert_close(c.params, e.params, _tol.rtol(4 * 16 * 4 * 32) * len(data), msg="params")
    assert int(c.step) == len(data) and float(em["grad_norm"]) > 0.05  # the clip was active
    assert counters["stats"]["unique_graphs"] == 6 and not counters["recompiles"], dict(counters["stats"])


def test_without_alike_blocks_the_update_is_one_graph_after_the_loss(tiny_gpt, batches, gpt_loss_fn):
    model = tiny_gpt(n_layer=1)  # one block: nothing to share
    data = batches(model.cfg, 2, batch_size=4)
    state = init_state(model, _opt(), seed=0)
    torch._dynamo.reset()
    counters.clear()
    step = make_train_step(gpt_loss_fn(model), _opt(), compile_options={"backend": "aot_eager"})
    for b in data:
        state, _ = step(state, b)
    assert counters["stats"]["unique_graphs"] == 2 and not counters["recompiles"], dict(counters["stats"])


@pytest.mark.slow
@pytest.mark.numeric
def test_the_split_step_is_the_whole_one_graph_step_bit_for_bit(tiny_gpt, batches, gpt_loss_fn):
    """Inductor: the loss, grad norm (clipping active), learning rate and every param and moment after each step
    equal the whole step compiled as one graph; only the update norm (a metric, summed group by group) may
    differ by rounding."""
    model = tiny_gpt(n_layer=3, n_embd=64, block_size=32)
    data = batches(model.cfg, 4, batch_size=8)
    loss_fn = gpt_loss_fn(model)
    split, whole = make_train_step(loss_fn, _opt()), _whole_one_graph(loss_fn, _opt())
    a, b = init_state(model, _opt(), seed=0), init_state(model, _opt(), seed=0)
    for batch in data:
        a, ma = split(a, batch)
        b, mb = whole(b, batch)
        for k in ("loss", "grad_norm", "lr"):
            assert torch.equal(ma[k], mb[k]), (k, float(ma[k]), float(mb[k]))
        _tol.assert_close(ma["update_norm"], mb["update_norm"], _tol.rtol(64 * 64 * 3), msg="update_norm")
        assert float(ma["grad_norm"]) > 0.05  # the clip scaled this step's gradients
        for (name, x), y in zip(tree.named_leaves((a.params, a.opt_state)), tree.leaves((b.params, b.opt_state))):
            assert torch.equal(x, y), name
