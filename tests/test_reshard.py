"""functrain.compiler.regather: the post-grad pass that gathers a kept block's parameters again for its backward.

The graphs are traced with make_fx in one process over torch's fake process group (collectives
are recorded, not run). End to end (compiled on 2 gloo ranks, losses and params bit-identical with
and without the pass; memory): bench/sharded.py --remat none, numbers in README "Sharded training".
"""

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from functrain.compiler.marks import mark_forward_done
from functrain.compiler.regather import RegatherPass, regather

GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
BARRIER = torch.ops.functrain.remat_barrier.default
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # (renamed in torch 2.13)


@pytest.fixture(scope="module")
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _trace(group, mark: bool):
    """A one-linear 'step' over FSDP shards: gather (w, b) flat, forward, [mark], backward reads w."""

    def step(w_shard, b_shard, x, gy):
        flat = torch.cat([w_shard.reshape(-1), b_shard.reshape(-1)])  # (8,) this rank's shards
        full = funcol.wait_tensor(_all_gather(flat, 0, group)).view(2, -1)  # (2, 8)
        w = full[:, :6].reshape(4, 3)  # (4, 3) whole weight
        b = full[:, 6:].reshape(4)  # (4,) whole bias
        y = x @ w.t() + b  # forward
        if mark:
            y = mark_forward_done(y)
        gx = gy @ w  # the backward reads w again; b is read only in the forward
        gw = gy.t() @ x
        return y, gx, gw

    args = (torch.randn(2, 3), torch.randn(2), torch.randn(5, 3), torch.randn(5, 4))
    return make_fx(step, tracing_mode="fake")(*args)


def _gathers(graph):
    return [n for n in graph.nodes if n.target is GATHER]


def _ancestors(node):
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def test_late_reads_come_from_a_second_gather_behind_the_cotangent(fake_group):
    gm = _trace(fake_group, mark=True)
    first = _gathers(gm.graph)
    assert len(first) == 1
    assert regather(gm.graph) == 1
    gathers = _gathers(gm.graph)
    assert len(gathers) == 2 and gathers[0] is first[0]
    again = gathers[1]
    nodes = list(gm.graph.nodes)
    mark = next(n for n in nodes if n.target is torch.ops.functrain.forward_done.default)
    assert nodes.index(again) > nodes.index(mark)  # gathered again after the forward
    # its input: the shards flattened again from the step's inputs (nothing shard-sized held),
    # behind a barrier on the backward's cotangent (so it cannot be issued early)
    barrier = again.args[0]
    assert barrier.target is BARRIER and barrier.args[1].name.startswith("gy")
    assert barrier.args[0] is not first[0].args[0] and barrier.args[0].target is torch.ops.aten.cat.default
    # every read after the mark descends from the second gather only, none from the first
    out = next(n for n in nodes if n.op == "output")
    y, gx, gw = out.args[0]
    assert again in _ancestors(gx) and first[0] not in _ancestors(gx)
    assert first[0] in _ancestors(y) and again not in _ancestors(y)
    assert not ({first[0], again} & _ancestors(gw))
    # only what the backward reads is rebuilt: the weight's clone, not the bias's
    clones = [n for n in nodes if n.target is torch.ops.aten.clone.default]
    assert len(clones) == 3, [n.format_node() for n in clones]
    gm.recompile()  # still a valid graph module


def test_no_mark_no_change(fake_group):
    gm = _trace(fake_group, mark=False)
    before = [n.format_node() for n in gm.graph.nodes]
    assert regather(gm.graph) == 0
    assert [n.format_node() for n in gm.graph.nodes] == before


