"""Pipeline parallelism: schedules and partitions (pure), and the pipelined step on 2 and 4 gloo ranks.

The distributed suites (tests/_pipeline_worker.py, one launch each, ~15 s on 2 CPU cores) train the
tiny GPT (tied embedding and head, so the tied weight lives on the first and the last rank) and the
tiny Llama cut over the pipeline ranks, against one process with `accum_steps` = the microbatches on
the same batches.
"""

from __future__ import annotations

import itertools
import os
import random

import _tol
import pytest
import torch
from _dist_launch import REPO, run_suite, scenario_results
from _pipeline_worker import MESH_STEPS

from functrain.parallel import pipeline_schedule as S
from functrain.trainer import validate

WORKER = os.path.join(REPO, "tests", "_pipeline_worker.py")
# The worker's problem: batch 8 x 16 tokens through matmuls up to 2 x 32 wide (the MLPs); losses ~4;
# gradients clipped to norm 1; SGD lr 0.05, momentum 0.9 (tests/_tol.py).
N = 8 * 16 * 2 * 32


# --- schedules and partitions ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "eager-1f1b"])
@pytest.mark.parametrize("n, m", [(1, 1), (2, 1), (2, 4), (4, 4), (4, 16), (3, 7)])
def test_schedules_run_every_microbatch_once_and_reach_the_theoretical_bubble(name, n, m):
    for r in range(n):
        acts = S.schedule(name, n, m, r)
        assert sorted(acts) == sorted([S.Action("F", i) for i in range(m)] + [S.Action("B", i) for i in range(m)])
        for i in range(m):  # a microbatch's backward after its forward
            assert acts.index(S.Action("F", i)) < acts.index(S.Action("B", i))
    # every rank idle for the formula's share when the stages cost the same (backward = 2 x forward)
    assert S.simulate(name, n, m, [1.0] * n, [2.0] * n) == pytest.approx([S.bubble_fraction(n, m)] * n, abs=1e-12)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "eager-1f1b"])
def test_a_heavier_stage_idles_less_and_the_others_more(name):
    bubbles = S.simulate(name, 3, 6, [1.0, 1.5, 1.0], [2.0, 3.0, 2.0])
    assert bubbles[1] < S.bubble_fraction(3, 6) < min(bubbles[0], bubbles[2])


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_per_microbatch_costs_replay_the_schedule(name):
    # the same costs for every microbatch, given one per microbatch: the same bubble
    per_micro = S.simulate(name, 3, 5, [[1.0] * 5, [1.5] * 5, [1.0] * 5], [[2.0] * 5, [3.0] * 5, [2.0] * 5])
    assert per_micro == pytest.approx(S.simulate(name, 3, 5, [1.0, 1.5, 1.0], [2.0, 3.0, 2.0]), abs=1e-12)
    # 2 ranks, 2 microbatches, rank 1's second forward twice as slow; worked by hand from the schedules:
    # gpipe: r0 F0 [0,1] F1 [1,2]; r1 F0 [1,2] F1 [2,4] B0 [4,6] B1 [6,8]; r0 B0 [6,8] B1 [8,10]
    # 1f1b:  r0 F0 [0,1] F1 [1,2]; r1 F0 [1,2] B0 [2,4] F1 [4,6] B1 [6,8]; r0 B0 [4,6] B1 [8,10]
    # either way a span of 10: rank 0 computes 6 of it, rank 1 7
    assert S.simulate(name, 2, 2, [[1.0, 1.0], [1.0, 2.0]], [2.0, 2.0]) == pytest.approx([0.4, 0.3], abs=1e-12)
    # a slow microbatch then a fast one (the same mean) on the critical path: more idle than the mean cost gives
    noisy = [1.0, 1.6, 0.4, 1.0]
    slow = S.simulate(name, 2, 4, [noisy, noisy], [2.0, 2.0])
    assert sum(slow) > sum(S.simulate(name, 2, 4, [1.0, 1.0], [2.0, 2.0]))
    with pytest.raises(ValueError, match="forward costs: got 3 for 4 microbatches; give one number or one per"):
        S.simulate(name, 2, 4, [1.0, [1.0, 1.0, 1.0]], [2.0, 2.0])


