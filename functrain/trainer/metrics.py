"""Run metrics: throughput and MFU, and writers (console, JSON lines).

Example:
    >>> writer = MultiWriter([ConsoleWriter(), JsonlWriter(workdir / "metrics.jsonl")])
    >>> writer.write(step, {"loss": 2.1, "lr": 3e-4})
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

import functrain.metric_names as M

__all__ = [
    "ConsoleWriter",
    "JsonlWriter",
    "MultiWriter",
    "Throughput",
    "measure_peak_flops",
    "peak_flops",
    "format_eta",
    "to_python",
]


def to_python(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Metrics with 0-d tensors (DTensors too) turned into Python floats.

    Args:
      metrics: {name: 0-d tensor or number}.

    Returns:
      {name: float}; each tensor costs a device sync, so call it only on logging steps.

    Example:
      >>> row = to_python(metrics)   # {'loss': 2.13, 'lr': 0.0003, ...}
    """
    out = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor):
            v = v.detach()
            if hasattr(v, "full_tensor"):
                v = v.full_tensor()
            v = v.float().item()
        out[k] = v
    return out


def format_eta(seconds: float) -> str:
    """A remaining time as the console line shows it.

    Args:
      seconds: the time left (NaN, inf or negative: unknown).

    Returns:
      '1h02m', '3m07s', '12s', or '?' when unknown.

    Example:
      >>> format_eta(187)
      '3m07s'
    """
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


class ConsoleWriter:
    """Prints one compact line per write: `step 100 | loss 2.134 | lr 3.0e-04 | ...`."""

    def __init__(self, total_steps: int | None = None, print_fn=None):
        self.total_steps = total_steps
        self.print_fn = print_fn or functools.partial(print, flush=True)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Prints `metrics` for `step`."""
        width = len(str(self.total_steps)) if self.total_steps else 0
        parts = [f"step {step:>{width}d}" + (f"/{self.total_steps}" if self.total_steps else "")]
        for k, v in metrics.items():
            if k in _QUIET_WHEN_ZERO and not v:
                continue
            parts.append(f"{k} {_fmt(k, v)}")
        self.print_fn(" | ".join(parts))

    def close(self) -> None:
        """Nothing to release."""


_QUIET_WHEN_ZERO = set(M.QUIET_WHEN_ZERO)  # printed only once something happened (files get every value)


def _fmt(key: str, v: Any) -> str:
    """Human formatting of one metric value."""
    if isinstance(v, str):
        return v
    if key == M.LR:
        return f"{v:.2e}"
    if key.endswith((M.TOKENS_PER_S, M.TARGETS_PER_S)) or key == M.TARGETS:
        return f"{v:,.0f}"
    if key.endswith("_mb"):
        return f"{v:,.0f}"
    if key == M.MFU:
        return f"{100 * v:.1f}%"
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1e4 else f"{v:.4g}"
    return str(v)


class JsonlWriter:
    """Appends one JSON object per write to a file: `{"step": 10, "loss": 2.1, ...}`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Appends `{"step": step, **metrics}` as one line."""
        row = {"step": int(step), "time": time.time()}
        row.update({k: v for k, v in metrics.items() if not isinstance(v, str)})
        self._f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        """Closes the file."""
        self._f.close()


class MultiWriter:
    """Fans one write out to several writers."""

    def __init__(self, writers: Iterable):
        self.writers = list(writers)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes to every writer."""
        for w in self.writers:
            w.write(step, metrics)

    def close(self) -> None:
        """Closes every writer."""
        for w in self.writers:
            w.close()


