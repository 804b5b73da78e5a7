"""Sharded training on 2 (and 4) gloo processes on CPU vs the single-process run.

Each suite is one launch of plain subprocesses with torchrun's env vars (tests/_dist_launch.py);
the worker (tests/_dist_parallel_worker.py) runs every scenario of the suite, each against the
plain single-process run of the same global batches, and reports numbers per scenario.
The route matrix (`matrix_cells`: 5 aot_eager captures on both ranks that hold every value pair of
unit, precision, accumulation and mesh; all 20 cells under `pytest -m exhaustive`) is a launch of
its own (matrix2). Cost on 2 idle CPU cores: eager2 ~15 s, eager4 ~35 s and ~50 s a compiled
scenario, single ~6 s, compiled2 ~145 s with a cold inductor cache (one inductor compile, the
kept-blocks FSDP step, and six aot_eager captures, each on both ranks at once; ~240 s when the
whole-model-gather FSDP step was inductor too, as it is in the exhaustive suite; the TP step under
inductor was checked by hand: one graph, params within 1.3e-7 of one process after 20 steps). Each
rank prints where its scenarios start ("scenario compiled_tp at 14.2 s").
"""

from __future__ import annotations

import math
import os

import _tol
import pytest
import torch
from _dist_launch import REPO, run_suite, scenario_results
from _dist_parallel_worker import COLLECTIVE_TIMEOUT_S, matrix_cells, two_dim_cells

pytestmark = [pytest.mark.numeric, pytest.mark.slow]

WORKER = os.path.join(REPO, "tests", "_dist_parallel_worker.py")
# The worker's problem: global batch 8 x 16 tokens through matmuls up to 4 x 32 wide; losses ~4;
# gradients clipped to norm 1; SGD lr 0.05, momentum 0.9 (tests/_tol.py).
N = 8 * 16 * 4 * 32
GRAD_TOL = _tol.rtol(N)  # relative to the (clipped, <= 1) gradient


def _tols(steps, dtype=torch.float32):
    """(loss, params) tolerances after `steps` sharded vs single-process steps."""
    loss, _, params = _tol.split_run(steps, N, dtype)
    return loss, params


def _suite(tmp_path_factory, suite: str, nprocs: int):
    # To hunt a rank that dies or desynchronizes, add env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} to
    # run_ranks (_dist_launch.run_suite): each collective's op and shapes are compared across ranks
    # first, and a dead peer is named (it costs ~30% of the suite).
    return run_suite(WORKER, str(tmp_path_factory.mktemp(suite)), suite, nprocs)


def _suite_fixture(suite: str, nprocs: int):
    """A module-scoped fixture: the results of `suite`, launched once on `nprocs` ranks."""

    @pytest.fixture(scope="module", name=suite)
    def results(tmp_path_factory):
        return _suite(tmp_path_factory, suite, nprocs)

    return results


eager2 = _suite_fixture("eager2", 2)
eager4 = _suite_fixture("eager4", 4)
compiled2 = _suite_fixture("compiled2", 2)
matrix2 = _suite_fixture("matrix2", 2)
matrix2_exhaustive = _suite_fixture("matrix2_exhaustive", 2)
eager4_exhaustive = _suite_fixture("eager4_exhaustive", 4)
compiled2_exhaustive = _suite_fixture("compiled2_exhaustive", 2)


def _assert_matches_single_process(res, steps=20):
    loss_tol, params_tol = _tols(steps)
    assert res["metric_keys_equal"]
    assert res["loss"] <= loss_tol, res
    assert res["grad_norm"] <= GRAD_TOL * steps, res
    assert res["params"] <= params_tol, res
    assert res["opt_state"] <= params_tol, res


@pytest.mark.parametrize(
    "name, placement",
    [
        ("fsdp", ["Shard(dim=0)"]),  # 20 steps, dp_shard=2
        ("tp", ["Shard(dim=0)"]),  # 20 steps, tp=2 (q.weight colwise)
        ("ddp", ["Replicate()"]),  # 20 steps, dp_replicate=2
    ],
)
def test_twenty_steps_match_single_process(eager2, name, placement):
    for res in scenario_results(eager2, name):
        _assert_matches_single_process(res)
        assert res["step"] == 20
        assert res["placements"]["blocks.0.attn.q.weight"] == placement