@pytest.mark.parametrize("n, m", [(2, 8), (4, 16), (3, 7)])
def test_eager_1f1b_keeps_the_bubble_near_the_formula_when_actions_vary(n, m):
    # every forward and backward drawn within +-25% of its mean (seeded): one slow action stalls the
    # next rank under gpipe and 1f1b, while eager 1f1b's next input is already there
    trials, idle = 40, {name: 0.0 for name in S.SCHEDULES}
    for t in range(trials):
        draw = random.Random(t)
        forward = [[draw.uniform(0.75, 1.25) for _ in range(m)] for _ in range(n)]
        backward = [[2 * draw.uniform(0.75, 1.25) for _ in range(m)] for _ in range(n)]
        for name in S.SCHEDULES:
            idle[name] += sum(S.simulate(name, n, m, forward, backward)) / n / trials
    theory = S.bubble_fraction(n, m)
    assert idle["eager-1f1b"] < min(idle["1f1b"], idle["gpipe"]), idle
    assert idle["eager-1f1b"] - theory < (idle["1f1b"] - theory) / 2, (idle, theory)  # half the excess at most


@pytest.mark.parametrize("n, m", [(2, 8), (4, 16), (4, 3)])
def test_1f1b_holds_at_most_n_minus_rank_microbatches_gpipe_all_of_them(n, m):
    for r in range(n):
        assert S.held(S.gpipe(n, m, r)) == m
        assert S.held(S.one_f_one_b(n, m, r)) == min(n - r, m)
        assert S.held(S.eager_one_f_one_b(n, m, r)) == (min(n - r + 1, m) if r < n - 1 else 1)
    # the target: at m = 4n, 1F1B's peak is n / m of GPipe's
    assert max(S.held(S.one_f_one_b(n, 4 * n, r)) for r in range(n)) / S.held(S.gpipe(n, 4 * n, 0)) == n / (4 * n)


def test_a_bad_schedule_name_or_size_is_one_line():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'.*gpipe, 1f1b"):
        S.schedule("zb", 2, 2, 0)
    with pytest.raises(ValueError, match="rank=2"):
        S.gpipe(2, 4, 2)


def test_the_config_check_accepts_exactly_the_schedules():
    # validate.py spells the names itself (config errors come before torch is imported)
    ok, words = dict(validate.LOOP_CHECKS)["pp.schedule"]
    assert all(ok(name) for name in S.SCHEDULES) and not ok("zb")
    assert sorted(words.removeprefix("one of ").split(", ")) == sorted(repr(name) for name in S.SCHEDULES)


def _best_cut(weights, n, first, last):
    """The lightest heaviest group over every contiguous cut into n non-empty groups (brute force)."""
    k, best = len(weights), None
    for cuts in itertools.combinations(range(1, k), n - 1):
        bounds = [0, *cuts, k]
        loads = [sum(weights[bounds[g] : bounds[g + 1]]) for g in range(n)]
        loads[0] += first
        loads[-1] += last
        best = max(loads) if best is None else min(best, max(loads))
    return best


@pytest.mark.parametrize(
    "weights, n, first, last",
    [
        ([1, 1, 1, 1], 2, 0, 0),
        ([1, 1, 1, 1], 2, 2, 0),
        ([5, 1, 1, 1, 1, 1], 3, 0, 3),
        ([3, 1, 4, 1, 5, 9, 2, 6], 4, 2, 7),
        ([2] * 12, 4, 6, 6),
        ([7], 1, 1, 1),
    ],
)
def test_partition_is_contiguous_covers_every_block_and_is_optimal(weights, n, first, last):
    parts = S.partition(weights, n, first=first, last=last)
    assert [i for p in parts for i in p] == list(range(len(weights))) and all(len(p) for p in parts)
    loads = [sum(weights[i] for i in p) for p in parts]
    loads[0] += first
    loads[-1] += last
    assert max(loads) == _best_cut(weights, n, first, last)


def test_more_stages_than_blocks_is_one_line():
    with pytest.raises(ValueError, match="pipeline of 3 stages over 2 blocks.*at most 2 pipeline ranks"):
        S.partition([1, 1], 3)


# --- the pipelined step on gloo ranks -------------------------------------------------------------


def _tols(steps, dtype=torch.float32):
    """(loss, relative grad norm, params) tolerances after `steps` pipelined vs single-process steps."""
    return _tol.split_run(steps, N, dtype)


OUTDIRS: dict = {}  # suite -> the directory its ranks wrote (results, checkpoints)


