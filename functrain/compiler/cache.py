"""Compile warm start: where torch.compile keeps its on-disk caches, and how often they were hit.

Internals: docs/internals.md "functrain.compiler.cache".

Example:
    >>> from functrain.compiler import cache as compile_cache
    >>> cache_dir = compile_cache.setup(config.compile_cache, workdir)  # before torch.compile
    >>> compile_cache.start_isa_probe()  # CPU kernels ahead: probe the vector ISA while Dynamo traces
    >>> before = compile_cache.stats()
    >>> ...  # build and run the compiled step
    >>> print(compile_cache.report(cache_dir, since=before))
    compile cache /home/me/.cache/functrain/inductor/avx512: 2 hits, 0 misses (FX graph 1/0, AOTAutograd 1/0)
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

__all__ = [
    "MODES",
    "setup",
    "saved_steps_dir",
    "start_isa_probe",
    "probe_started",
    "wait_for_isa_probe",
    "stats",
    "report",
]

MODES = ("user", "workdir", "off")
"""The named modes of `setup`; anything else must be a path (containing "/" or starting with "~")."""

_ENV = "TORCHINDUCTOR_CACHE_DIR"
_set_by_setup: str | None = None  # the value `setup` last put into the environment
_set_by_user: str | None = None  # the user's own value that `setup` replaced, if any
_steps_dir: Path | None = None  # where compiled steps are saved whole (`saved_steps`); None: not saved

# counters["inductor"] / counters["aot_autograd"] keys -> the names `stats` gives them.
_COUNTERS = {
    ("inductor", "fxgraph_cache_hit"): "fxgraph_hit",
    ("inductor", "fxgraph_cache_miss"): "fxgraph_miss",
    ("inductor", "fxgraph_cache_bypass"): "fxgraph_bypass",
    ("aot_autograd", "autograd_cache_hit"): "aot_hit",
    ("aot_autograd", "autograd_cache_miss"): "aot_miss",
    ("aot_autograd", "autograd_cache_bypass"): "aot_bypass",
}


def setup(mode: str, workdir: str | os.PathLike | None = None) -> Path:
    """Points torch.compile's on-disk caches at the directory `mode` names and turns them on.

    Sets `TORCHINDUCTOR_CACHE_DIR` (process-wide, inherited by compile workers and child
    processes), enables inductor's FX graph cache and the AOTAutograd cache, and (unless "off")
    saves compiled steps whole under `<cache dir>/steps` (`compiler.saved_steps`). Call it before
    the first `torch.compile`d call; graphs already compiled in this process are not affected.

    Args:
      mode: "user", "workdir", "off" (see the module docstring), or a directory path (a string
        containing "/" or starting with "~", e.g. "./cache" or "/scratch/inductor").
      workdir: the run directory; required for mode "workdir", ignored otherwise.

    Returns:
      The cache directory (absolute; created if missing): the mode's directory / the CPU ISA.

    Raises:
      ValueError: `mode` is not one of the modes nor a path, or "workdir" without a workdir.

    Example:
      >>> setup("workdir", "runs/gpt")
      PosixPath('/home/me/functrain/runs/gpt/compile_cache/avx512')
    """
    global _set_by_setup, _set_by_user, _steps_dir
    path, isa = _resolve(mode, workdir), _isa()
    if path.name != isa:  # (a child process inherits the keyed directory: not keyed twice)
        path = path / isa
    path.mkdir(parents=True, exist_ok=True)
    previous = os.environ.get(_ENV)
    if previous and previous != _set_by_setup:
        _set_by_user = previous
    os.environ[_ENV] = _set_by_setup = str(path)
    if previous is not None and os.path.abspath(previous) != str(path) and "torch._inductor.utils" in sys.modules:
        from torch._inductor.utils import clear_caches

        clear_caches()  # in-memory caches that remember the previous directory
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    _steps_dir = None if mode == "off" else path / "steps"
    return path


def saved_steps_dir() -> Path | None:
    """Where compiled steps are saved whole (`compiler.saved_steps`): `<cache dir>/steps` after `setup`.

    Returns:
      The directory, or None before `setup` or after `setup("off")` (steps are then not saved).

    Example:
      >>> setup("workdir", "runs/gpt"); saved_steps_dir()
      PosixPath('/home/me/functrain/runs/gpt/compile_cache/avx512/steps')
    """
    return _steps_dir


def start_isa_probe() -> threading.Thread:
    """Starts inductor's CPU vector-ISA probe in a daemon thread and returns the thread.

    The probe (`torch._inductor.cpu_vec_isa.pick_vec_isa`) compiles and loads one test program per
    candidate ISA the first time a process generates CPU kernels; its answer is memoized for the
    process. Started right after `setup` (it writes its test programs into the cache directory), it
    overlaps Dynamo's trace of the step instead of stalling inductor's code generation. Every graph
    `compiler.graph` compiles waits for it before inductor lowers the graph (`wait_for_isa_probe`).
    Its g++ runs take a core: time nothing beside it (the loop measures its MFU denominator first).

    A process starts it once: a later call returns the first call's thread (the trainer starts it
    before building its step, a compiled step at its first call on CPU tensors).

    Returns:
      The started thread (join it to wait for the probe, e.g. in a test).

    Example:
      >>> compile_cache.setup("user"); compile_cache.start_isa_probe()
      <Thread(functrain-isa-probe, started daemon ...)>
    """
    with _PROBE_LOCK:
        if not _PROBE:
            _PROBE.append(threading.Thread(target=_probe_isa, name="functrain-isa-probe", daemon=True))
            _PROBE[0].start()
        return _PROBE[0]


_PROBE: list[threading.Thread] = []  # the process's probe, once started
_PROBE_LOCK = threading.Lock()


def probe_started() -> bool:
    """Whether this process started the vector-ISA probe (`start_isa_probe`)."""
    return bool(_PROBE)


def wait_for_isa_probe() -> None:
    """Blocks until the vector-ISA probe this process started is done (returns at once when none was started).

    Inductor asks for the vector ISA when it generates and compiles kernels. Asked while the probe
    thread still ran, it probed again beside it, and the two test builds raced: that compile's kernels
    got other compiler flags than the probe's answer (seen: a compile="blocks" step's stage kernels,
    built again by the next process, whose cache keys hold the flags). `compiler.graph` makes every
    compile wait here before lowering (a pass), after Dynamo's trace and AOTAutograd, which the probe
    still overlaps; a saved step waits before it loads (its kernels' keys hold the flags too).

    Example:
      >>> compile_cache.start_isa_probe(); compile_cache.wait_for_isa_probe()
    """
    if _PROBE:
        _PROBE[0].join()


def _torch_default() -> str | None:
    """The directory torch writes into TORCHINDUCTOR_CACHE_DIR when it is unset (import of Dynamo)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch layout: then only setup's own value is told apart
        return None
    return default_cache_dir()


def _probe_isa() -> None:
    """Runs (and so memoizes) inductor's vector-ISA probe; a failure is left for inductor to meet."""
    try:
        from torch._inductor import cpu_vec_isa

        cpu_vec_isa.pick_vec_isa()
    except Exception:  # the compile itself reports it, with inductor's own message
        pass


def _isa() -> str:
    """The vector ISA compiled CPU kernels target, as a directory name (e.g. "avx512")."""
    import torch

    return torch.backends.cpu.get_cpu_capability().lower()


def _resolve(mode: str, workdir) -> Path:
    """The absolute cache directory for `mode` (validates it; creates nothing but "off"'s temp dir)."""
    if not (isinstance(mode, str) and (mode in MODES or "/" in mode or mode.startswith("~"))):
        raise ValueError(
            f"compile_cache={mode!r} is not known; use 'user' (a per-user cache dir), 'workdir' "
            "(<workdir>/compile_cache), 'off' (always compile cold) or a directory path containing '/' "
            "(e.g. './compile_cache')"
        )
    if mode == "user":
        env = os.environ.get(_ENV)
        if env and env not in (_set_by_setup, _torch_default()):  # the user's, not setup's nor torch's
            return Path(env).expanduser().absolute()
        if env and _set_by_user:  # an earlier setup() replaced the user's dir: back to it
            return Path(_set_by_user).expanduser().absolute()
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base, "functrain", "inductor").absolute()
    if mode == "workdir":
        if workdir is None:
            raise ValueError("compile_cache='workdir' needs the run's workdir; pass workdir=...")
        return (Path(workdir).expanduser() / "compile_cache").absolute()
    if mode == "off":
        path = tempfile.mkdtemp(prefix="functrain-compile-cache-")
        atexit.register(shutil.rmtree, path, True)
        return Path(path)
    return Path(mode).expanduser().absolute()


