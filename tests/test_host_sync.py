"""No host sync in a steady-state step: between log steps the loop reads no tensor value into
Python (on an accelerator each read waits for the device), on 1 and 2 processes, eager and compiled.

A step's reads are counted from its hooks' `before` to their `after` (tests/_host_reads.py patches
`Tensor.item`, `float(t)`, `bool(t)`, `.tolist()`, `.numpy()`, `.cpu()`, ...). The run logs at steps
4, 8, 12 and checkpoints at 6 and 12; the first step compiles (Dynamo reads example values). Every
other step must read nothing; the log steps must read something (the counter sees the metrics read).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from _dist_launch import REPO, read_results, run_ranks

pytestmark = pytest.mark.slow  # gloo ranks in subprocesses

WORKER = os.path.join(REPO, "tests", "_host_sync_worker.py")
LOG_STEPS = {4, 8, 12}
CHECKPOINT_STEPS = {6, 12}


def _check_counts(counts: dict, where: dict, who: str):
    reads, where = {int(k): v for k, v in counts.items()}, {int(k): v for k, v in where.items()}
    steady = {s: n for s, n in reads.items() if s != 1 and s not in LOG_STEPS | CHECKPOINT_STEPS}
    assert not steady, f"{who}: steady-state steps read tensor values: {steady}; first at {where[min(steady)]}"
    assert all(reads.get(s, 0) > 0 for s in LOG_STEPS), f"{who}: the log steps read nothing? {reads}"


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_one_process_reads_nothing_between_log_steps(tmp_path, compile):
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import _host_sync_worker as worker

    counts, where = worker.count_reads(tmp_path, compile)
    _check_counts(counts, where, "1 process")


def test_two_ranks_read_nothing_between_log_steps_and_agree_on_preemption(tmp_path):
    """2 gloo ranks (FSDP over both): no reads between log steps on either rank; a SIGTERM raised on
    rank 1 before check 3 is seen by both ranks at check 4, one step late, and never before."""
    run_ranks(WORKER, [str(tmp_path), "0"], nprocs=2, timeout=300)
    for rank in range(2):
        res = read_results(os.path.join(tmp_path, f"rank{rank}.json"))
        _check_counts(res["counts"], res["where"], f"rank {rank}")
        assert res["flag"] == [False] * 4 + [True] * 2, (rank, res["flag"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch.cuda.set_sync_debug_mode")
def test_on_a_gpu_steady_state_steps_never_wait_for_the_device(tmp_path):
    """The compiled tiny job on CUDA: steady-state steps run under set_sync_debug_mode("error"), so a
    step that waited for the GPU would raise; and they read no tensor value."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import _host_sync_worker as worker

    counts, where = worker.count_reads(tmp_path, True, cuda_quiet=True)
    _check_counts(counts, where, "1 GPU")
