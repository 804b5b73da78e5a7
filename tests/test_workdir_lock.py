"""One run per workdir: a second run on a workdir in use stops with one line, on every rank, and
the lock goes with its holder however that ends (kill -9 included)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from functrain.trainer import workdir_lock
from functrain.trainer.validate import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_HOLDER = """
import sys, time
from functrain.trainer import workdir_lock
with workdir_lock.hold(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def _start_holder(workdir):
    """A process holding `workdir`'s lock (it has printed "held")."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(workdir)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_holder_is_refused_until_the_first_ends_even_by_kill_9(tmp_path):
    holder = _start_holder(tmp_path / "run")
    try:
        with pytest.raises(ConfigError) as err:
            with workdir_lock.hold(tmp_path / "run"):
                pass
        msg = str(err.value)
        assert msg == (
            f"workdir {tmp_path / 'run'} is in use by another run (host {os.uname().nodename}, pid "
            f"{holder.pid}); wait for it to end or pass another --workdir"
        ), msg
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    with workdir_lock.hold(tmp_path / "run"):  # the kernel dropped the dead holder's lock
        with pytest.raises(ConfigError, match=f"pid {os.getpid()}\\)"):
            with workdir_lock.hold(tmp_path / "run"):  # another descriptor, even in this process
                pass
    with workdir_lock.hold(tmp_path / "run"):  # released at the end of the block
        pass
    with workdir_lock.hold(tmp_path / "other", is_main_process=False):  # not the main process: no lock
        assert not (tmp_path / "other").exists()


@pytest.mark.slow
def test_a_run_on_a_workdir_in_use_stops_on_every_rank_with_one_line(tmp_path):
    """Under torchrun the main process finds the lock taken; both ranks exit with the error line
    (none waits in a collective for the one that stopped)."""
    holder = _start_holder(tmp_path / "run")
    try:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "functrain.main",
            "--config=configs/gpt.py:tiny",
            "--config.compile=False",
            "--config.dist_timeout_s=120",
            "--config.eval.tasks=",
            f"--workdir={tmp_path / 'run'}",
        ]
        out = subprocess.run(
            cmd,
            cwd=REPO,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    assert out.returncode != 0
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("functrain: error:")]
    assert (
        errors
        == [
            f"functrain: error: workdir {tmp_path / 'run'} is in use by another run (host "
            f"{os.uname().nodename}, pid {holder.pid}); wait for it to end or pass another --workdir"
        ]
        * 2
    ), out.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "config.json").exists()


_SAYER = """
from functrain.trainer.main import _say
for _ in range(500):
    _say("functrain: error: " + "x" * 200)
"""


def test_error_lines_from_ranks_sharing_one_pipe_stay_whole():
    """Every rank prints the error line into the stderr pipe torchrun shares between them; each line
    must arrive whole (print's message-then-newline writes were split by another rank's line)."""
    script = "".join([f"{sys.executable} -c '{_SAYER}' &\n"] * 6) + "wait"
    out = subprocess.run(
        ["bash", "-c", script],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = out.stderr.splitlines()
    assert len(lines) == 3000 and set(lines) == {"functrain: error: " + "x" * 200}, out.stderr[:2000]