@pytest.mark.parametrize("name", ["adamw_fsdp", "adamw_tp", "adamw_traced_fsdp"])
def test_adamw_step_and_sharded_moments_match_single_process(eager2, name):
    for res in scenario_results(eager2, name):
        assert res["metric_keys_equal"] and res["step"] == 1
        assert res["loss"] <= _tols(1)[0] and res["grad_norm"] <= GRAD_TOL, res
        # mu = 0.1 g, nu = 0.001 g^2 after one step (the clipped g <= 1): rounding of g only.
        assert res["opt_state"] <= GRAD_TOL, res


@pytest.mark.parametrize("name", ["fsdp_bias", "tp_bias"])
def test_biases_sharded_colwise_and_rowwise(eager2, name):
    for res in scenario_results(eager2, name):
        _assert_matches_single_process(res, steps=10)


@pytest.mark.parametrize("name", ["bf16_fsdp", "bf16_tp"])
def test_bf16_sharded_matches_bf16_single_process_with_fp32_masters(eager2, name):
    for res in scenario_results(eager2, name):
        assert res["param_dtypes"] == ["torch.float32"]
        # bf16 matmuls over half the batch (or half the heads) round differently than over the
        # whole: the tolerance is bf16's, not fp32's.
        loss_tol, params_tol = _tols(10, torch.bfloat16)
        assert res["loss"] <= loss_tol and res["params"] <= params_tol, res
        assert res["loss"] > 0 or res["params"] > 0  # it did compute in bf16 (fp32 matches to 1e-6)


@pytest.mark.parametrize("name", ["nan_fsdp", "nan_tp"])
def test_nan_on_one_rank_skips_the_update_on_every_rank(eager2, name):
    for res in scenario_results(eager2, name):
        assert res["skipped"] == [0.0, 0.0, 1.0, 0.0, 0.0] == res["ref_skipped"], res
        assert res["guard"] == [1, 0]
        _assert_matches_single_process(res, steps=5)


def test_tensor_parallel_computes_on_local_shards(eager2):
    for res in scenario_results(eager2, "tp_is_local"):
        assert res["q_local"] == [16, 32] and res["fc_local"] == [64, 32]  # colwise: half the rows
        assert res["proj_local"] == [32, 16]  # rowwise: half the input features
        assert res["wte_local"] == [64, 32]  # replicated
        assert res["local_heads"] == 2  # of 4
        # 2 layers x (2 forward all-reduces of the rowwise outputs + 4 backward all-reduces of the
        # colwise input grads), all of activations (B_local, T, C): no weight is gathered.
        assert res["all_reduce_shapes"] == [[8, 16, 32]] * 12


def test_grad_accumulation_sharded_without_donation(eager2):
    for res in scenario_results(eager2, "accum_fsdp"):
        _assert_matches_single_process(res, steps=5)


def test_uneven_shards_roundtrip_and_step(eager2):
    r0, r1 = scenario_results(eager2, "uneven")
    assert r0["local_rows"] == [4, 4] and r1["local_rows"] == [3, 3]  # 7 rows: 4 + 3
    for res in (r0, r1):
        assert res["roundtrip"] == 0.0
        assert res["trace_is_dtensor"] == "DTensor"
        loss_tol, params_tol = _tols(5)
        assert res["loss"] <= loss_tol and res["params"] <= params_tol


def test_eval_step_and_dropout_keys_per_dp_rank(eager2):
    fsdp = scenario_results(eager2, "eval_keys_fsdp")
    tp = scenario_results(eager2, "eval_keys_tp")
    for res in fsdp + tp:
        assert res["eval_loss"] <= 4.0 * GRAD_TOL  # one loss (~4) over the batch
    keys_fsdp, keys_tp = fsdp[0]["keys"], tp[0]["keys"]
    assert keys_fsdp[0] != keys_fsdp[1]  # two dp ranks: different dropout masks
    assert keys_tp[0] == keys_tp[1]  # two tp ranks of one dp rank: the same masks


@pytest.mark.parametrize("name", ["fsdp_tp", "hsdp"])
def test_two_dim_meshes_on_four_ranks(eager4, name):
    for res in scenario_results(eager4, name):
        _assert_matches_single_process(res)
    # setup's timeout_s reaches both 2-rank groups of the mesh (subgroups do not inherit the world's)
    for ranks in eager4:
        timeouts = ranks[name]["group_timeouts"]
        assert len(timeouts) == 2 and set(timeouts.values()) == {float(COLLECTIVE_TIMEOUT_S)}, timeouts
        # every gloo group setup made runs one collective at a time (functrain.parallel.gloo: two
        # collectives of one group in flight at once on torch's two threads corrupt the heap)
        assert set(ranks[name]["group_threads"].values()) == {1}, ranks[name]["group_threads"]