def test_pass_is_cacheable_and_the_step_installs_it():
    """Inductor caches a graph only when every custom pass has a uuid; make_train_step adds the
    passes (recompute, regather, then the attention seeds') to the compiled step's options, after
    any pass of the caller's."""
    from functrain.compiler import InTurn, with_step_passes
    from functrain.compiler.recompute import RecomputePass
    from functrain.compiler.sdpa_seeds import SdpaSeedPass

    p = RegatherPass()
    assert p.uuid() and p.uuid() == RegatherPass().uuid()
    mine = object()
    opts = with_step_passes({"options": {"post_grad_custom_post_pass": mine, "max_autotune": False}})
    one = opts["options"]["post_grad_custom_post_pass"]
    assert isinstance(one, InTurn)  # (one pass: the form every supported torch takes)
    passes = one.passes
    assert passes[0] is mine and isinstance(passes[1], RecomputePass) and isinstance(passes[2], RegatherPass)
    assert isinstance(passes[3], SdpaSeedPass) and len(passes) == 4
    assert SdpaSeedPass().uuid() and SdpaSeedPass().uuid() == passes[3].uuid()
    assert opts["options"]["max_autotune"] is False
    assert "options" not in with_step_passes({"backend": "aot_eager"})
    both = {"mode": "max-autotune", "options": {"max_autotune": False}}
    assert with_step_passes(both) == both  # (torch.compile refuses a mode with options: its error, unchanged)
    none = with_step_passes({"mode": None, "options": {"max_autotune": False}})  # (mode=None is no mode)
    assert "mode" not in none and isinstance(none["options"]["post_grad_custom_post_pass"].passes[-1], SdpaSeedPass)


@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead", "default"])
def test_a_mode_becomes_its_options_and_the_passes_run_under_it(mode):
    """torch.compile takes a mode or options: the step turns a mode into the inductor options it
    stands for (so the post-grad passes can be added), and torch.compile's inductor config is then
    the mode's, plus the passes."""
    from functrain.compiler import with_step_passes
    from functrain.compiler.sdpa_seeds import SdpaSeedPass

    opts = with_step_passes({"mode": mode, "fullgraph": True})
    assert "mode" not in opts and opts["fullgraph"] is True
    passes = opts["options"].pop("post_grad_custom_post_pass").passes
    assert isinstance(passes[-1], SdpaSeedPass)
    wrapper = torch._TorchCompileInductorWrapper
    assert wrapper(None, opts["options"], None).config == wrapper(mode, None, None).config


