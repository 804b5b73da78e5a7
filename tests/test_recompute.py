"""functrain.compiler.recompute: cheap values read after the forward are computed again there, not held.

Graphs traced with make_fx (one process, no compiler): which values are recomputed, which stay
held (random ones, ones that would need a large value the backward does not read), and that the
rewritten graph computes the same bits. End to end (compiled sharded step, losses, memory):
bench/sharded.py --remat none, numbers in README "Sharded training".
"""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from functrain.compiler.marks import mark_forward_done
from functrain.compiler.recompute import RecomputePass, recompute_cheap

MARK = torch.ops.functrain.forward_done.default


def _step(x, w1, w2, gy):
    """A block's forward (layer norm, matmul, GELU, a dropout mask, matmul), the mark, then
    backward-like reads of its activations."""
    mu = x.mean(-1, keepdim=True)  # (N, 1)
    rstd = torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)  # (N, 1)
    ln = (x - mu) * rstd  # (N, C) pointwise from x, mu, rstd
    a = ln @ w1  # (N, F)
    act = torch.nn.functional.gelu(a)  # (N, F) pointwise from a
    keep = torch.rand_like(a) > 0.5  # random: never recomputed
    dropped = act * keep  # (N, F) needs the mask, which only the forward holds
    y = mark_forward_done(dropped @ w2)  # (N, 4)
    g_act = (gy @ w2.t()) * keep  # the backward reads: the mask, a (GELU's input), act, ln, rstd
    g_w2 = dropped.t() @ gy
    g_a = torch.ops.aten.gelu_backward(g_act, a)
    g_w1 = ln.t() @ g_a + act.sum()
    g_x = (g_a @ w1.t()) * rstd
    return y, g_w1, g_w2, g_x


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(32, 128, generator=g),
        torch.randn(128, 256, generator=g),
        torch.randn(256, 4, generator=g),
        torch.randn(32, 4, generator=g),
    )


def _by_target(gm, op):
    return [n for n in gm.graph.nodes if n.target is op]


def test_cheap_held_values_are_recomputed_after_the_mark_and_compute_the_same_bits():
    torch.manual_seed(0)
    gm = make_fx(_step)(*_inputs())
    torch.manual_seed(1)
    want = gm(*_inputs())
    n = recompute_cheap(gm.graph)
    gm.recompile()
    nodes = list(gm.graph.nodes)
    mark = nodes.index(_by_target(gm, MARK)[0])
    gelus = _by_target(gm, torch.ops.aten.gelu.default)
    assert len(gelus) == 2  # the forward's, and a copy after the mark for the backward's reads
    forward, again = gelus
    assert nodes.index(forward) < mark < nodes.index(again)
    assert all(nodes.index(u) < mark for u in forward.users)  # the forward's GELU output dies in the forward
    assert again.args[0] is forward.args[0]  # computed again from a, which the backward holds anyway
    # the layer norm's output is computed again from x and its statistics
    subs = _by_target(gm, torch.ops.aten.sub.Tensor)
    assert len(subs) == 2 and nodes.index(subs[1]) > mark and subs[1].args == subs[0].args
    # the random mask is never drawn again: it stays held (the backward reads it), and the dropped
    # activation is computed again from it
    assert len(_by_target(gm, torch.ops.aten.rand_like.default)) == 1
    assert len(_by_target(gm, torch.ops.aten.gt.Scalar)) == 1
    muls = [m for m in _by_target(gm, torch.ops.aten.mul.Tensor) if m.args[1].target is torch.ops.aten.gt.Scalar]
    assert [nodes.index(m) < mark for m in muls] == [True, False, False]  # act * keep, again; g_act * keep
    assert n == 4, n  # act, dropped, ln and rstd (from the variance: small, held longer)
    torch.manual_seed(1)
    got = gm(*_inputs())
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_no_mark_no_change():
    def step(x):
        return torch.nn.functional.gelu(x) * 2

    gm = make_fx(step)(torch.randn(4, 4))
    before = [n.format_node() for n in gm.graph.nodes]
    assert recompute_cheap(gm.graph) == 0
    assert [n.format_node() for n in gm.graph.nodes] == before


def test_a_large_unheld_input_keeps_the_value_held():
    """Recomputing would need a value the backward does not read (here the matmul's output feeding
    exp): the value stays held rather than hold something as large."""

    def step(x, w, gy):
        e = torch.exp(x @ w)  # (N, F): its input (x @ w) is not read after the mark
        y = mark_forward_done(e.sum(-1))
        return y, e * gy

    gm = make_fx(step)(torch.randn(8, 16), torch.randn(16, 32), torch.randn(8, 32))
    assert recompute_cheap(gm.graph) == 0
    assert len(_by_target(gm, torch.ops.aten.exp.default)) == 1


def test_pass_is_cacheable():
    assert RecomputePass().uuid() and RecomputePass().uuid() == RecomputePass().uuid()