class Throughput:
    """Tokens per second, model FLOP utilization and ETA over the steps since the last report.

    Args:
      tokens_per_step: global tokens processed by one step, or `batch -> tokens` for batches whose length varies
        (padded supervised rows): then `add(batch)` counts each step's.
      flops_per_token: training FLOPs per token (see `models.gpt.flops_per_token`).
      peak_flops: the hardware's peak FLOP/s for the whole job (all ranks), or None.
      total_steps: the run's length, for the ETA.
      probe: optional `() -> FLOP/s` of the whole job, measured again after each report (outside
        the timed window): the peak is the best of every probe, so one probe that a busy machine
        slowed does not stay the denominator. Whatever the peak, the MFU is at most 100%: a window
        that computed faster than the peak proves the machine can, and raises the peak to it.

    Example:
      >>> tp = Throughput(4096, 6 * n_params, peak_flops=1e12, total_steps=1000)
      >>> tp.start(0); ...; stats = tp.report(step)
    """

    def __init__(
        self,
        tokens_per_step: int | Callable[[Any], int],
        flops_per_token: float,
        peak_flops: float | None,
        total_steps: int,
        probe=None,
    ):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.total_steps = total_steps
        self.probe = probe
        self._t0: float | None = None
        self._step0 = 0
        self._tokens = 0

    def start(self, step: int) -> None:
        """Starts the clock at `step` (call after the first, compiling, step)."""
        self._t0 = time.perf_counter()
        self._step0 = step
        self._tokens = 0

    def add(self, batch) -> None:
        """Counts a step's batch (its tokens, where `tokens_per_step` is a function of the batch)."""
        if callable(self.tokens_per_step):
            self._tokens += int(self.tokens_per_step(batch))

    def report(self, step: int) -> dict[str, float | str]:
        """Throughput since the last call; restarts the window."""
        if self._t0 is None:
            self.start(step)
            return {}
        now = time.perf_counter()
        steps = step - self._step0
        dt = max(now - self._t0, 1e-9)
        self._t0, self._step0 = now, step
        tokens, self._tokens = self._tokens, 0
        if steps <= 0:
            return {}
        tokens_per_s = (tokens if callable(self.tokens_per_step) else steps * self.tokens_per_step) / dt
        out: dict[str, float | str] = {M.TOKENS_PER_S: tokens_per_s, M.STEP_TIME_S: dt / steps}
        if self.peak_flops:
            achieved = tokens_per_s * self.flops_per_token
            self.peak_flops = max(self.peak_flops, achieved)  # what the machine just did, it can do
            out[M.MFU] = achieved / self.peak_flops
        out[M.ETA] = format_eta((self.total_steps - step) * dt / steps)
        if self.probe is not None and self.peak_flops:
            self.peak_flops = max(self.peak_flops, self.probe())
            self._t0 = time.perf_counter()  # the probe's time is no step's
        return out


# Dense bf16 peak FLOP/s per device (NVIDIA data sheets), by device-name fragment; the first match
# wins, so the PCIe and NVL boards of the H100 come before its SXM one ("NVIDIA H100 80GB HBM3").
_GPU_PEAKS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "V100": 125e12,
}


def peak_flops(device: torch.device | str) -> float | None:
    """Known peak FLOP/s of one accelerator (bf16 dense), or None when unknown (e.g. CPU).

    Args:
      device: a torch.device or its name (e.g. "cuda:0").

    Returns:
      The data sheet's dense bf16 FLOP/s, or None.

    Example:
      >>> peak_flops("cuda")  # 9.89e14 on an H100 SXM
    """
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for frag, peak in _GPU_PEAKS.items():
            if frag in name:
                return peak
    return None


def measure_peak_flops(device: torch.device | str, dtype: torch.dtype = torch.float32, seconds: float = 1.0) -> float:
    """Measured matmul FLOP/s on `device`: the practical peak MFU is reported against where no
    published peak applies (CPUs).

    A 2048 x 2048 matmul, best of repeated timings over ~`seconds`: large enough to reach the BLAS
    library's full rate (a 512 x 512 one ran at 113 GFLOP/s where 2048 reached 195 on the same CPU,
    which once made the run print an MFU of 110.9%).

    Args:
      device: where to measure (a torch.device or its name, e.g. "cpu").
      dtype: matmul dtype.
      seconds: time budget (the best of the repetitions inside it is kept).

    Returns:
      FLOP/s.

    Example:
      >>> measure_peak_flops("cpu")  # e.g. 1.9e11
    """
    device = torch.device(device)
    n = 2048 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(0))
    b = a.t().contiguous()  # (global RNG untouched: a probe during a run changes no draw)
    a @ b  # warm-up
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
    return best
