"""Runs every `examples/*.py` recipe as a subprocess: exit status 0 and its `<name>: OK` line.

Each script checks its own result (asserts) and prints one `<name>: OK ...` line at the end. They run
eagerly (no `--compile`); the data cache goes to a temporary directory, never into the repository.
FUNCTRAIN_SLOW_TESTS=1 also runs the EMA recipe compiled (its composed step as one graph, ~1-2 min).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.stem for p in (REPO / "examples").glob("*.py") if p.stem != "population")  # its own test


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One data cache for all the scripts (the corpus is tokenized once)."""
    return tmp_path_factory.mktemp("functrain-data")


def _run(name, *args, cache_dir, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1", FUNCTRAIN_CACHE_DIR=str(cache_dir))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, f"examples/{name}.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _check(proc, name):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith(f"{name}: OK"), proc.stdout[-3000:]


def test_all_examples_listed():
    assert set(EXAMPLES) == {"custom_loss", "ema", "per_example_grad_norms", "masked_weight_decay",
                             "frozen_params", "train_then_eval", "dp_sgd"}
    readme = (REPO / "examples" / "README.md").read_text()
    for name in EXAMPLES:
        assert f"`{name}.py`" in readme, name


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name, cache_dir):
    _check(_run(name, cache_dir=cache_dir), name)


def test_ema_donating(cache_dir):
    """The in-place (`_foreach_lerp_`, donated state) variant trains and passes the same checks."""
    _check(_run("ema", "--donate", "--steps", "30", cache_dir=cache_dir), "ema")


@pytest.mark.skipif(not os.environ.get("FUNCTRAIN_SLOW_TESTS"),
                    reason="compiles the composed EMA step (~1-2 min CPU); set FUNCTRAIN_SLOW_TESTS=1")
def test_ema_compiled(cache_dir):
    _check(_run("ema", "--compile", "--steps", "20", cache_dir=cache_dir, timeout=900), "ema")
