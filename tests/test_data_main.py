"""The main job on parquet/jsonl shards: a weighted mixture sampled by epochs, tokenized by both
ranks, logged per source, and resumed from 2 ranks onto 1 and from 1 onto 2 with the same batches."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import _main_job
import _tol
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.slow  # main-job runs, under torchrun too

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WORDS = "def return class import self if else for while in not and or None True".split()


def _docs(n, seed):
    rnd = random.Random(seed)
    return [" ".join(rnd.choice(_WORDS) for _ in range(rnd.randint(5, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def mixture_config(tmp_path_factory):
    """A config file: tiny GPT on web (jsonl, 3 shards) 70% / code (parquet, small: several epochs) 30%."""
    root = tmp_path_factory.mktemp("mix")
    (root / "web").mkdir()
    for i in range(3):
        (root / "web" / f"w{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(400, i)))
    pq.write_table(pa.table({"body": _docs(40, 9)}), root / "code.parquet")
    path = root / "mix_config.py"
    path.write_text(f"""
from configs.gpt import get_config as base


def get_config():
    c = base("tiny")
    c.data.sources = {{"web": {str(root / "web")!r}, "code": {str(root / "code.parquet")!r}}}
    c.data.mixture = {{"web": 0.7, "code": 0.3}}
    c.data.text_field = "body"
    c.data.sampling = "epochs"
    c.data.val_fraction = 0.2  # small sources: a validation set of several windows each
    return c
""")
    # the web shards say "text": a mixture reads one field, so rename it there
    for i in range(3):
        p = root / "web" / f"w{i}.jsonl"
        p.write_text(p.read_text().replace('{"text":', '{"body":'))
    return path


ARGS = [
    "--config.compile=False",
    "--config.log_every=5",
    "--config.eval_every=10",
    "--config.eval_batches=1",
    "--config.sample.max_new_tokens=8",
    "--config.steps=20",
    "--config.checkpoint.every=10",
    "--config.optim.name=sgd",
    "--config.optim.lr=0.05",
]


def _run(config, workdir, *extra, nproc=1):
    launch = _main_job.command(nproc)
    if nproc > 1:
        extra = ("--config.mesh.dp_shard=2", "--config.dist_timeout_s=600", *extra)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    out = subprocess.run(
        [*launch, f"--config={config}", f"--workdir={workdir}", *ARGS, *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode != 0:
        pytest.fail(f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-8000:]}", pytrace=False)
    return out


def _rows(workdir):
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def test_mixture_by_epochs_logs_epochs_and_per_source_val_loss(mixture_config, tmp_path):
    out = _run(mixture_config, tmp_path / "run")
    rows = _rows(tmp_path / "run")
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [10, 20]
    for r in evals:
        assert {"val_loss/web", "val_loss/code"} <= set(r)
        assert min(r["val_loss/web"], r["val_loss/code"]) <= r["val_loss"] <= max(r["val_loss/web"], r["val_loss/code"])
    last = [r for r in rows if "loss" in r][-1]
    # code: 30% of 20 x 16 rows = 96 windows of a corpus of fewer: past its first epoch
    assert last["epoch/code"] >= 1 and 0 <= last["epoch_fraction/code"] < 1 and last["epoch/web"] == 0
    assert "data_wait_ms" in last
    assert "mixture code 30% / web 70%" in out.stdout  # sources in name order and "tokenized" in out.stdout


def test_resume_on_another_world_size_continues_the_same_run(mixture_config, tmp_path):
    straight = tmp_path / "straight"
    _run(mixture_config, straight)
    a = {r["step"]: r for r in _rows(straight) if "loss" in r}
    n = 16 * 64 * 4 * 64  # the tiny job's batch x block tokens through matmuls up to 4 x 64 wide
    rtol = _tol.rtol(n)
    for name, first, second in (("2to1", 2, 1), ("1to2", 1, 2)):
        workdir = tmp_path / name
        _run(mixture_config, workdir, "--config.stop_at=10", nproc=first)
        out = _run(mixture_config, workdir, nproc=second)
        assert "restored checkpoint step 10" in out.stdout
        b = {r["step"]: r for r in _rows(workdir) if "loss" in r}
        assert sorted(b) == [5, 10, 15, 20]
        for i, step in enumerate(sorted(b)):
            # the same global batches: only the reduction order differs (sharded vs one process), and
            # clipped SGD lets that rounding drift at most linearly (tests/_tol.py); another batch
            # would move the loss by O(1e-2), far outside this
            drift = 1 + i * 5 * 2 * _tol.sgd_gain(0.05, 0.9)
            assert abs(b[step]["loss"] - a[step]["loss"]) <= rtol * drift * a[step]["loss"], (name, step)
            assert b[step]["epoch/code"] == a[step]["epoch/code"]


def test_every_rank_count_reads_the_same_global_batches_from_the_shards(mixture_config, tmp_path):
    import importlib.util

    import torch

    from functrain.data import Batching, Placement, lm_data

    spec = importlib.util.spec_from_file_location("mix_config", mixture_config)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, REPO)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(REPO)
    config = module.get_config()

    def data(rank, world):
        return lm_data(
            config.data,
            Placement(str(tmp_path / "cache"), dp_rank=rank, dp_world=world, log=lambda line: None),
            Batching(16, 64, seed=0, eval_batches=1),
        )

    one = data(0, 1)
    for world in (2, 4):
        ranks = [data(r, world) for r in range(world)]
        for step in (0, 9, 10, 19):  # the steps around a resume at 10
            x = torch.cat([d.train_batch(step)[0] for d in ranks])
            assert torch.equal(x, one.train_batch(step)[0]), (world, step)
            assert ranks[0].position(step) == one.position(step)
