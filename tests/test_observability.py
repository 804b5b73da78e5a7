"""The tiny main-job run writes TensorBoard events, a profiler trace, run info and peak memory; the plot CLI renders
them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # main-job runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_run_writes_tensorboard_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    env = dict(os.environ, PYTHONPATH=REPO)
    work = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "functrain.main",
            "--config=configs/gpt.py:tiny",
            f"--workdir={work}",
            "--config.compile=False",
            "--config.steps=12",
            "--config.log_every=4",
            "--config.eval_every=6",
            "--config.eval_batches=1",
            "--config.sample.max_new_tokens=4",
            "--config.checkpoint.enabled=False",
            "--config.profile.start=2",
            "--config.profile.stop=4",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert os.path.getsize(work / "profile" / "trace_steps_2_4.json") > 1000
    run = json.loads((work / "run.json").read_text())
    assert "git_revision" in run and json.loads((work / "config.json").read_text())["steps"] == 12
    rows = [json.loads(ln) for ln in open(work / "metrics.jsonl")]
    assert all(r["peak_mem_mb"] > 10 for r in rows if "loss" in r)
    events = [f for f in os.listdir(work / "tb") if f.startswith("events.out.tfevents.")]
    assert len(events) == 1 and os.path.getsize(work / "tb" / events[0]) > 100

    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea_mod.EventAccumulator(str(work / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [4, 8, 12]
    assert [e.step for e in acc.Scalars("val_loss")] == [6, 12]

    plot = subprocess.run(
        [sys.executable, "-m", "functrain.trainer.plot", str(work)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plot.returncode == 0, plot.stderr
    png = work / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_throughput_counts_the_tokens_of_batches_of_varying_length():
    """Padded supervised rows: tokens per second from each step's batch (its length), not from the block."""
    import torch

    from functrain.trainer import metrics

    tp = metrics.Throughput(lambda batch: 8 * batch[0].shape[-1], 1.0, None, 10)
    tp.add((torch.zeros(8, 128),))  # the first (compiling) step: not in the window
    tp.start(1)
    for length in (32, 64, 32):
        tp.add((torch.zeros(8, length),))
    out = tp.report(4)
    assert out["tokens_per_s"] * out["step_time_s"] * 3 == pytest.approx(8 * (32 + 64 + 32), rel=1e-6)
