"""Launches N ranks of a worker script as plain subprocesses with torchrun's env vars (no torchrun)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict) -> dict:
    """This process's env plus the workers' settings (one OpenMP thread, faulthandler on, the repo and
    tests/ importable) and `extra`."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONFAULTHANDLER="1",
        PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH", "")]),
    )
    env.update(extra)
    return env


def run_ranks(
    script: str, args: list[str], nprocs: int, timeout: float = 600.0, env: dict | None = None, grace: float = 60.0
) -> list[str]:
    """Runs `python script *args` as `nprocs` ranks (RANK/WORLD_SIZE/... set, plus `env`); raises if
    any fails, else returns each rank's output (stdout and stderr).

    Each rank writes into its own file, not a pipe: a rank blocked on a full pipe that nobody reads
    (the launcher waiting on another rank) would stall the collective the others wait in. Python's
    faulthandler is on in every rank, so a crash prints the Python stack; past `timeout` every
    rank still running is sent SIGABRT (which prints every thread's stack) and the error shows where
    each one waited. So are the others `grace` seconds after one rank has failed (a crashed peer
    leaves them waiting in a collective until their own timeouts).
    """
    port = _free_port()
    procs, logs = [], []
    with tempfile.TemporaryDirectory(prefix="ranks") as tmp:
        for r in range(nprocs):
            rank_env = _env(
                {
                    "RANK": str(r),
                    "LOCAL_RANK": str(r),
                    "WORLD_SIZE": str(nprocs),
                    "LOCAL_WORLD_SIZE": str(nprocs),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    **(env or {}),
                }
            )
            logs.append(open(os.path.join(tmp, f"rank{r}.log"), "w+"))
            procs.append(
                subprocess.Popen(
                    [sys.executable, script, *args], env=rank_env, cwd=REPO, stdout=logs[-1], stderr=subprocess.STDOUT
                )
            )
        deadline = time.monotonic() + timeout
        timed_out, stopped = False, False
        failed_at = None  # when a rank first exited with an error
        try:
            while None in (codes := [p.poll() for p in procs]):  # (every rank polled each time)
                now = time.monotonic()
                if failed_at is None and any(codes):
                    failed_at = now
                timed_out = now > deadline
                if timed_out or (failed_at is not None and now > failed_at + grace):
                    stopped = True
                    for p in procs:
                        if p.poll() is None:
                            p.send_signal(signal.SIGABRT)  # faulthandler: every thread's Python stack
                    for p in procs:
                        try:
                            p.wait(timeout=30)
                        except subprocess.TimeoutExpired:
                            pass  # killed below
                    break
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        outs = []
        for f in logs:
            f.seek(0)
            outs.append(f.read())
            f.close()
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        tails = "\n".join(f"--- rank {r} (exit {rc}) ---\n{outs[r][-6000:]}" for r, rc in bad)
        why = "failed"
        if timed_out:
            why = f"timed out after {timeout:.0f} s (stacks at SIGABRT below)"
        elif stopped:
            why = f"failed (ranks still running {grace:.0f} s after the first failure stopped: stacks below)"
        raise RuntimeError(f"{script} {why} on ranks {[r for r, _ in bad]}:\n{tails}")
    return outs


def run_single(script: str, args: list[str], timeout: float = 600.0) -> None:
    """Runs `python script *args` as one process WITHOUT torchrun's env vars; raises if it fails."""
    env = {
        k: v
        for k, v in _env({}).items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    p = subprocess.run(
        [sys.executable, script, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    if p.returncode != 0:
        raise RuntimeError(f"{script} failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")


def read_results(path: str) -> dict:
    """The JSON results a worker rank wrote."""
    with open(path) as f:
        return json.load(f)


def run_suite(script: str, outdir: str, suite: str, nprocs: int, timeout: float = 900.0) -> list:
    """Runs a worker's `suite` on `nprocs` ranks (1: one plain process) writing into `outdir`;
    returns each rank's results (`<outdir>/<suite>_rank<r>.json`)."""
    if nprocs == 1:
        run_single(script, [outdir, suite], timeout=timeout)
    else:
        run_ranks(script, [outdir, suite], nprocs=nprocs, timeout=timeout)
    return [read_results(os.path.join(outdir, f"{suite}_rank{r}.json")) for r in range(nprocs)]


def scenario_results(ranks: list, name: str) -> list:
    """Scenario `name`'s result on every rank of a suite (fails with the rank's traceback on error)."""
    out = []
    for r, res in enumerate(ranks):
        assert "error" not in res[name], f"{name} failed on rank {r}:\n{res[name]['error']}"
        out.append(res[name]["result"])
    return out
