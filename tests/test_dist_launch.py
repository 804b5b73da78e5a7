"""The multi-process launcher the distributed tests use: failures and hangs come back with each rank's stack."""

from __future__ import annotations

import time

import pytest
from _dist_launch import run_ranks

pytestmark = pytest.mark.slow  # torchrun launches

_WORKER = """
import os, sys, time
rank = int(os.environ["RANK"])
flag = os.path.join(os.path.dirname(__file__), "printed")
if rank == 1:  # more than a pipe holds, while rank 0 waits on it (as in a collective)
    print("x" * 200_000, flush=True)
    open(flag, "w").close()
else:
    t = time.monotonic()
    while not os.path.exists(flag):
        if time.monotonic() - t > 20:
            raise SystemExit("rank 1 never finished printing")
        time.sleep(0.05)
if sys.argv[1] == "hang" and rank == 1:
    def wait_forever():
        time.sleep(3600)
    wait_forever()
if sys.argv[1] == "fail" and rank == 0:
    raise SystemExit("rank 0 gives up")
if sys.argv[1] == "crash":  # rank 1 dies as a heap corruption would; rank 0 waits for it forever
    if rank == 1:
        os.abort()
    def wait_forever():
        time.sleep(3600)
    wait_forever()
print("done", rank)
"""


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(_WORKER)
    return str(path)


def test_ranks_that_print_a_lot_finish(worker):
    run_ranks(worker, ["ok"], nprocs=2, timeout=60)


def test_a_failing_rank_is_named(worker):
    with pytest.raises(RuntimeError, match=r"failed on ranks \[0\]") as e:
        run_ranks(worker, ["fail"], nprocs=2, timeout=60)
    assert "rank 0 gives up" in str(e.value)


def test_a_hanging_rank_is_stopped_with_its_stack(worker):
    with pytest.raises(RuntimeError, match=r"timed out after 5 s .* on ranks \[1\]") as e:
        run_ranks(worker, ["hang"], nprocs=2, timeout=5)
    assert "wait_forever" in str(e.value)  # faulthandler's dump of the waiting thread


def test_the_others_are_stopped_soon_after_a_rank_crashes(worker):
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"failed \(ranks still running 2 s after the first failure") as e:
        run_ranks(worker, ["crash"], nprocs=2, timeout=300, grace=2)
    assert time.monotonic() - t < 60  # not the 300 s timeout
    msg = str(e.value)
    assert "--- rank 1 (exit -6)" in msg and "Fatal Python error: Aborted" in msg  # the crash
    assert "wait_forever" in msg  # where the rank left waiting was