@pytest.mark.parametrize("unit, mesh", two_dim_cells())
def test_compiled_units_on_two_dim_meshes_equal_one_process(eager4, unit, mesh):
    _assert_two_dim_unit(eager4, unit, mesh)


@pytest.mark.exhaustive
@pytest.mark.parametrize("unit, mesh", two_dim_cells(full=True))
def test_every_compiled_unit_on_every_two_dim_mesh_equals_one_process(eager4_exhaustive, unit, mesh):
    _assert_two_dim_unit(eager4_exhaustive, unit, mesh)


def _assert_two_dim_unit(suite, unit, mesh):
    for res in scenario_results(suite, f"compiled_{unit}_{mesh}"):
        assert res["unique_graphs"] == (1 if unit == "step" else 6 + 2), res
        loss_tol, params_tol = _tols(3)
        assert res["vs_single_loss"] <= loss_tol and res["vs_single_params"] <= params_tol, res
        assert res["vs_single_opt_state"] <= params_tol, res


def test_one_process_plain_path_and_one_device_mesh(tmp_path_factory):
    (res,) = scenario_results(_suite(tmp_path_factory, "single", 1), "single")
    assert res["plain_mesh"] and not res["plain_pg"] and res["plain_identity"]
    assert res["mesh_shape"] == {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1} and res["pg_world"] == 1
    # setup's groups and the checkpoint writer's run one collective at a time (functrain.parallel.gloo)
    assert set(res["group_threads"].values()) == {1} and res["ckpt_group_threads"] == 1, res["group_threads"]
    assert not res["pg_after_teardown"]
    # two meshes equal by value (same shape and names, different groups): each params tree gets its
    # own mesh's layout (a cache keyed by mesh equality gave the second one the first one's groups)
    assert res["meshes_equal_not_same"] and res["layout_per_mesh_object"] == [True, True]
    assert res["scan_sharded"].startswith("accum_impl='scan' runs on one process only"), res["scan_sharded"]
    _assert_matches_single_process(res, steps=5)


# compile="blocks" graphs: prepare, embedding and block without grad (the sharded forward) and with
# grad (recomputed in backward), head; kept blocks: no no-grad block graph; + the optimizer update
# group by group (functrain.step.update.grouped_update): one graph for every block, one for the rest.
@pytest.mark.parametrize(
    "name, graphs",
    [
        ("compiled_fsdp", 1),
        ("compiled_tp", 1),
        ("compiled_stages_fsdp", 1),
        ("compiled_kept_fsdp", 1),
        ("blocks_fsdp", 6 + 2),
        ("blocks_kept_fsdp", 5 + 2),
        ("blocks_tp", 6 + 2),
    ],
)
def test_compiled_sharded_step_one_graph_no_recompiles(compiled2, name, graphs):
    _assert_compiled(compiled2, name, graphs)


@pytest.mark.exhaustive
@pytest.mark.parametrize("name, graphs", [("compiled_fsdp", 1), ("compiled_stages_fsdp", 1)])
def test_compiled_sharded_step_under_inductor_one_graph_no_recompiles(compiled2_exhaustive, name, graphs):
    _assert_compiled(compiled2_exhaustive, name, graphs)


def _assert_compiled(suite, name, graphs):
    for res in scenario_results(suite, name):
        assert res["unique_graphs"] == graphs
        assert res["metric_types"] == ["Tensor"]
        loss_tol, params_tol = _tols(6)
        assert res["vs_eager_loss"] <= loss_tol and res["vs_eager_params"] <= params_tol
        assert res["vs_single_loss"] <= loss_tol and res["vs_single_params"] <= params_tol
        assert res["vs_single_opt_state"] <= params_tol
        if name == "compiled_kept_fsdp":  # both post-grad passes rewrote the step: 2 kept blocks
            assert res["regathered"] == 2 and res["recomputed"] >= 2 * 4, res
        else:  # nothing to rewrite: every block recomputed, or no staged loss, or not inductor
            assert res["regathered"] == 0 and res["recomputed"] == 0, res


def test_route_matrix_holds_every_pair_of_the_full_product():
    """The 5 sharded cells plus compiled2's fp32 cells without accumulation: every value pair."""
    compiled2 = [(u, "fp32", 1, m) for u in ("step", "blocks") for m in ("fsdp", "tp")]

    def pairs(cells):
        return {(i, j, c[i], c[j]) for c in cells for i in range(4) for j in range(i + 1, 4)}

    full = [c[1:] for c in matrix_cells(full=True)] + compiled2
    assert len(full) == 24 and len(matrix_cells(full=False)) == 5
    assert pairs([c[1:] for c in matrix_cells(full=False)] + compiled2) == pairs(full)


