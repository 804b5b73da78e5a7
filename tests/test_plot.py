"""functrain.trainer.plot: curves PNG from a metrics.jsonl, as a function and as `python -m functrain.trainer.plot`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from functrain.trainer import plot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_metrics(workdir, grad_norm=True):
    """A metrics.jsonl like train() writes: train rows, val rows, a string, a resumed step, a torn line."""
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "metrics.jsonl", "w") as f:
        for s in range(10, 210, 10):
            row = {
                "step": s,
                "time": 1.7e9 + s,
                "loss": 5.5 * math.exp(-s / 60) + 1.4,
                "lr": 3e-3 * min(1, s / 50),
                "tokens_per_s": 4000.0 + s,
                "eta": "1m02s",
            }
            if grad_norm:
                row["grad_norm"] = 1 / (1 + s / 50)
            f.write(json.dumps(row) + "\n")
            if s % 50 == 0:
                f.write(json.dumps({"step": s, "time": 1.7e9 + s, "val_loss": 5.5 * math.exp(-s / 60) + 1.6}) + "\n")
        f.write(json.dumps({"step": 200, "loss": 1.0}) + "\n")  # a resumed run re-logs step 200
        f.write('{"step": 210, "lo')  # torn last line of a run still writing


def test_read_metrics_dedups_steps_and_skips_strings(tmp_path):
    _write_metrics(tmp_path)
    series = plot.read_metrics(tmp_path)
    assert set(series) == {"loss", "lr", "tokens_per_s", "grad_norm", "val_loss"}
    assert [s for s, _ in series["val_loss"]] == [50, 100, 150, 200]
    assert len(series["loss"]) == 20 and series["loss"][-1] == (200, 1.0)


def _check_png(path, min_w=600, min_h=300):
    """Valid PNG (magic bytes) with sensible pixel dimensions; returns (height, width)."""
    mpl_image = pytest.importorskip("matplotlib.image")
    assert path.read_bytes()[:8] == PNG_MAGIC
    img = mpl_image.imread(str(path))
    h, w = img.shape[:2]
    assert w >= min_w and h >= min_h and path.stat().st_size > 10_000
    assert img[..., :3].std() > 0.05  # something was drawn, not a blank canvas
    return h, w


def test_plot_metrics_function_default_and_custom_out(tmp_path):
    pytest.importorskip("matplotlib")
    _write_metrics(tmp_path / "run")
    out = plot.plot_metrics(tmp_path / "run")
    assert out == tmp_path / "run" / "curves.png"
    h, w = _check_png(out)
    assert (h, w) == (720, 1200)  # 2 x 2 panels at 100 dpi
    out2 = plot.plot_metrics(tmp_path / "run" / "metrics.jsonl", out=tmp_path / "pics" / "c.png")
    _check_png(out2)


def test_three_panels_without_grad_norm(tmp_path):
    pytest.importorskip("matplotlib")
    _write_metrics(tmp_path, grad_norm=False)
    _check_png(plot.plot_metrics(tmp_path))


def test_command_line(tmp_path):
    pytest.importorskip("matplotlib")
    _write_metrics(tmp_path / "run")
    out = tmp_path / "c.png"
    r = subprocess.run(
        [sys.executable, "-m", "functrain.trainer.plot", str(tmp_path / "run"), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out)
    _check_png(out)


def test_command_line_errors_exit_2_with_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "functrain.trainer.plot", str(tmp_path / "nope")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert r.stderr.startswith("functrain.trainer.plot: error: no such run directory")
    assert plot.main([str(tmp_path)]) == 2  # a directory without metrics.jsonl
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "eta": "1s"}) + "\n")
    assert plot.main([str(tmp_path)]) == 2  # nothing plottable


def test_missing_matplotlib_is_one_clear_error(tmp_path, monkeypatch, capsys):
    _write_metrics(tmp_path)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert plot.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install matplotlib" in err and "functrain[plot]" in err


def test_a_grpo_runs_reward_gets_a_panel(tmp_path):
    pytest.importorskip("matplotlib")
    _write_metrics(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        rows = [{"step": s, "reward": s / 20, "reward_std": 0.1} for s in range(1, 21)]
        f.write("\n" + "".join(json.dumps(r) + "\n" for r in rows))
    assert {"reward", "reward_std"} <= set(plot.read_metrics(tmp_path))
    assert _check_png(plot.plot_metrics(tmp_path)) == (1080, 1200)  # 5 panels: 3 rows of 2
