"""Launches N ranks of a worker script as plain subprocesses with torchrun's env vars (no torchrun)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, args: list[str], nprocs: int, timeout: float = 600.0) -> None:
    """Runs `python script *args` as `nprocs` ranks (RANK/WORLD_SIZE/... set); raises if any fails."""
    port = _free_port()
    procs = []
    for r in range(nprocs):
        env = dict(os.environ)
        env.update(
            RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH", "")]),
        )
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        tails = "\n".join(f"--- rank {r} (exit {rc}) ---\n{outs[r][-4000:]}" for r, rc in bad)
        raise RuntimeError(f"{script} failed on ranks {[r for r, _ in bad]}:\n{tails}")


def run_single(script: str, args: list[str], timeout: float = 600.0) -> None:
    """Runs `python script *args` as one process WITHOUT torchrun's env vars; raises if it fails."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, script, *args], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{script} failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")


def read_results(path: str) -> dict:
    """The JSON results a worker rank wrote."""
    with open(path) as f:
        return json.load(f)
