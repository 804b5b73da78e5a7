"""The main job under torchrun (2 gloo processes): same results as one process, rank-0 logging,
and bit-exact resume on 2 ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import _main_job
import _tol
import pytest
import torch

from functrain import checkpoint as ckpt
from functrain import tree as tree_lib

pytestmark = [pytest.mark.numeric, pytest.mark.slow]  # slow: main-job runs under torchrun

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--config=configs/gpt.py:tiny",
    "--config.compile=False",
    "--config.log_every=5",
    "--config.eval_every=10",
    "--config.eval_batches=1",
    "--config.sample.max_new_tokens=16",
    "--config.eval.tasks=",  # (multiple-choice scoring on ranks: tests/test_eval.py)
]


def _run(workdir, *extra, nproc=2):
    """Runs the main job (under torchrun when nproc > 1); returns the CompletedProcess."""
    launch = _main_job.command(nproc)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    out = subprocess.run(
        [*launch, f"--workdir={workdir}", *TINY, *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    if out.returncode != 0:  # pytest.fail prints it whole (a tuple in an assert's message is cut short)
        pytest.fail(
            f"exit {out.returncode}\n--- stdout ---\n{out.stdout[-3000:]}\n--- stderr (every rank's) ---\n"
            f"{out.stderr[-12000:]}",
            pytrace=False,
        )
    return out


def _rows(workdir):
    return [json.loads(ln) for ln in open(os.path.join(workdir, "metrics.jsonl"))]


def test_torchrun_fsdp_matches_single_process_and_logs_once(tmp_path):
    # SGD: its trajectory moves with the gradients, so the runs stay within rounding of each other;
    # AdamW would turn the rounding noise of near-zero gradients into full-size steps (tests/_tol.py).
    sgd = ["--config.steps=20", "--config.log_every=1", "--config.optim.name=sgd", "--config.optim.lr=0.05"]
    single = _run(tmp_path / "one", *sgd, nproc=1)
    sharded = _run(tmp_path / "two", *sgd, "--config.mesh.dp_shard=2", "--config.dist_timeout_s=600")
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [r["step"] for r in two if "loss" in r] == list(range(1, 21))  # written once, by rank 0
    assert [r["step"] for r in two if "val_loss" in r] == [10, 20]
    n = 16 * 64 * 4 * 64  # the tiny job's batch x block tokens through matmuls up to 4 x 64 wide
    rtol = _tol.rtol(n)
    for i, (a, b) in enumerate(zip([r for r in one if "loss" in r], [r for r in two if "loss" in r])):
        # Step 1 starts from the same params: only the reduction order differs (reduce-scatter over
        # 2 ranks vs one sum); later steps drift at most linearly (clipped SGD, gain lr / (1 - 0.9)).
        drift = 1 + i * 2 * _tol.sgd_gain(0.05, 0.9)
        assert abs(b["loss"] - a["loss"]) <= rtol * drift * a["loss"], (i, a["loss"], b["loss"])
        assert abs(b["grad_norm"] - a["grad_norm"]) <= rtol * drift * a["grad_norm"], (i, a, b)
    assert sharded.stdout.count("sample:") == 1 and single.stdout.count("sample:") == 1
    assert "mesh {'dp_replicate': 1, 'dp_shard': 2, 'cp': 1, 'tp': 1}" in sharded.stdout


def test_two_rank_resume_is_bit_exact(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = [
        "--config.steps=20",
        "--config.checkpoint.every=10",
        "--config.mesh.dp_shard=2",
        "--config.model.dropout=0.1",
    ]
    _run(straight, *args)
    _run(resumed, *args, "--config.stop_at=10")
    out = _run(resumed, *args)
    assert "restored checkpoint step 10" in out.stdout
    a = {r["step"]: r["loss"] for r in _rows(straight) if "loss" in r}
    b = {r["step"]: r["loss"] for r in _rows(resumed) if "loss" in r}
    assert a == b and sorted(b) == [5, 10, 15, 20]
    ta = dict(tree_lib.named_leaves(ckpt.restore(str(straight / "checkpoints" / "20")).result()))
    tb = dict(tree_lib.named_leaves(ckpt.restore(str(resumed / "checkpoints" / "20")).result()))
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


def test_torchrun_context_parallel_matches_single_process_and_resumes_on_one(tmp_path):
    # the main job with each sequence split over 2 ranks (--config.mesh.cp=2): the same losses as one
    # process; its step-10 checkpoint resumes on one process (another mesh) and ends where one process does
    sgd = [
        "--config.steps=20",
        "--config.log_every=1",
        "--config.optim.name=sgd",
        "--config.optim.lr=0.05",
        "--config.checkpoint.every=10",
    ]
    cp = ["--config.mesh.cp=2", "--config.mesh.dp_shard=1", "--config.dist_timeout_s=600"]
    _run(tmp_path / "one", *sgd, nproc=1)
    out = _run(tmp_path / "cp", *sgd, *cp, "--config.stop_at=10")
    assert "mesh {'dp_replicate': 1, 'dp_shard': 1, 'cp': 2, 'tp': 1}" in out.stdout
    resumed = _run(tmp_path / "cp", *sgd, nproc=1)
    assert "restored checkpoint step 10" in resumed.stdout
    one = {r["step"]: r for r in _rows(tmp_path / "one") if "loss" in r}
    two = {r["step"]: r for r in _rows(tmp_path / "cp") if "loss" in r}
    assert sorted(two) == list(range(1, 21)) and sorted(one) == sorted(two)
    rtol = _tol.rtol(16 * 64 * 4 * 64)
    for i, step in enumerate(sorted(one)):
        a, b = one[step], two[step]
        drift = 1 + i * 2 * _tol.sgd_gain(0.05, 0.9)
        assert abs(b["loss"] - a["loss"]) <= rtol * drift * a["loss"], (step, a["loss"], b["loss"])
        assert abs(b["grad_norm"] - a["grad_norm"]) <= rtol * drift * a["grad_norm"], (step, a, b)
    val_one = {r["step"]: r["val_loss"] for r in _rows(tmp_path / "one") if "val_loss" in r}
    val_two = {r["step"]: r["val_loss"] for r in _rows(tmp_path / "cp") if "val_loss" in r}
    assert sorted(val_two) == sorted(val_one) == [10, 20]  # step 10 evaluated under cp, 20 on one process
    for step in val_one:
        assert abs(val_two[step] - val_one[step]) <= rtol * 40 * val_one[step], (step, val_one, val_two)


def test_torchrun_pipeline_matches_single_process_and_moves_between_meshes(tmp_path):
    # the main job cut into 2 pipeline stages (--config.mesh.pp=2, 4 microbatches, 1F1B): the same losses
    # as one process accumulating 4 microbatches; its step-10 checkpoint resumes on one process to step 15,
    # whose checkpoint resumes on the pipeline again to step 20
    sgd = [
        "--config.steps=20",
        "--config.log_every=1",
        "--config.optim.name=sgd",
        "--config.optim.lr=0.05",
        "--config.checkpoint.every=5",
    ]
    pp = ["--config.mesh.pp=2", "--config.mesh.dp_shard=1", "--config.pp.microbatches=4", "--config.dist_timeout_s=600"]
    _run(tmp_path / "one", *sgd, "--config.accum_steps=4", nproc=1)
    out = _run(tmp_path / "pp", *sgd, *pp, "--config.stop_at=10")
    assert "x pp=2 (1f1b, 4 microbatches)" in out.stdout
    middle = _run(tmp_path / "pp", *sgd, "--config.accum_steps=4", "--config.stop_at=15", nproc=1)
    assert "restored checkpoint step 10" in middle.stdout
    last = _run(tmp_path / "pp", *sgd, *pp)
    assert "restored checkpoint step 15" in last.stdout and "finish skipped" in last.stdout
    one = {r["step"]: r for r in _rows(tmp_path / "one") if "loss" in r}
    two = {r["step"]: r for r in _rows(tmp_path / "pp") if "loss" in r}
    assert sorted(two) == list(range(1, 21)) and sorted(one) == sorted(two)  # logged once (rank 0)
    rtol = _tol.rtol(16 * 64 * 4 * 64)
    for i, step in enumerate(sorted(one)):
        a, b = one[step], two[step]
        drift = 1 + i * 2 * _tol.sgd_gain(0.05, 0.9)
        for key in ("loss", "grad_norm", "param_norm"):  # every stage's part of the norms
            assert abs(b[key] - a[key]) <= rtol * drift * a[key], (step, key, a[key], b[key])
    val_one = {r["step"]: r["val_loss"] for r in _rows(tmp_path / "one") if "val_loss" in r}
    val_two = {r["step"]: r["val_loss"] for r in _rows(tmp_path / "pp") if "val_loss" in r}
    assert sorted(val_two) == [10, 15, 20] and sorted(val_one) == [10, 20]  # (15: the one-process run's end)
    for step in val_one:
        assert abs(val_two[step] - val_one[step]) <= rtol * 40 * val_one[step], (step, val_one, val_two)


def test_a_block_size_the_cp_ranks_cannot_split_is_one_line(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, WORLD_SIZE="2", RANK="0")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "functrain.main",
            f"--workdir={tmp_path}",
            *TINY,
            "--config.mesh.cp=2",
            "--config.model.block_size=62",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1, out.stderr
    assert "model.block_size=62" in lines[0] and "--config.mesh.cp" in lines[0], lines


def test_torchrun_brings_a_run_back_after_a_worker_is_killed_bit_exactly():
    """torchrun --max-restarts=1, 2 gloo ranks, one worker killed with kill -9 after the step-30
    checkpoint: the new attempt builds its groups afresh (under a store prefix of its own: the
    elastic_attempt_store workaround), restores step 30 and logs the uninterrupted run's losses, bit
    for bit. One drill here; `bash bench/elastic.sh 10` runs ten in a row."""
    proc = subprocess.run(
        ["bash", "bench/elastic.sh", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, PYTHON=sys.executable),
    )
    assert proc.returncode == 0 and "elastic: 1/1 restarted bit-exactly" in proc.stdout, proc.stdout + proc.stderr