def stats() -> dict[str, int]:
    """This process's compile-cache counters so far (cumulative since the process started).

    Returns:
      {"fxgraph_hit", "fxgraph_miss", "fxgraph_bypass", "aot_hit", "aot_miss", "aot_bypass"}: how
      many graphs inductor's FX graph cache and the AOTAutograd cache served (hit), compiled and
      stored (miss), or could not cache (bypass). A warm graph usually counts one AOTAutograd hit and
      one FX graph hit. Plus "step_hit" and "step_miss": steps loaded whole, or compiled and saved
      (`compiler.saved_steps`); a step loaded whole counts no graph hit.

    Example:
      >>> before = stats(); step(state, batch); stats()["aot_miss"] - before["aot_miss"]
      0
    """
    from torch._dynamo.utils import counters

    from functrain.compiler import saved_steps

    counts = {name: int(counters[group][key]) for (group, key), name in _COUNTERS.items()}
    return {**counts, **{f"step_{k}": v for k, v in saved_steps.stats().items()}}


def report(cache_dir: str | os.PathLike | None = None, since: dict[str, int] | None = None) -> str:
    """One console line with the cache hits and misses (of this process, or since `since`).

    Args:
      cache_dir: the directory `setup` returned (default: the current `TORCHINDUCTOR_CACHE_DIR`).
      since: an earlier `stats()` to subtract (e.g. taken at the start of `train`).

    Returns:
      e.g. "compile cache /runs/gpt/compile_cache: 2 hits, 0 misses (FX graph 1/0, AOTAutograd
      1/0)", with "N bypassed" when some graph could not be cached and a note when the environment
      disabled the caches.

    Example:
      >>> print(report(cache_dir))
    """
    now = stats()
    s = {k: v - (since or {}).get(k, 0) for k, v in now.items()}
    from functrain.compiler import saved_steps

    steps = {k: v - (since or {}).get(f"step_{k}", 0) for k, v in saved_steps.stats().items()}
    hits = s["fxgraph_hit"] + s["aot_hit"] + steps["hit"]
    misses = s["fxgraph_miss"] + s["aot_miss"] + steps["miss"]
    where = cache_dir if cache_dir is not None else os.environ.get(_ENV, "(torch's default)")
    line = (
        f"compile cache {where}: {hits} hits, {misses} misses "
        f"(FX graph {s['fxgraph_hit']}/{s['fxgraph_miss']}, AOTAutograd {s['aot_hit']}/{s['aot_miss']}"
    )
    if steps["hit"] or steps["miss"]:
        line += f", whole steps {steps['hit']}/{steps['miss']}"
    bypassed = s["fxgraph_bypass"] + s["aot_bypass"]
    if bypassed:
        line += f"; {bypassed} bypassed"
    line += ")"
    off = _disabled()
    if off:
        line += f"; disabled by {off}"
    return line


def _disabled() -> str:
    """The setting that turned a cache off despite `setup` ("" when both are on)."""
    import torch._functorch.config
    import torch._inductor.config

    if torch._inductor.config.force_disable_caches:
        return "force_disable_caches (TORCHINDUCTOR_FORCE_DISABLE_CACHES)"
    off = []
    if not torch._inductor.config.fx_graph_cache:
        off.append("TORCHINDUCTOR_FX_GRAPH_CACHE=0")
    if not torch._functorch.config.enable_autograd_cache:
        off.append("TORCHINDUCTOR_AUTOGRAD_CACHE=0")
    return ", ".join(off)
