"""Context-parallel attention (functrain.parallel.context): the zig-zag split, and attention over
the whole sequence from each rank's part equal to full causal attention (outputs and the gradients
of q, k and v), on 1, 2 and 4 gloo ranks, multi-head and grouped-query, eager and compiled."""

from __future__ import annotations

import os

import pytest
import torch
from _dist_launch import REPO, read_results, run_ranks

from functrain.parallel import context

pytestmark = pytest.mark.slow  # gloo ranks in subprocesses

WORKER = os.path.join(REPO, "tests", "_context_worker.py")


def test_zigzag_split_pairs_an_early_and_a_late_chunk_and_covers_the_sequence():
    assert context.positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context.positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    for world in (1, 2, 4):
        t = 16 * world
        parts = [context.positions(t, world, r) for r in range(world)]
        assert sorted(torch.cat(parts).tolist()) == list(range(t))
        # Causal work of a query at position p is p + 1 keys: every rank gets the same total.
        work = {int((p + 1).sum()) for p in parts}
        assert len(work) == 1, work
    with pytest.raises(ValueError, match="must divide by 2 x the context-parallel ranks"):
        context.positions(10, 2, 0)


def test_shard_then_gather_is_the_identity_on_one_rank_and_attention_is_full_causal():
    import _context_worker as worker

    assert torch.equal(
        context.gather_sequence(torch.arange(6.0).view(1, 1, 6, 1), None, 1), torch.arange(6.0).view(1, 1, 6, 1)
    )
    worker.scenario(4, 2, False, None, 1, 0)  # raises on a mismatch
    worker.scenario(4, 2, False, None, 1, 0, kernel="zigzag")


@pytest.mark.parametrize("nprocs", [2, 4])
def test_context_parallel_attention_equals_full_attention(tmp_path, nprocs):
    run_ranks(WORKER, [str(tmp_path)], nprocs=nprocs, timeout=300)
    for rank in range(nprocs):
        res = read_results(os.path.join(tmp_path, f"rank{rank}.json"))
        bad = {k: v for k, v in res.items() if v != "ok"}
        assert not bad and set(res) == {
            "mha",
            "gqa",
            "gqa_func",
            "gqa_compiled",
            "zigzag_mha",
            "zigzag_gqa_func",
            "zigzag_gqa_compiled",
            "stream_mha",
            "stream_gqa_func",
            "stream_gqa_compiled",
            "rows",
            "rows_uneven_compiled",
        }, f"rank {rank}:\n" + "\n".join(f"{k}: {v}" for k, v in bad.items())
