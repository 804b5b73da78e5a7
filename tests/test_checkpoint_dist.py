"""Multi-process checkpoint tests: 2 gloo ranks (plain subprocesses on 127.0.0.1), resharding both ways.

All 2-rank scenarios run in one launch (see _ckpt_worker.py); each test checks its scenario's result.
"""

from __future__ import annotations

import os

import optree
import pytest
import torch
from _ckpt_util import REPO, assert_bits_equal, full_state, leaves_by_name, load_dump, orbax_missing, run_orbax
from _dist_launch import read_results, run_ranks

from functrain import checkpoint as ckpt

pytestmark = pytest.mark.slow  # gloo ranks in subprocesses

WORKER = os.path.join(REPO, "tests", "_ckpt_worker.py")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Runs every 2-rank scenario once; returns (workdir, {scenario: result per rank})."""
    wd = str(tmp_path_factory.mktemp("ckpt_dist"))
    ckpt.save(os.path.join(wd, "single", "3"), full_state())  # for the 1 -> 2 ranks scenario
    run_ranks(WORKER, [wd], nprocs=2, timeout=180)
    results = [read_results(os.path.join(wd, f"results_rank{r}.json")) for r in range(2)]
    return wd, results


def _check(two_ranks, name):
    _, results = two_ranks
    for rank, res in enumerate(results):
        assert res.get(name) == "ok", f"scenario {name!r} failed on rank {rank}:\n{res.get(name)}"


def test_roundtrip_two_ranks_uneven_async(two_ranks):
    _check(two_ranks, "roundtrip")


def test_retention_two_ranks(two_ranks):
    _check(two_ranks, "retention")


def test_reshard_shard0_to_shard1(two_ranks):
    _check(two_ranks, "reshard_s1")


def test_replicate_written_once_restored_as_shard0(two_ranks):
    _check(two_ranks, "replicate_to_s0")


def test_one_process_checkpoint_onto_two_ranks(two_ranks):
    _check(two_ranks, "from_single")


def test_two_dim_meshes(two_ranks):
    _check(two_ranks, "mesh2d")


def test_mutating_shards_after_save_returns(two_ranks):
    _check(two_ranks, "mutate_after_save")


@pytest.mark.parametrize("name", ["rt", "rep", "m2d"])
def test_two_rank_checkpoint_onto_one_process(two_ranks, name):
    wd, _ = two_ranks
    path = os.path.join(wd, name, "1")
    assert_bits_equal(ckpt.restore(path, ckpt.abstract(full_state())).result(), full_state(), name)
    meta = optree.tree_map(lambda t: torch.empty_like(t, device="meta"), full_state())
    out = ckpt.restore(path, meta).result()  # meta leaves restore as CPU tensors
    assert all(t.device.type == "cpu" for t in optree.tree_leaves(out))
    assert_bits_equal(out, full_state(), name)


@pytest.mark.skipif(orbax_missing() is not None, reason=str(orbax_missing()))
def test_orbax_restores_two_rank_checkpoint(two_ranks):
    """Stock orbax (1 process, then onto 2 jax devices) reads what 2 torch ranks wrote."""
    wd, _ = two_ranks
    out = os.path.join(wd, "orbax_rt")
    run_orbax(["--read", os.path.join(wd, "rt"), "1", out])
    got, want = load_dump(out), leaves_by_name(full_state())
    assert sorted(got) == sorted(want)
    for name in want:
        assert_bits_equal(got[name], want[name], name)