def test_in_turn_runs_the_passes_in_order_as_one_pass():
    """Torch 2.11 (the GPU machines' CUDA build) takes one post-grad pass, not a list: `InTurn`
    is that one pass. Inductor runs it given alone; it runs each member in order, and its cache key is
    made of theirs (None when one member has none: then inductor does not cache the graph)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from functrain.compiler import InTurn

    calls = []

    class Note(CustomGraphPass):
        def __init__(self, name):
            self.name = name

        def __call__(self, graph):
            calls.append((self.name, sum(n.op == "call_function" for n in graph.nodes)))

        def uuid(self):
            return self.name

    both = InTurn([Note("a"), Note("b")])
    fn = torch.compile(
        lambda x: (x.sin() * 2).sum(),
        backend="inductor",
        fullgraph=True,
        options={"post_grad_custom_post_pass": both, "fx_graph_cache": False},
    )
    x = torch.randn(8)
    assert torch.allclose(fn(x), (x.sin() * 2).sum())
    assert [name for name, _ in calls] == ["a", "b"] and calls[0][1] > 0
    assert both.uuid() == ("a", "b") and InTurn([Note("a"), Note("c")]).uuid() != both.uuid()
    assert InTurn([Note("a"), lambda graph: None]).uuid() is None


def test_mark_is_a_copy():
    h = torch.randn(3, 4)
    out = mark_forward_done(h)
    assert torch.equal(out, h) and out.data_ptr() != h.data_ptr()


def _source(node):
    """The all-gather a rearranged gathered value comes from."""
    while node.target is not GATHER:
        node = node.args[0]
    return node


def _trace_two_blocks(group):
    """Two linear 'blocks', each gathered on its own: forward 0, 1, mark, backward 1, 0."""

    def step(w0_shard, w1_shard, x, gy):
        def gathered(shard):
            return funcol.wait_tensor(_all_gather(shard.reshape(-1), 0, group)).view(4, 4)  # (4, 4)

        w0, w1 = gathered(w0_shard), gathered(w1_shard)
        h = x @ w0.t()
        y = mark_forward_done(h @ w1.t())
        g1 = gy @ w1  # block 1's backward, then block 0's
        g0 = torch.tanh(g1) @ w0
        return y, g0

    args = (torch.randn(2, 4), torch.randn(2, 4), torch.randn(5, 4), torch.randn(5, 4))
    return make_fx(step, tracing_mode="fake")(*args)


@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_issues_the_next_blocks_gather_one_block_early(fake_group, prefetch):
    gm = _trace_two_blocks(fake_group)
    assert regather(gm.graph, prefetch=prefetch) == 2
    nodes = list(gm.graph.nodes)
    gathers = [n for n in nodes if n.target is GATHER]
    again1, again0 = gathers[2:]  # block 1's (read first in the backward), then block 0's
    mms = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    read1, read0 = mms[2:]  # g1 = gy @ w1, g0 = tanh(g1) @ w0
    assert _source(read1.args[1]) is again1 and _source(read0.args[1]) is again0  # the weights read
    assert _source(mms[0].args[1]) is gathers[0] and _source(mms[1].args[1]) is gathers[1]  # forward: first ones
    wait0 = next(iter(again0.users))
    assert nodes.index(wait0) < nodes.index(read0)
    if prefetch:  # block 0's gather goes out before block 1's backward, behind block 1's cotangent
        assert nodes.index(again0) < nodes.index(read1) and again0.args[0].args[1].name.startswith("gy")
        assert nodes.index(wait0) > nodes.index(read1)  # and is waited for only where it is read
    else:
        assert nodes.index(again0) > nodes.index(read1) and again0.args[0].args[1].target is torch.ops.aten.tanh.default
    gm.recompile()


def _trace_blocks(group, n: int):
    """`n` linear 'blocks' gathered one ahead as the staged loss does (block i+1's all-gather issued
    before block i computes), the mark, then their backward in reverse reading each weight again."""

    def step(*args):
        *shards, x, gy = args
        pending = _all_gather(shards[0].reshape(-1), 0, group)
        weights, h = [], x
        for i in range(n):
            w = funcol.wait_tensor(pending).view(4, 4)  # (4, 4) block i's whole weight
            if i + 1 < n:
                pending = _all_gather(shards[i + 1].reshape(-1), 0, group)  # the next block's, in flight
            weights.append(w)
            h = torch.tanh(h @ w.t())
        y = mark_forward_done(h)
        g = gy
        for w in reversed(weights):
            g = torch.tanh(g) @ w
        return y, g

    args = [torch.randn(2, 4) for _ in range(n)] + [torch.randn(5, 4), torch.randn(5, 4)]
    return make_fx(step, tracing_mode="fake")(*args)


@pytest.mark.parametrize("prefetch", [True, False])
def test_at_most_two_blocks_are_gathered_at_once(fake_group, prefetch):
    """The model of the graph's buffers: without the pass every kept block is gathered at the mark;
    with it, two at most (the block computing and the one in flight), forward and backward."""
    from functrain.compiler.regather import gathered_in_flight

    n, block = 4, 16 * 4  # (4, 4) float32 per block
    gm = _trace_blocks(fake_group, n)
    before = gathered_in_flight(gm.graph)
    assert before == {"peak_bytes": n * block, "gathers": n, "largest_bytes": block, "alive_at_peak": n}
    assert regather(gm.graph, prefetch=prefetch) == n
    after = gathered_in_flight(gm.graph)
    assert after["gathers"] == 2 * n and after["largest_bytes"] == block
    assert after["peak_bytes"] == 2 * block and after["alive_at_peak"] == 2
    gm.recompile()
