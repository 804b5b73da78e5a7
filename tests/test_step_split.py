"""compile=True on one process: the loss and its gradients one graph, the update group by group after it.

The params' numbered blocks (`update.blocks_by_name`) that are alike share the update's graphs, and
the grad norm is summed as the whole step sums it: the same numbers, bit for bit, as the whole step
compiled as one graph (inductor). The split step against the eager one, and its graph counts, are
tests/test_route_matrix.py's "step" cells and the compile-contract tests (tests/test_step.py).
"""

from __future__ import annotations

import _tol
import pytest
import torch

from functrain import init_state, make_train_step, optim, tree
from functrain.step import update as update_lib


def test_blocks_by_name_finds_the_numbered_container_with_the_most_blocks():
    names = ["wte.weight", "blocks.0.ln.weight", "blocks.0.fc.weight", "blocks.1.ln.weight", "blocks.1.fc.weight"]
    blocks = update_lib.blocks_by_name(dict.fromkeys(names))
    assert blocks == [
        update_lib.Block(("blocks.0.ln.weight", "blocks.0.fc.weight"), "blocks.0."),
        update_lib.Block(("blocks.1.ln.weight", "blocks.1.fc.weight"), "blocks.1."),
    ]
    hf = ["model.embed.weight", *(f"model.layers.{i}.mlp.experts.{e}.w" for i in range(3) for e in range(2))]
    found = update_lib.blocks_by_name(dict.fromkeys(hf + ["heads.0.w"]))
    assert [b.prefix for b in found] == ["model.layers.0.", "model.layers.1.", "model.layers.2."]  # the first number
    assert found[1].names == ("model.layers.1.mlp.experts.0.w", "model.layers.1.mlp.experts.1.w")
    assert [b.prefix for b in update_lib.blocks_by_name(dict.fromkeys(["0.weight", "2.weight"]))] == ["0.", "2."]
    assert update_lib.blocks_by_name(dict.fromkeys(["fc1.weight", "layer10.bias"])) == []  # not a part alone


def _opt(clip: float = 0.05):
    """Clipped AdamW with decay on the matrices only (a mask) and a schedule: every part of the finish."""
    decay = lambda params: {k: v.ndim == 2 for k, v in params.items()}  # noqa: E731
    return optim.chain(
        optim.clip_by_global_norm(clip), optim.adamw(optim.warmup_cosine(3e-2, 2, 20), weight_decay=0.1, mask=decay)
    )


def _whole_one_graph(loss_fn, opt):
    """The step compiled as one graph, as compile=True did before the update was split off: the route
    fullgraph=False takes (graph breaks allowed; this model has none, so it is one graph)."""
    return make_train_step(loss_fn, opt, fullgraph=False)


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
