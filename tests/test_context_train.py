"""Context-parallel training (`--config.mesh.cp`) on 2 and 4 gloo processes vs one process.

One launch per suite (tests/_context_train_worker.py): GPT and Llama (grouped-query attention),
remat on and off, fp32 and bf16, cp alone and with dp_shard, dp_replicate and tp, and the compiled
step (one graph, no recompile); checkpoints written under cp restore onto one process and an FSDP
mesh and back. ~30 s per suite on 2 CPU cores.
"""

from __future__ import annotations

import os

import _tol
import pytest
import torch
from _dist_launch import REPO, run_suite, scenario_results

pytestmark = pytest.mark.slow  # gloo ranks in subprocesses


WORKER = os.path.join(REPO, "tests", "_context_train_worker.py")
# The worker's problem: global batch 8 x 16 tokens through matmuls up to 2 x 32 wide (the MLPs);
# losses ~4; gradients clipped to norm 1; SGD lr 0.05, momentum 0.9 (tests/_tol.py).
N = 8 * 16 * 2 * 32


def _tols(steps, dtype=torch.float32):
    """(loss, relative grad norm, params) tolerances after `steps` cp vs single-process steps."""
    return _tol.split_run(steps, N, dtype)


def _suite(tmp_path_factory, suite, nprocs):
    return run_suite(WORKER, str(tmp_path_factory.mktemp(suite)), suite, nprocs)


@pytest.fixture(scope="module")
def cp2(tmp_path_factory):
    return _suite(tmp_path_factory, "cp2", 2)


@pytest.fixture(scope="module")
def cp4(tmp_path_factory):
    return _suite(tmp_path_factory, "cp4", 4)


def _assert_matches(res, steps, dtype=torch.float32):
    loss_tol, grad_tol, params_tol = _tols(steps, dtype)
    assert res["step"] == steps and res["skipped"] == 0, res
    assert res["loss"] <= loss_tol, res
    assert res["grad_norm"] <= grad_tol, res
    assert res["params"] <= params_tol, res
    assert res["opt_state"] <= params_tol, res


@pytest.mark.parametrize(
    "name, steps, dtype",
    [
        ("gpt", 20, torch.float32),  # plain loss (the whole model gathered)
        ("gpt_remat", 20, torch.float32),  # staged, every block recomputed
        ("gpt_ignored", 20, torch.float32),  # the ranks count different numbers of targets
        ("gpt_bf16", 10, torch.bfloat16),
        ("llama", 20, torch.float32),  # GQA: the kv heads gathered, rotary at global positions
        ("llama_remat_bf16", 10, torch.bfloat16),
        ("gpt_mask", 20, torch.float32),  # the other kernels: one masked attention,
        ("llama_stream", 20, torch.float32),  # keys and values fetched a chunk at a time
    ],
)
def test_two_cp_ranks_match_one_process(cp2, name, steps, dtype):
    for res in scenario_results(cp2, name):
        _assert_matches(res, steps, dtype)
        # FSDP over cp: no rank holds the whole model
        assert 2 * res["local_numel"] == res["global_numel"], res
        if "position_rows" in res:  # the staged GPT's embedding reads its cp half of the position table
            assert 2 * res["position_rows"]["local"] == res["position_rows"]["global"], res


@pytest.mark.numeric
@pytest.mark.parametrize(
    "name, shards",
    [
        ("gpt_cp4", 4),
        ("llama_cp4", 4),
        ("gpt_cp4_stream", 4),
        ("gpt_fsdp_cp", 4),  # dp_shard=2 x cp=2
        ("gpt_hsdp_cp", 2),  # dp_replicate=2 x cp=2 (remat)
        ("gpt_cp_tp", None),
        ("llama_cp_tp", None),  # cp=2 x tp=2
    ],
)
def test_four_ranks_match_one_process(cp4, name, shards):
    for res in scenario_results(cp4, name):
        _assert_matches(res, 20)
        if shards:  # (with dp_shard x cp, a 1-D tensor is sharded on dp_shard only: its dim 0 is taken)
            assert res["local_numel"] * shards <= 1.05 * res["global_numel"], res
        else:  # tp shards the blocks' Linears, cp the rest (and the other dim of the Linears)
            assert res["local_numel"] < res["global_numel"] / 2, res
        if "position_rows" in res:  # the staged GPT's embedding reads its cp part of the position table
            cp = 4 if "cp4" in name else 2
            assert cp * res["position_rows"]["local"] == res["position_rows"]["global"], res


def test_compile_unit_blocks_under_cp_matches_one_process(cp2):
    # a graph per stage kind, the streamed attention's Function (a broadcast per key chunk) inside
    for res in scenario_results(cp2, "gpt_blocks_stream"):
        _assert_matches(res, 4)


def test_compiled_cp_step_is_one_graph_without_recompiles(cp2):
    for res in scenario_results(cp2, "gpt_compiled"):
        assert res["unique_graphs"] == 1, res  # 4 steps under error_on_recompile
        _assert_matches(res, 4)


def test_checkpoints_move_between_cp_and_other_meshes(cp2):
    for res in scenario_results(cp2, "checkpoint"):
        assert res["cp_to_plain"] == 0.0 and res["cp_to_fsdp"] == 0.0 and res["fsdp_to_cp"] == 0.0, res
        assert res["fsdp_placement"] == ["Shard(dim=0)"] and res["cp_placement"] == ["Shard(dim=0)"], res
        assert res["resumed_step"] == 20 and res["resumed_vs_single_params"] <= _tols(20)[2], res


def test_a_sequence_the_split_cannot_cut_is_one_line(cp2):
    for res in scenario_results(cp2, "bad_length"):
        line = res["error_line"]
        assert line and "\n" not in line and "sequence length 6" in line and "(4)" in line, line