@pytest.mark.parametrize("name, unit, precision, accum, mesh", matrix_cells(), ids=[c[0] for c in matrix_cells()])
def test_every_compiled_sharded_route_equals_one_process(matrix2, name, unit, precision, accum, mesh):
    """compile unit x precision x accumulation on FSDP and TP (fp32 without accumulation: above)."""
    _assert_route(matrix2, name, unit, precision)


@pytest.mark.exhaustive
@pytest.mark.parametrize(
    "name, unit, precision, accum, mesh", matrix_cells(full=True), ids=[c[0] for c in matrix_cells(full=True)]
)
def test_the_full_product_of_sharded_routes_equals_one_process(matrix2_exhaustive, name, unit, precision, accum, mesh):
    _assert_route(matrix2_exhaustive, name, unit, precision)


def _assert_route(matrix2, name, unit, precision):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    for res in scenario_results(matrix2, name):
        assert res["unique_graphs"] == (1 if unit == "step" else 6 + 2), res
        assert res["param_dtypes"] == ["torch.float32"] and res["skipped"] == 0, res
        loss_tol, params_tol = _tols(3, dtype)
        assert res["vs_single_loss"] <= loss_tol and res["vs_single_params"] <= params_tol, res
        assert res["vs_single_opt_state"] <= params_tol, res


@pytest.mark.parametrize("name, remat", [("stages_fsdp", "full"), ("stages_kept_fsdp", "none"), ("stages_tp", "full")])
def test_per_block_gathers_match_single_process(eager2, name, remat):
    """A staged loss on sharded params: each stage gathers its own params (embedding, every block,
    the head), with remat every block is gathered again for its backward; 20 steps equal one process."""
    for res in scenario_results(eager2, name):
        _assert_matches_single_process(res)
        stages = res["stage_numels"]
        if name == "stages_tp":  # no dp axis: nothing to all-gather, the tp shards are computed on
            assert res["gathers"] == [], res["gathers"]
            continue
        n_blocks = len(stages) - 2
        # one flat gather per stage in the forward, + one per recomputed block in the backward, + the
        # embedding's again (sharded, it is always recomputed: see remat._staged_value_and_grad)
        assert len(res["gathers"]) == len(stages) + 1 + (n_blocks if remat == "full" else 0), res["gathers"]
        assert max(res["gathers"]) <= max(stages) < res["model_numel"], (res["gathers"], stages)
        if remat == "full":  # the backward's gathers: the blocks', last block first, then the embedding's
            assert res["gathers"][len(stages) :] == stages[1:-1][::-1] + stages[:1]


def test_per_block_gathers_bf16(eager2):
    for res in scenario_results(eager2, "stages_bf16_fsdp"):
        assert res["param_dtypes"] == ["torch.float32"]
        loss_tol, params_tol = _tols(10, torch.bfloat16)
        assert res["loss"] <= loss_tol and res["params"] <= params_tol, res
        assert max(res["gathers"]) <= max(res["stage_numels"])


@pytest.mark.parametrize("name", ["stages_fsdp_tp", "stages_hsdp"])
def test_per_block_gathers_on_two_dim_meshes(eager4, name):
    for res in scenario_results(eager4, name):
        _assert_matches_single_process(res)
        assert res["gathers"] and max(res["gathers"]) < res["model_numel"], res["gathers"]


@pytest.mark.parametrize(
    "suite, name, fraction",
    [
        ("eager2", "init_fsdp", 0.5),
        ("eager2", "init_tp", 1.0),  # pure tp: the embeddings and LayerNorms are replicated by design
        ("eager4", "init_fsdp_tp", 0.5),  # embeddings: FSDP only (replicated on tp)
        ("eager4", "init_hsdp", 0.5),  # dp_replicate holds copies of the dp_shard halves
    ],
)
def test_sharded_init_equals_single_process_init_bit_for_bit(request, suite, name, fraction):
    """Each rank draws only its own block of every parameter (never a whole matrix), and the
    gathered blocks are exactly the single-process init."""
    for res in scenario_results(request.getfixturevalue(suite), name):
        assert all(res["equal"].values()), res["equal"]
        assert res["largest_fraction"] <= fraction, res
        assert res["drawn_numel"] < res["model_numel"], res


