"""The fine-tuning job end to end (`python -m functrain.main` on supervised examples): killed with
SIGKILL after a checkpoint and resumed, it equals the uninterrupted run bit for bit; a 2-rank run's
checkpoint resumes on one process on the same batches; the README's SFT command runs in a fresh clone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import _main_job
import _tol
import pytest

pytestmark = pytest.mark.slow  # main-job runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _data(tmp_path) -> str:
    """A jsonl of 96 conversations of different lengths (so the steps' target counts differ)."""
    path = tmp_path / "chat.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"count to {i % 9 + 1}"},
                {"role": "assistant", "content": " ".join(str(k) for k in range(1, i % 9 + 2))},
            ]
        }
        for i in range(96)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _args(data):
    return [
        "--config=configs/sft.py",
        f"--config.data.path={data}",
        "--config.epochs=0",
        "--config.steps=12",
        "--config.batch_size=8",
        "--config.model.block_size=96",
        "--config.compile=False",
        "--config.log_every=1",
        "--config.eval_every=6",
        "--config.eval_batches=1",
        "--config.checkpoint.every=4",
        "--config.sample.max_new_tokens=8",
        "--config.export_hf=False",
        "--config.data.packing=True",
    ]


def _env(threads="2"):
    env = dict(os.environ, OMP_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    return env


def _main(workdir, *args, nproc=1, check=True, threads=None):
    launch = _main_job.command(nproc)
    out = subprocess.run(
        [*launch, f"--workdir={workdir}", *args],
        cwd=REPO,
        env=_env(threads or ("1" if nproc > 1 else "2")),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if check and out.returncode != 0:
        pytest.fail(f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}", pytrace=False)
    return out


def _rows(workdir):
    """(step, loss, grad_norm, targets) of every train row, in file order."""
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return [(r["step"], r["loss"], r["grad_norm"], r["targets"]) for r in rows if "loss" in r]


def test_sft_killed_after_a_checkpoint_resumes_bit_exactly(tmp_path):
    # One thread: on two, the hf family's eager step's first gradient norm differs between two processes
    # of the same command in its last bits (the BLAS library's threaded sums: stable under
    # MKL_CBWR=COMPATIBLE or a set --config.peak_flops, which skips the MFU probe's matmul), so three
    # processes compare bit for bit on one thread.
    args = _args(_data(tmp_path))
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    _main(straight, *args, threads="1")
    p = subprocess.Popen(
        [sys.executable, "-m", "functrain.main", f"--workdir={killed}", *args],
        cwd=REPO,
        env=_env("1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in p.stdout:
            if line.startswith("step  10/12") or line.startswith("step 10/12"):
                break
    finally:
        p.kill()  # SIGKILL after step 8's checkpoint
        p.wait()
    out = _main(killed, *args, threads="1")
    restored = re.findall(r"restored checkpoint step (\d+)", out.stdout)
    assert restored in (["8"], ["4"]), out.stdout[-2000:]
    want = {s: rest for s, *rest in _rows(straight)}
    assert sorted(want) == list(range(1, 13))
    assert len({t for _, _, t in want.values()}) > 3  # the steps' target counts differ
    for s, *rest in _rows(killed):
        assert rest == want[s], (s, rest, want[s])  # exact floats, the same targets
    assert "answer:" in out.stdout and "expected:" in out.stdout


def test_sft_from_two_ranks_resumes_on_one_process_on_the_same_batches(tmp_path):
    """Packed rows on 2 FSDP ranks (the hf family's staged loss, a gather per layer, the layout to every
    layer), resumed on one process (unstaged): the same batches, the same losses to rounding."""
    args = [*_args(_data(tmp_path)), "--config.optim.name=sgd", "--config.optim.lr=0.05", "--config.dist_timeout_s=600"]
    two, moved = tmp_path / "two", tmp_path / "moved"
    _main(two, *args, "--config.mesh.dp_shard=2", nproc=2)
    _main(moved, *args, "--config.mesh.dp_shard=2", "--config.stop_at=8", nproc=2)
    out = _main(moved, *args)
    assert "restored checkpoint step 8" in out.stdout
    want = {s: rest for s, *rest in _rows(two)}
    got = {s: rest for s, *rest in _rows(moved)}
    assert sorted(got) == list(range(1, 13))
    rtol = _tol.rtol(8 * 96 * 128 * 3)
    for s in range(9, 13):  # one process from the 2-rank checkpoint: the same batches (targets exactly)
        loss, grad_norm, targets = got[s]
        assert targets == want[s][2], s
        drift = 1 + (s - 8) * 2 * _tol.sgd_gain(0.05, 0.9)
        assert abs(loss - want[s][0]) <= rtol * drift * want[s][0], (s, loss, want[s][0])


@pytest.mark.exhaustive  # ~5 min: the whole SFT run; the tests above run configs/sft.py through the same main job
def test_the_readme_sft_command_runs_in_a_fresh_clone(tmp_path):
    readme = open(os.path.join(REPO, "README.md")).read()
    cmd = re.search(r"<!-- sft-command -->\s*```bash\n(.+?)\n```", readme, re.S).group(1).strip()
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", REPO, str(clone)], check=True, timeout=120)
    # the clone's own venv would install every package again: the command runs with this venv's python
    cmd = cmd.replace('.venv/bin/pip install -e ".[hf]" && ', "").replace(".venv/bin/python", sys.executable)
    env = dict(_env(), PYTHONPATH=str(clone))
    out = subprocess.run(cmd, shell=True, cwd=clone, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "answer:" in out.stdout and "expected:" in out.stdout
    summary = json.loads((clone / "runs" / "sft" / "summary.json").read_text())
    assert summary["loss"] < 2.0 and summary["val_loss"] < 2.0  # it learned (a fresh model starts near 5.5)


def test_a_resume_with_another_batch_size_stops_or_goes_on_where_told(tmp_path):
    """The data position is row = step x batch_size: a resume after batch_size changed stops in one line naming the
    change, the rows and the flag; with data.allow_changed it goes on and says so. accum_steps alone changes nothing
    (the batch is global), so that resume goes on silently."""
    args = [a for a in _args(_data(tmp_path)) if not a.startswith(("--config.steps", "--config.batch_size"))]
    run = tmp_path / "run"
    _main(run, *args, "--config.steps=4", "--config.batch_size=8")
    out = _main(run, *args, "--config.steps=6", "--config.batch_size=16", check=False)
    line = out.stderr.strip().splitlines()[-1]
    assert out.returncode != 0 and line.startswith("functrain: error: the data changed since checkpoint step 4 ("), line
    assert (
        "batch_size 8 -> 16 rows" in line
        and "step 5 would start at row 64 of the data where the run reached row 32" in line
    )
    assert "set batch_size=8, or pass --config.data.allow_changed=True" in line
    out = _main(run, *args, "--config.steps=6", "--config.batch_size=16", "--config.data.allow_changed=True")
    assert "batch_size 8 -> 16 rows" in out.stdout and "going on with it (data.allow_changed)" in out.stdout
    assert "restored checkpoint step 4" in out.stdout
    again = tmp_path / "again"
    _main(again, *args, "--config.steps=4", "--config.batch_size=8")
    out = _main(again, *args, "--config.steps=5", "--config.batch_size=8", "--config.accum_steps=2")
    assert "restored checkpoint step 4" in out.stdout and "data changed" not in out.stdout