def _suite(tmp_path_factory, suite, nprocs):
    OUTDIRS[suite] = str(tmp_path_factory.mktemp(suite))
    return run_suite(WORKER, OUTDIRS[suite], suite, nprocs)


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    return _suite(tmp_path_factory, "pp2", 2)


@pytest.fixture(scope="module")
def pp4(tmp_path_factory):
    return _suite(tmp_path_factory, "pp4", 4)


def _assert_matches(results, steps, dtype=torch.float32):
    loss_tol, grad_tol, params_tol = _tols(steps, dtype)
    names = set()
    for res in results:
        assert res["step"] == steps and res["skipped"] == res["ref_skipped"], res
        assert res["metric_keys_equal"] and res["lr"] == res["ref_lr"], res
        assert res["loss"] <= loss_tol * max(1.0, res["loss_scale"] / 4), res
        assert res["grad_norm"] <= grad_tol, res
        assert res["params"] <= params_tol and res["opt_state"] <= params_tol, res
        assert res["opt_leaves"][0] == res["opt_leaves"][1] > 0, res
        assert res["held"] == res["expected_held"], res  # the schedule that ran held what it should
        if "receives" in res:  # after the first step every receive is posted ahead of its action
            assert all(r == [0, res["expected_receives"]] for r in res["receives"][1:]), res["receives"]
        names |= set(res["names"])
    stages = sorted({tuple(res["blocks"]) for res in results})  # (ranks of one stage on a mesh: the same blocks)
    blocks = [b for stage in stages for b in stage]
    assert blocks == list(range(len(blocks))), stages  # contiguous, each block on one stage
    return names


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, steps, dtype",
    [
        ("gpt_1f1b", 20, torch.float32),  # 4 microbatches
        ("gpt_gpipe", 20, torch.float32),
        ("gpt_eager_1f1b", 20, torch.float32),  # rank 0 holds 3 microbatches of 4, rank 1 one
        ("gpt_one_micro", 20, torch.float32),
        ("gpt_eight_micro", 5, torch.float32),  # 3 blocks over 2 ranks
        ("gpt_remat", 20, torch.float32),  # every block recomputed in its backward
        ("gpt_bf16", 20, torch.bfloat16),
        ("gpt_bf16_one_micro", 20, torch.bfloat16),
        ("gpt_fp16", 20, torch.float16),  # the loss scale seeds the last stage, grads unscaled after
        ("llama", 20, torch.float32),  # untied head, grouped-query attention
        ("llama_bf16_remat", 20, torch.bfloat16),
    ],
)
def test_two_pipeline_ranks_match_one_process(pp2, name, steps, dtype):
    results = scenario_results(pp2, name)
    _assert_matches(results, steps, dtype)
    first, last = (set(r["names"]) for r in results)
    if name.startswith("gpt"):  # the tied embedding / head on both ends, nothing else on two ranks
        assert first & last == {"wte.weight"}, first & last
    else:
        assert not first & last


@pytest.mark.slow  # (not `numeric`: the 4-rank suite runs once, in the tier of the other tests that read it)
@pytest.mark.parametrize(
    "name, dtype",
    [
        ("gpt_1f1b", torch.float32),
        ("gpt_gpipe", torch.float32),
        ("gpt_eager_1f1b", torch.float32),
        ("llama", torch.float32),
        ("gpt_one_micro", torch.float32),
        ("llama_bf16", torch.bfloat16),
        ("gpt_bf16_remat", torch.bfloat16),
    ],
)
def test_four_pipeline_ranks_match_one_process(pp4, name, dtype):
    results = scenario_results(pp4, name)
    _assert_matches(results, 20, dtype)
    assert all(len(r["blocks"]) >= 1 for r in results)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, mesh",
    [
        ("gpt_pp_fsdp", "pp=2 x dp_shard=2"),
        ("gpt_pp_tp", "pp=2 x tp=2, remat"),
        ("llama_pp_fsdp_bf16", "pp=2 x dp_shard=2, bf16"),
        ("llama_pp_tp", "pp=2 x tp=2"),
    ],
)
def test_pipeline_stages_on_a_mesh_match_one_process(pp4, name, mesh):
    results = scenario_results(pp4, name)
    _assert_matches(results, MESH_STEPS, torch.bfloat16 if "bf16" in name else torch.float32)
    assert sorted(tuple(r["pp"]) for r in results) == [(0, 2), (0, 2), (1, 2), (1, 2)], results
    for res in results:  # each stage holds its part of the model, sharded over its 2-rank mesh
        assert res["stage_numel"] < res["model_numel"] and res["local_numel"] < res["stage_numel"] * 0.65, res