def test_at_most_one_stage_is_gathered_at_a_time(eager2):
    """A memory trace of one eager step with every block recomputed (4 blocks): the bytes of gathered
    parameters still alive at each gather never exceed the largest stage's (one block here), while
    keeping the blocks (remat "none") holds every block gathered at once: the trace tells them apart."""
    for res, kept in zip(scenario_results(eager2, "live_fsdp"), scenario_results(eager2, "live_kept_fsdp")):
        largest = max(res["embed"], res["block"], res["head"])
        assert len(res["trace"]) == 1 + 4 + 1 + 4 + 1, res["trace"]  # embed, blocks, head; blocks, embed again
        assert max(res["trace"]) == largest < res["model"] / 4, res
        assert res["trace"][-1] == res["embed"]  # the last block's parameters went before the embedding's
        assert max(kept["trace"]) >= 4 * res["block"], kept  # every block gathered at once


@pytest.mark.parametrize(
    "suite, name", [("eager2", "sample_fsdp"), ("eager2", "sample_tp"), ("eager4", "sample_fsdp_tp")]
)
def test_end_of_run_sample_and_export_never_gather_the_whole_model(eager2, eager4, suite, name):
    """Task.finish runs on sharded params: generate gathers one stage at a time and gets the full
    params' tokens, recomputing and through the KV cache alike (gpt, and the hf family's Qwen2), tensor-parallel
    params on each rank's own heads; the HF export streams one tensor at a time, byte-identical to the full export."""
    ranks = scenario_results({"eager2": eager2, "eager4": eager4}[suite], name)
    for res in ranks:
        assert res["equal"], res["tokens"]
        assert res["tokens"] == ranks[0]["tokens"] == res["cached_tokens"]  # every rank drew the same tokens
        assert res["gathers"] and max(res["gathers"]) <= res["stage_max"] < res["model_numel"], res
        assert res["cached_gathers"] and max(res["cached_gathers"]) <= res["stage_max"], res
        if "tp" in name:  # tensor-parallel params decode on each rank's 2 of the 4 heads, no whole tensor gathered
            assert res["tp_tokens"] == res["tokens"] and res["tp_heads"] == 2 and res["tp_gathers"] == [], res
            assert res["hf_tp_tokens"] == res["hf_tokens"] and res["hf_tp_heads"] == 1, res
            assert res["hf_tp_gathers"] == [], res
            # without stages (gemma2): its whole forward over the tensor-parallel copy, nothing gathered whole
            assert res["hf_unstaged_tp_equal"] and res["hf_unstaged_tp_gathers"] == [], res
        # the hf family (transformers' layers over the slot cache), a stage at a time: the plain params' tokens
        assert res["hf_equal"] and res["hf_tokens"] == ranks[0]["hf_tokens"], res["hf_tokens"]
        assert res["hf_gathers"] and max(res["hf_gathers"]) <= res["hf_stage_max"], res
        assert "stages=" in res["refused"]  # no silent whole-model path for sharded params
        assert res["export_gathers"] and max(res["export_gathers"]) <= res["largest_tensor"] < res["model_numel"]
    assert ranks[0]["same_bytes"] is True


@pytest.mark.parametrize(
    "suite, name, dp",
    [
        ("eager2", "reduce_fsdp", 2),
        ("eager4", "reduce_fsdp4", 4),
        ("eager4", "reduce_hsdp", 4),
        ("eager4", "reduce_fsdp_tp", 2),
    ],
)
def test_every_reduce_scatter_route_equals_the_backends_reduce_scatter(request, suite, name, dp):
    # parallel.configure(mesh, reduce_scatter=...): "all_to_all" sends rows to their owners and sums there (opt-in);
    # "all_reduce" is what gloo's reduce-scatter runs inside (an all-reduce of a copy of the bucket,
    # then its row copied out), so on gloo it gives the same bits; "auto" picks it on gloo groups
    for res in scenario_results(request.getfixturevalue(suite), name):
        assert res["dp_world"] == dp
        assert res["gloo"] and all(res["gloo"]), res  # every dp group of these meshes is gloo
        # a mean of dp unit normals: each sum is rounded dp - 1 times, in some order per route
        tol = (dp - 1) * torch.finfo(torch.float32).eps * 4 * math.sqrt(dp)
        for route, diff in res["to_mean"].items():
            assert diff <= tol, (route, res)
        assert res["vs_rs"]["all_reduce"] == 0.0, res
        assert res["vs_rs"]["auto"] == 0.0, res
        if dp == 2 or name == "reduce_hsdp":  # a + b: the same bits whichever rank adds
            assert res["vs_rs"]["all_to_all"] == 0.0, res
        else:
            assert res["vs_rs"]["all_to_all"] <= tol, res
