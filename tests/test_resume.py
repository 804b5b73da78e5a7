"""The main loop's checkpoint integration: bit-exact resume, crash safety, preemption, bad restores.

Each test runs `python -m functrain.main` (tiny variant, eager to keep it fast) in subprocesses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from functrain import checkpoint as ckpt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
TINY = [
    "--config=configs/gpt.py:tiny",
    "--config.compile=False",
    "--config.log_every=1",
    "--config.eval_every=1000",
    "--config.eval_batches=1",
    "--config.sample.max_new_tokens=8",
    "--config.model.dropout=0.1",  # so the RNG stream must continue exactly too
]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    return env


def _main(workdir, *extra, check=True):
    """Runs the main job to completion; returns the CompletedProcess."""
    out = subprocess.run(
        [PYTHON, "-m", "functrain.main", f"--workdir={workdir}", *TINY, *extra],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600,
    )
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


def _losses(workdir):
    """{step: train loss} from metrics.jsonl (the last value logged for each step)."""
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _restore_all(workdir, step):
    """The checkpoint `step` of a run as plain tensors."""
    return ckpt.restore(os.path.join(workdir, "checkpoints", str(step))).result()


def test_resume_is_bit_exact(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _main(straight, "--config.steps=20", "--config.checkpoint.every=10")
    first = _main(resumed, "--config.steps=20", "--config.checkpoint.every=10", "--config.stop_at=10")
    assert "stopped (stop_at) at step 10" in first.stdout
    second = _main(resumed, "--config.steps=20", "--config.checkpoint.every=10")
    assert "restored checkpoint step 10" in second.stdout

    a, b = _losses(straight), _losses(resumed)
    assert sorted(b) == list(range(1, 21))
    assert [a[s] for s in range(1, 21)] == [b[s] for s in range(1, 21)]  # exact floats
    ta, tb = _restore_all(straight, 20), _restore_all(resumed, 20)
    flat_a, flat_b = dict(_named(ta)), dict(_named(tb))
    assert flat_a.keys() == flat_b.keys() and len(flat_a) > 10
    for name in flat_a:
        assert torch.equal(flat_a[name], flat_b[name]), name
    assert int(flat_b["step"]) == 20


def _named(tree):
    from functrain import tree as tree_lib

    return tree_lib.named_leaves(tree)


_STUCK_SECOND_SAVE = r"""
import sys, time
from functrain.checkpoint import writer
real = writer._merge_and_commit
calls = []
def stuck_on_second(*args, **kwargs):
    calls.append(1)
    if len(calls) >= 2:
        print("committing", flush=True)
        time.sleep(600)
    return real(*args, **kwargs)
writer._merge_and_commit = stuck_on_second
from functrain import main
sys.argv = ["functrain.main"] + sys.argv[1:]
main.run()
"""


def test_kill_9_during_async_save_keeps_previous_step_and_resumes(tmp_path):
    work = tmp_path / "run"
    args = [f"--workdir={work}", *TINY, "--config.steps=15", "--config.checkpoint.every=5"]
    p = subprocess.Popen(
        [PYTHON, "-c", _STUCK_SECOND_SAVE, *args], cwd=REPO, env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        deadline = time.time() + 300
        for line in p.stdout:  # training logs, then the marker from inside step 10's commit
            if line.strip() == "committing" or time.time() > deadline:
                break
        assert line.strip() == "committing"
    finally:
        p.kill()  # SIGKILL in the middle of step 10's async save
        p.wait()
    ckdir = work / "checkpoints"
    assert sorted(os.listdir(ckdir)) == ["10.orbax-checkpoint-tmp", "5"]

    out = _main(work, "--config.steps=15", "--config.checkpoint.every=5")
    assert "restored checkpoint step 5" in out.stdout
    assert sorted(os.listdir(ckdir)) == ["10", "15"]  # tmp cleaned; keep=2 retention
    assert sorted(_losses(work))[-1] == 15


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    work = tmp_path / "run"
    p = subprocess.Popen(
        [PYTHON, "-m", "functrain.main", f"--workdir={work}", *TINY, "--config.steps=100000",
         "--config.checkpoint.every=0"],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    for line in p.stdout:
        if line.startswith("step") and "loss" in line:
            break
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr[-2000:]
    stopped = [l for l in stdout.splitlines() if "stopped (SIGTERM)" in l]
    assert stopped, stdout[-2000:]
    step = int(stopped[0].split("at step ")[1].split(";")[0])
    assert os.listdir(work / "checkpoints") == [str(step)]
    assert int(_restore_all(work, step)["step"]) == step


def test_restore_onto_another_model_is_one_clear_error(tmp_path):
    work = tmp_path / "run"
    _main(work, "--config.steps=2", "--config.checkpoint.every=2")
    out = _main(work, "--config.steps=4", "--config.model.n_embd=32", check=False)
    assert out.returncode == 2
    lines = [l for l in out.stderr.strip().splitlines() if l.strip()]
    assert lines[-1].startswith("functrain: error: checkpoint ")
    assert "shape" in lines[-1] and "Traceback" not in out.stderr
