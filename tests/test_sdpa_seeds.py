"""functrain.compiler.sdpa_seeds: dropout-free efficient attention's seed and offset never become CUDA buffers.

The graphs are traced with make_fx on fake CUDA tensors (no GPU and no compiler needed): efficient
attention exists only for CUDA. The rewritten graphs are checked by running fake propagation
through them again, as inductor does for every fallback kernel. End to end (the CUDA step that
crashed without the pass): bench/gpu.sh smoke, run `fp32_nodonate`.
"""

import operator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from functrain.compiler.sdpa_seeds import SdpaSeedPass, unlink_unused_sdpa_seeds

FWD = torch.ops.aten._scaled_dot_product_efficient_attention.default
BWD = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default


def _step(dropout, return_seed=False):
    """Attention forward and backward (as the one-graph step traces them), then a fresh 0-d int64
    value: the AdamW count of a step whose state is not donated."""

    def f(q, k, v, g, count):
        out, lse, seed, offset = FWD(q, k, v, None, True, dropout, True)  # (B, H, T, D), (B, H, 32), (), ()
        dq, dk, dv, _ = BWD(g, q, k, v, None, out, lse, seed, offset, dropout, [True, True, True, False], True)
        new_count = torch.where(dq.sum() > 0, count + 1, count)  # () int64
        return (out, dq, dk, dv, new_count) + ((seed,) if return_seed else ())

    return f


def _trace(f):
    """`f` traced on fake CUDA tensors: (graph module, fake inputs)."""
    with FakeTensorMode() as mode:
        qkv = [torch.empty(2, 4, 16, 8, device="cuda") for _ in range(4)]  # (B, H, T, D)
        args = (*qkv, torch.zeros((), dtype=torch.int64, device="cuda"))
        return make_fx(f, tracing_mode="fake")(*args), args, mode


def _outputs(gm, index):
    """The forward attention's getitem nodes with this output index."""
    return [
        n for n in gm.graph.nodes if n.target is operator.getitem and n.args[0].target is FWD and n.args[1] == index
    ]


def test_fake_propagation_puts_the_seed_on_cuda_while_the_kernel_makes_it_on_cpu():
    """The premise: inductor plans the seed and offset as CUDA buffers (their fake value is on the
    query's device), though the CUDA kernel allocates them on the CPU without dropout. If a torch
    changes this, the pass is harmless and this test says the bug may be gone."""
    gm, _, _ = _trace(_step(0.0))
    seed, offset = _outputs(gm, 2)[0].meta["val"], _outputs(gm, 3)[0].meta["val"]
    assert seed.device.type == offset.device.type == "cuda"
    assert seed.dtype == offset.dtype == torch.int64 and seed.shape == offset.shape == ()


def test_backward_reads_fresh_seeds_and_the_forward_outputs_are_gone():
    gm, args, mode = _trace(_step(0.0))
    bwd = next(n for n in gm.graph.nodes if n.target is BWD)
    assert unlink_unused_sdpa_seeds(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    assert _outputs(gm, 2) == [] and _outputs(gm, 3) == []  # no buffer left to plan, none to reuse
    for arg in bwd.args[7:9]:  # fresh tensors made where inductor plans them (and where they will be)
        assert arg.target is torch.ops.aten.empty.memory_format
        assert arg.kwargs == {"dtype": torch.int64, "device": torch.device("cuda", 0)}
        val = arg.meta["val"]
        assert val.device == torch.device("cuda", 0) and val.dtype == torch.int64 and val.shape == ()
    assert _outputs(gm, 0) and _outputs(gm, 1)  # the output and logsumexp are untouched
    with mode:  # fake propagation through the rewritten graph, as inductor reruns it: same outputs
        out = gm(*args)
    assert [tuple(o.shape) for o in out] == [(2, 4, 16, 8)] * 4 + [()]
    assert out[-1].dtype == torch.int64 and out[-1].device.type == "cuda"
    assert unlink_unused_sdpa_seeds(gm.graph) == 0  # idempotent: nothing left to do


@pytest.mark.parametrize("case", ["dropout", "seed_returned"])
def test_graph_left_alone_when_the_seed_is_needed(case):
    """With dropout the backward reads the seed; a seed read by anything else keeps its buffer."""
    gm, _, _ = _trace(_step(0.1) if case == "dropout" else _step(0.0, return_seed=True))
    before = [n.format_node() for n in gm.graph.nodes]
    n = unlink_unused_sdpa_seeds(gm.graph)
    after = [n.format_node() for n in gm.graph.nodes]
    if case == "dropout":
        assert n == 0 and after == before
    else:  # the offset (read only by the backward) is unlinked, the returned seed is kept
        assert n == 1 and _outputs(gm, 2) and not _outputs(gm, 3)


def test_pass_on_a_graph_without_attention_and_its_cache_key():
    gm = make_fx(lambda x: (x * 2).sum())(torch.ones(3))
    before = [n.format_node() for n in gm.graph.nodes]
    SdpaSeedPass()(gm.graph)
    assert [n.format_node() for n in gm.graph.nodes] == before
    assert SdpaSeedPass().uuid() and SdpaSeedPass().uuid() == SdpaSeedPass().uuid()
