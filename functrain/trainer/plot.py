"""Training curves from a run's `metrics.jsonl` as one PNG: loss (train and val), lr, throughput, grad norm, and
a GRPO run's reward.

Internals: docs/internals.md "functrain.trainer.plot".

Example:
    >>> from functrain.trainer.plot import plot_metrics
    >>> plot_metrics("runs/gpt")
    PosixPath('runs/gpt/curves.png')
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from functrain.errors import FunctrainError

__all__ = ["PlotError", "read_metrics", "plot_metrics", "main"]

# (title, [(metric key, label)], y-axis label); a panel is drawn when any of its keys has data.
_PANELS = [
    ("loss", [("loss", "train"), ("val_loss", "val")], "cross-entropy"),
    ("learning rate", [("lr", "lr")], "lr"),
    ("throughput", [("tokens_per_s", "tokens/s")], "tokens / s"),
    ("gradient norm", [("grad_norm", "grad norm (before clipping)")], "global L2 norm"),
    ("reward", [("reward", "mean reward"), ("reward_std", "reward std")], "reward (GRPO)"),
]


class PlotError(FunctrainError, RuntimeError):
    """The curves cannot be drawn (no metrics file, nothing to plot, matplotlib missing)."""


def _metrics_file(workdir: str | os.PathLike) -> Path:
    """`<workdir>/metrics.jsonl` (or `workdir` itself when it is a file), checked to exist."""
    path = Path(workdir)
    if path.is_dir():
        path = path / "metrics.jsonl"
    elif not path.exists():
        raise PlotError(f"no such run directory: {path}")
    if not path.is_file():
        raise PlotError(f"no metrics file at {path} (a run writes <workdir>/metrics.jsonl)")
    return path


def read_metrics(workdir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """The numeric series of a run: {key: [(step, value), ...] sorted by step}.

    Args:
      workdir: a run directory holding `metrics.jsonl`, or the path of such a file.

    Returns:
      One series per numeric key (not `step`/`time`); the last value logged for a step wins.

    Raises:
      PlotError: the directory or file does not exist.

    Example:
      >>> read_metrics("runs/gpt")["val_loss"][-1]
      (3000, 1.61)
    """
    path = _metrics_file(workdir)
    series: dict[str, dict[int, float]] = {}
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a partial line from a run that is still writing
            if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
                continue
            step = int(row["step"])
            for key, value in row.items():
                if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                series.setdefault(key, {})[step] = float(value)
    return {k: sorted(v.items()) for k, v in series.items()}


def _import_matplotlib():
    """matplotlib's Figure class (rendered by Agg; pyplot's global backend is left alone), or PlotError."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError(
            "functrain.trainer.plot needs matplotlib: pip install matplotlib (or pip install 'functrain[plot]')"
        ) from None
    return Figure


def plot_metrics(workdir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Draws a run's curves into a PNG.

    Panels (each only when its metrics were logged): loss (train and val), learning rate,
    throughput (tokens/s), gradient norm; the x axis is the optimizer step.

    Args:
      workdir: the run directory (reads `metrics.jsonl`), or the path of a metrics file.
      out: the PNG to write; default `<workdir>/curves.png` (next to the metrics file).

    Returns:
      The path of the PNG.

    Raises:
      PlotError: no metrics file, no plottable metric in it, or matplotlib not installed.

    Example:
      >>> plot_metrics("runs/gpt", out="gpt.png")
    """
    path = _metrics_file(workdir)
    series = read_metrics(path)
    panels = [(t, [(k, lbl) for k, lbl in keys if series.get(k)], y) for t, keys, y in _PANELS]
    panels = [p for p in panels if p[1]]
    if not panels:
        wanted = ", ".join(k for _, keys, _ in _PANELS for k, _ in keys)
        raise PlotError(f"{path} has none of the metrics to plot ({wanted})")
    Figure = _import_matplotlib()

    ncols = 1 if len(panels) == 1 else 2
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(6 * ncols, 3.6 * nrows), dpi=100, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (title, keys, ylabel) in zip(axes, panels):
        for key, label in keys:
            steps, values = zip(*series[key])
            style = {"marker": "o", "markersize": 3} if key == "val_loss" or len(steps) < 30 else {}
            ax.plot(steps, values, label=label, linewidth=1.2, **style)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if any(k == "lr" for k, _ in keys):
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        if len(keys) > 1:
            ax.legend()
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(str(path.parent.resolve().name))
    out = Path(out) if out is not None else path.parent / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m functrain.trainer.plot <workdir> [--out FILE.png]`; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m functrain.trainer.plot", description="Plot a functrain run's metrics.jsonl into a PNG."
    )
    parser.add_argument("workdir", help="run directory holding metrics.jsonl (or the file itself)")
    parser.add_argument("--out", default=None, help="PNG to write (default: <workdir>/curves.png)")
    args = parser.parse_args(argv)
    try:
        out = plot_metrics(args.workdir, args.out)
    except PlotError as e:
        print(f"functrain.trainer.plot: error: {e}", file=sys.stderr)  # as functrain.main words its errors
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
