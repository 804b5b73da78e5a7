"""`--config.cuda_graphs=True` on a GPU: the tiny job's compiled step replayed as CUDA graphs logs the
losses of the plain compiled step, and a run stopped and resumed under graphs continues as the
straight one (the restored state is re-recorded, no stale buffers). Skipped without CUDA; the
refusals where graphs cannot work are tested on any machine in tests/test_main.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: CUDA graphs"),
    pytest.mark.slow,
]  # slow: a main-job run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = [
    "--config=configs/gpt.py:tiny",
    "--config.device=cuda",
    "--config.steps=12",
    "--config.log_every=1",
    "--config.eval_every=12",
    "--config.sample.max_new_tokens=0",
    "--config.checkpoint.every=6",
]


def _run(workdir, *extra):
    out = subprocess.run(
        [sys.executable, "-m", "functrain.main", f"--workdir={workdir}", *ARGS, *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _losses(workdir) -> dict[int, float]:
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_cuda_graph_steps_log_the_plain_compiled_losses_and_resume(tmp_path):
    _run(tmp_path / "plain")
    _run(tmp_path / "graphs", "--config.cuda_graphs=True")
    _run(tmp_path / "resumed", "--config.cuda_graphs=True", "--config.stop_at=6")
    _run(tmp_path / "resumed", "--config.cuda_graphs=True")
    plain, graphs, resumed = (_losses(tmp_path / d) for d in ("plain", "graphs", "resumed"))
    assert sorted(plain) == sorted(graphs) == sorted(resumed) == list(range(1, 13))
    steps = sorted(plain)
    # The same kernels in the same order, launched from a graph: fp32 rounding at most.
    torch.testing.assert_close(torch.tensor([graphs[s] for s in steps]), torch.tensor([plain[s] for s in steps]))
    torch.testing.assert_close(torch.tensor([resumed[s] for s in steps]), torch.tensor([graphs[s] for s in steps]))
