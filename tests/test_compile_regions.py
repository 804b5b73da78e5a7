"""make_train_step(..., compile="regions"): one step graph whose block is a compiled region.

The contract: the step equals the eager step (to rounding), it is ONE graph with no recompiles, and
its block (forward and backward), the blocks' grad norms and the blocks' optimizer update are each
ONE region body called once per block: the bodies do not grow with depth. Bad uses are one clear
error. Most checks use "aot_eager" (Dynamo + AOTAutograd: the same graph, regions and autograd, no
code generation); one runs inductor, where torch 2.13 needs both of `functrain.regions`' mends.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.config
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from functrain import init_state, make_eval_step, make_train_step, optim, regions
from functrain.models.gpt import make_loss_fn as make_gpt_loss_fn
from functrain.validate import ConfigError, check_all
from functrain.models.checks import LM_CHECKS

import _tol
from test_compile_blocks import _assert_same_run, _opt, _run, _toy_stages


def _capturing():
    """(aot_eager backend that keeps every Dynamo graph, the list it appends to)."""
    graphs = []
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    return backend, graphs


def _regions(gm) -> tuple[int, int]:
    """(invoke_subgraph calls, distinct region bodies) in a Dynamo graph."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph]
    return len(calls), len({n.args[0].target for n in calls})


@pytest.mark.parametrize("n_layer", [2, 4])
def test_regions_step_is_one_graph_with_one_body_per_region_at_any_depth(tiny_gpt, batches, n_layer):
    backend, graphs = _capturing()
    state, hist, stats, model = _run(tiny_gpt, batches, n_layer, "none", "regions", {"backend": backend})
    assert stats == {"graphs": 1, "recompiles": 0, "breaks": 0}, stats
    assert len(graphs) == 1
    # bodies: the block, a block's squared grad norm, a block's optimizer update (the rest's
    # parameters, embeddings and final norm: one group, called once, not a region call in the graph)
    assert _regions(graphs[0]) == (3 * n_layer, 3)
    e_state, e_hist, _, _ = _run(tiny_gpt, batches, n_layer, "none", False)
    _assert_same_run((state, hist), (e_state, e_hist), model)
    assert hist[-1]["loss"] < hist[0]["loss"]


def test_regions_with_inductor_equal_eager(tiny_gpt, batches):
    # Three blocks: the third is served from Dynamo's region cache (the reuse mend), and inductor's
    # buffer reuse would clobber the blocks' saved inputs (the allow_buffer_reuse mend).
    codes = []

    def keep_code(step):
        """The step, its first call's inductor code kept in `codes` (compiled past the FX/AOT caches)."""
        def first(state, batch):
            if codes:
                return step(state, batch)
            with torch._inductor.config.patch(fx_graph_cache=False), \
                    torch._functorch.config.patch(enable_autograd_cache=False):
                out, code = run_and_get_code(step, state, batch)
            codes.extend(code)
            return out
        return first

    state, hist, stats, model = _run(tiny_gpt, batches, 3, "none", "regions", wrap=keep_code)
    assert stats == {"graphs": 1, "recompiles": 0, "breaks": 0}, stats
    e_state, e_hist, _, _ = _run(tiny_gpt, batches, 3, "none", False)
    _assert_same_run((state, hist), (e_state, e_hist), model)
    # Donation after each update region is one opaque copy per group (regions.write_into): its
    # params and its momentum (SGD's one moment) written straight into the step's input buffers
    # (graph inputs are named arg*); one per group (3 blocks + the rest), and nothing else.
    calls = re.findall(r"torch\.ops\.functrain\.copy_into\.default\(\[([^\]]*)\]", "\n".join(codes))
    assert len(calls) == 3 + 1, calls
    assert all(re.fullmatch(r"arg\d+_1", d.strip()) for c in calls for d in c.split(",")), calls


