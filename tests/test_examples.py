"""Runs every `examples/*.py` recipe as a subprocess: exit status 0 and its `<name>: OK` line.

Each script checks its own result (asserts) and prints one `<name>: OK ...` line at the end. They run
eagerly. `pytest -m exhaustive` also runs compiled the three whose point is compilation: the LR
sweep (one graph for 4 learning rates, ~80 s; the whole suite still checks that other rates hit
the compile cache, tests/test_compile_cache.py), DP-SGD (vmap(grad) + noise + update as one graph,
~110 s) and EMA (its composed step as one graph, ~1-2 min). The
data cache goes to a temporary directory, never into the repository. Each recipe's own code is at most 30
lines (imports and docstring aside; flags and data set-up live in `examples/_common.py`).
"""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
from _tol import rtol

pytestmark = pytest.mark.slow  # every recipe in a subprocess

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted(p.stem for p in (REPO / "examples").glob("*.py") if not p.stem.startswith("_"))
EXAMPLES = [name for name in RECIPES if name != "population"]  # population.py has its own test


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One data cache for all the scripts (the corpus is tokenized once)."""
    return tmp_path_factory.mktemp("functrain-data")


def _run(name, *args, cache_dir, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1", FUNCTRAIN_CACHE_DIR=str(cache_dir))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, f"examples/{name}.py", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _check(proc, name):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith(f"{name}: OK"), proc.stdout[-3000:]


def test_all_examples_listed():
    assert set(RECIPES) == {
        "custom_loss",
        "ema",
        "per_example_grad_norms",
        "masked_weight_decay",
        "frozen_params",
        "train_then_eval",
        "dp_sgd",
        "population",
        "lr_sweep",
        "batchnorm",
        "hf_model",
        "grpo",
    }
    readme = (REPO / "examples" / "README.md").read_text()
    for name in RECIPES:
        assert f"`{name}.py`" in readme, name


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not the module docstring, not an import."""
    body = ast.parse(source).body
    skip = set()
    for i, node in enumerate(body):
        docstring = i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if docstring or isinstance(node, (ast.Import, ast.ImportFrom)):
            skip.update(range(node.lineno, node.end_lineno + 1))
    layout = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENCODING,
        tokenize.ENDMARKER,
    }
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in layout:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - skip)


def test_code_lines_counts_code_only():
    src = (
        '"""Doc\nstring."""\n\nimport os\nfrom a import (b,\n    c)\n# note\n'
        'x = (1,\n     2)  # two lines\ns = """a\nb"""\n'
    )
    assert code_lines(src) == 4
    assert code_lines(src + "def f():\n    return 1\n") == 6


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_is_at_most_30_lines(name):
    source = (REPO / "examples" / f"{name}.py").read_text()
    assert code_lines(source) <= 30, f"{name}.py has {code_lines(source)} lines of code"
    private = re.findall(r"torch\._(?!dynamo\b)\w+", source)  # dynamo's counters count compiles
    assert not private, f"private torch ops: {private}"
    assert max(len(line) for line in source.splitlines()) <= 120


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name, cache_dir):
    _check(_run(name, cache_dir=cache_dir), name)


@pytest.mark.exhaustive  # compiles the LR sweep (~80 s CPU)
def test_lr_sweep_compiles_once(cache_dir):
    """4 learning rates, one compiled graph (the recipe asserts it with dynamo's counters)."""
    proc = _run("lr_sweep", "--compile", "--steps", "8", cache_dir=cache_dir, timeout=900)
    _check(proc, "lr_sweep")
    assert "1 compiled graph(s)" in proc.stdout.splitlines()[-1]


@pytest.mark.exhaustive  # compiles the DP-SGD step (~110 s CPU)
def test_dp_sgd_compiles(cache_dir):
    """The whole DP-SGD step (per-example grads, clipping, keyed noise, update) compiles as one
    graph and trains (the recipe's own checks); its first loss equals the eager run's."""
    runs = [_run("dp_sgd", *flags, cache_dir=cache_dir, timeout=900) for flags in ([], ["--compile"])]
    for proc in runs:
        _check(proc, "dp_sgd")
    first = [
        float(next(line for line in p.stdout.splitlines() if line.startswith("step")).split("|")[1].split()[1])
        for p in runs
    ]
    n = 8 * 32 * 256  # batch x block x vocab: the loss's reduction
    assert abs(first[0] - first[1]) <= 1e-4 + rtol(n) * abs(first[0]), first  # printed to 4 decimals


@pytest.mark.exhaustive  # compiles the composed EMA step (~1-2 min CPU)
def test_ema_compiled(cache_dir):
    _check(_run("ema", "--compile", "--steps", "20", cache_dir=cache_dir, timeout=900), "ema")