@pytest.mark.slow
def test_pipeline_stages_with_fsdp_and_tp_together_match_one_process(tmp_path_factory):
    # pp=2 x dp_shard=2 x tp=2 on 8 gloo ranks: each block of a stage tp-split and FSDP-sharded
    results = scenario_results(_suite(tmp_path_factory, "pp8", 8), "gpt_pp_fsdp_tp")
    _assert_matches(results, MESH_STEPS)
    assert sorted((r["pp"][0], r["dp"][0], r["tp"][0]) for r in results) == [
        (p, d, t) for p in range(2) for d in range(2) for t in range(2)
    ], results
    for res in results:
        assert res["local_numel"] < res["stage_numel"] / 3, res  # tp x FSDP: about a quarter of the stage


@pytest.mark.slow
def test_pipeline_checkpoints_are_one_tree_that_moves_between_meshes(pp2, pp4):
    for res in scenario_results(pp2, "checkpoint") + scenario_results(pp4, "checkpoint_mesh"):
        # pp -> one whole state (strict: every leaf, none extra) -> pp, bit-equal; then on to 20 steps
        assert res["pp_to_whole_params"] == 0.0 and res["pp_to_whole_opt"] == 0.0 and res["whole_step"] == 10, res
        assert res["whole_to_pp_params"] == 0.0 and res["resumed_step"] == 20, res
        assert res["resumed_vs_single_params"] <= _tols(20)[2] and res["resumed_vs_single_opt"] <= _tols(20)[2], res


@pytest.mark.slow
def test_stock_orbax_reads_a_pipeline_checkpoint(pp2, tmp_path):
    from _ckpt_util import assert_bits_equal, load_dump, orbax_missing, run_orbax

    from functrain import checkpoint as ckpt

    if orbax_missing():
        pytest.skip(orbax_missing())
    item = os.path.join(OUTDIRS["pp2"], "ckpt_pp", "pp")
    run_orbax(["--standard", os.path.join(item, "default"), str(tmp_path / "theirs")])
    theirs = load_dump(str(tmp_path / "theirs"))
    ours = {k: v for k, v in _named_leaves(ckpt.restore(item).result()).items()}
    assert sorted(theirs) == sorted(ours) and any(k.startswith("params.blocks.1.") for k in ours), sorted(ours)
    assert "params.wte.weight" in ours and "params.ln_f.weight" in ours  # both stages' leaves, the tied one once
    for k in ours:
        assert_bits_equal(theirs[k], ours[k], k)


def _named_leaves(tree, prefix=""):
    """{'.'-joined path: tensor} of a nested dict/list tree."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_named_leaves(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, v in enumerate(tree):
            out.update(_named_leaves(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: tree} if isinstance(tree, torch.Tensor) else {}


@pytest.mark.slow
def test_a_nonfinite_loss_skips_the_update_on_every_rank(pp2):
    results = scenario_results(pp2, "gpt_nan_skip")
    _assert_matches(results, 5)
    assert all(r["skipped"] == [0.0, 0.0, 1.0, 0.0, 0.0] for r in results), results


@pytest.mark.slow
def test_compiled_pipeline_stages_make_no_graph_per_microbatch_or_step(pp2):
    # 2 microbatches x 4 steps under error_on_recompile: per rank the block graph with and without grad
    # (every block recomputed), the embedding or the head, and the update: 4 graphs
    results = scenario_results(pp2, "gpt_compiled")
    assert [r["unique_graphs"] for r in results] == [4, 4], results
    _assert_matches(results, 4)


@pytest.mark.slow
def test_pipeline_eval_equals_one_process(pp2):
    for res in scenario_results(pp2, "eval"):
        assert res["eval_loss"] <= _tols(1)[0] and res["keys"] == ["loss"], res
        assert res["receives"][1] == [0, res["expected_receives"]], res  # posted ahead once shapes are known


@pytest.mark.slow
def test_too_many_pipeline_ranks_is_one_line(pp2):
    for res in scenario_results(pp2, "too_many_stages"):
        line = res["error_line"]
        assert line and "\n" not in line and "3 stages over 2 blocks" in line, line