def test_a_pure_block_is_traced_once_and_its_gradients_reach_every_block():
    # A block without side effects (no nn.Module swap): Dynamo reuses the first call's trace for the
    # others, whose fake outputs must still reach their inputs (functrain.regions' reuse mend;
    # without it the traced autograd.grad finds the earlier blocks unused and their gradients come
    # out as zeros: grad_norm off by its whole size).
    params = {"e": torch.randn(4, 8), **{f"b{i}.w": torch.randn(8, 8) / 3 for i in range(3)}}
    batch = torch.randn(5, 4)
    loss_fn = _toy_stages(shared=True, policy="none")
    backend, graphs = _capturing()
    torch._dynamo.reset()
    counters.clear()
    got = make_train_step(loss_fn, optim.sgd(0.1), compile="regions", compile_options={"backend": backend},
                          donate=False)
    want = make_train_step(loss_fn, optim.sgd(0.1), compile=False, donate=False)
    state = init_state(params, optim.sgd(0.1))
    (g_state, g_m), (w_state, w_m) = got(state, batch), want(state, batch)
    _tol.assert_close(g_m["grad_norm"], w_m["grad_norm"], _tol.rtol(8 * 5), msg="grad_norm")
    _tol.assert_close(g_state.params, w_state.params, _tol.rtol(8 * 5), msg="params")
    assert counters["stats"]["unique_graphs"] == 1
    assert _regions(graphs[0])[0] >= 3  # the three block calls (at least)


def test_regions_eval_step_is_one_graph_with_the_block_once(tiny_gpt, batches):
    model = tiny_gpt(n_layer=3, n_embd=32, block_size=16, dropout=0.1)
    loss_fn = make_gpt_loss_fn(model, staged=True)
    state = init_state(model, _opt(), seed=0)
    (b,) = batches(model.cfg, 1, batch_size=4)
    backend, graphs = _capturing()
    torch._dynamo.reset()
    got = make_eval_step(loss_fn, compile="regions", compile_options={"backend": backend})(state, b)
    want = make_eval_step(loss_fn, compile=False)(state, b)
    _tol.assert_close(got["loss"], want["loss"], _tol.rtol(4 * 16 * 128), msg="eval loss")
    assert len(graphs) == 1 and _regions(graphs[0]) == (3, 1)


def test_regions_bad_uses_are_one_clear_error(tiny_gpt, batches):
    model = tiny_gpt(n_layer=2)
    with pytest.raises(ValueError, match="has no stages.*staged=True"):
        make_train_step(make_gpt_loss_fn(model), _opt(), compile="regions")
    with pytest.raises(ValueError, match="remat 'none'"):
        make_train_step(make_gpt_loss_fn(model, remat="full", staged=True), _opt(), compile="regions")
    with pytest.raises(ValueError, match="accum_impl='unroll'"):
        make_train_step(make_gpt_loss_fn(model, staged=True), _opt(), compile="regions", accum_steps=2,
                        accum_impl="scan")


def test_regions_config_needs_remat_none():
    config = {"compile_unit": "regions", "remat": "full", "loss_chunk_size": 0,
              "sample": {"max_new_tokens": 1, "temperature": 1.0, "top_k": 0}}
    with pytest.raises(ConfigError, match="compile_unit='regions', remat='full': .*remat to 'none'"):
        check_all(config, LM_CHECKS)
    check_all({**config, "remat": "auto"}, LM_CHECKS)
    check_all({**config, "compile_unit": "step"}, LM_CHECKS)


def test_write_into_copies_into_the_old_buffers_with_a_well_declared_op():
    old = {"a": torch.zeros(3, 2), "b": {"c": torch.zeros(4)}}
    new = {"a": torch.randn(3, 2), "b": {"c": torch.randn(4)}}
    ptrs = [old["a"].data_ptr(), old["b"]["c"].data_ptr()]
    got = regions.write_into(old, new)
    assert got is old and [got["a"].data_ptr(), got["b"]["c"].data_ptr()] == ptrs
    assert torch.equal(got["a"], new["a"]) and torch.equal(got["b"]["c"], new["b"]["c"])
    # schema (dst mutated, nothing returned), fake rule and autograd registration agree with the op
    torch.library.opcheck(torch.ops.functrain.copy_into.default, ([torch.zeros(3), torch.zeros(2, 2)],
                                                                  [torch.randn(3), torch.randn(2, 2)]))
