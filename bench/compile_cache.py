"""Compile warm start: time to first step of the main job with an empty vs a filled compile cache.

    python bench/compile_cache.py [--variants default,tiny] [--steps 4]

For each config variant it runs `python -m functrain.main --config=configs/gpt.py[:variant]` in
subprocesses (through a small wrapper that calls `functrain.main.run()` and, at exit, prints the
compile-cache counters and torch.compile's phase times), each with a fresh workdir and the same
pre-tokenized data cache, `--config.steps=<steps> --config.stop_at=2` (so no eval or sampling is
compiled or timed after the first step), and reads the "time to first step" line:

  cold             empty cache dir (<workdir>/compile_cache, the "workdir" mode)
  warm             another fresh workdir, the cold run's cache dir (the "user" mode / a path)
  restart (copy)   the cold run's workdir copied to another path and restarted there (resumes at
                   step 2, restores the checkpoint): the "workdir" mode's portable warm start
  mega-cache only  fresh workdir, empty cache dir, but `torch.compiler.load_cache_artifacts` of what
                   `save_cache_artifacts` gave at the end of the cold run (torch's portable cache)

"dynamo trace" is dynamo's bytecode tracing of the step (`bytecode_tracing`); "AOT+inductor" is
the backend (`OutputGraph.call_user_compiler`: AOTAutograd + inductor on a miss, cache lookup and
load on a hit); both summed over the compiled graphs of the process (here: the train step only).
Before `config.compile_cache` exists, TORCHINDUCTOR_CACHE_DIR picks the directory (what the "user"
mode honors); with it, the workdir runs also pass `--config.compile_cache=workdir`.

Measured: docs/results.md ("bench/compile_cache.py").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs the main job as `python -m functrain.main` would, then reports counters and phase times.
_WRAPPER = r"""
import atexit, json, sys
spec = json.loads(sys.argv.pop(1))
if spec.get("load_mega"):
    import torch
    from functrain.compiler import cache as compile_cache
    compile_cache.setup("user")  # into the ISA-keyed directory the run will read (not its parent)
    with open(spec["load_mega"], "rb") as f:
        torch.compiler.load_cache_artifacts(f.read())

def _report():
    import torch
    from torch._dynamo.utils import compilation_time_metrics
    from functrain.compiler import cache as compile_cache
    if spec.get("save_mega"):
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            with open(spec["save_mega"], "wb") as f:
                f.write(saved[0])
    times = {k: sum(v) for k, v in compilation_time_metrics.items()}
    print("BENCH " + json.dumps({"stats": compile_cache.stats(), "times": times}), flush=True)

atexit.register(_report)
sys.argv[0] = "functrain.main"
from functrain.trainer.main import run
run()
"""

_FORCE_OFF = ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCHINDUCTOR_FORCE_DISABLE_CACHES")


def _has_config_key() -> bool:
    """Whether configs/gpt.py already has `compile_cache` (the trainer calls compile_cache.setup)."""
    sys.path.insert(0, REPO)
    try:
        from configs import gpt

        return "compile_cache" in gpt.get_config()
    finally:
        sys.path.remove(REPO)


def _run(config: str, workdir: str, cache: str, extra: list[str], spec: dict | None = None) -> dict:
    """Runs the main job once; returns its time to first step, wall time, counters and phase times."""
    env = {k: v for k, v in os.environ.items() if k not in _FORCE_OFF}
    env.update(PYTHONPATH=REPO, TORCHINDUCTOR_CACHE_DIR=cache)
    cmd = [sys.executable, "-c", _WRAPPER, json.dumps(spec or {}), f"--config={config}", f"--workdir={workdir}", *extra]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd[3:])} failed:\n{out.stderr[-3000:]}")
    ttfs = re.search(r"time to first step ([\d.]+)s", out.stdout)
    bench = re.search(r"^BENCH (.*)$", out.stdout, re.M)
    if not ttfs or not bench:
        raise SystemExit(f"unexpected output:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    result = json.loads(bench.group(1))
    result.update(ttfs=float(ttfs.group(1)), wall=wall)
    return result


def _size_mb(path: str) -> float:
    """Total size of the files under `path`, in MiB."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 2**20


def _variant(variant: str, steps: int, tmp: str, wired: bool) -> list[tuple[str, dict]]:
    """The four runs of one config variant (see the module docstring)."""
    config = "configs/gpt.py" + (f":{variant}" if variant != "default" else "")
    root = os.path.join(tmp, variant)
    data = os.path.join(root, "data")
    common = [f"--config.data.cache_dir={data}", "--config.eval_every=100000", "--config.checkpoint.every=100000"]
    base = common + [f"--config.steps={steps}", "--config.stop_at=2"]
    workdir_mode = ["--config.compile_cache=workdir"] if wired else []
    # Tokenize the data once, uncompiled, so no timed run pays for it.
    _run(
        config,
        os.path.join(root, "prep"),
        os.path.join(root, "prep-cache"),
        common + ["--config.compile=False", "--config.steps=1", "--config.sample.max_new_tokens=1"],
    )
    cold_dir = os.path.join(root, "cold")
    cache = os.path.join(cold_dir, "compile_cache")
    mega = os.path.join(root, "mega.bin")
    rows = [("cold", _run(config, cold_dir, cache, base + workdir_mode, {"save_mega": mega}))]
    size = _size_mb(cache)
    rows.append(("warm", _run(config, os.path.join(root, "warm"), cache, base)))
    moved = os.path.join(root, "elsewhere", "restarted")
    shutil.copytree(cold_dir, moved)
    restart = (
        common + [f"--config.steps={steps}", "--config.stop_at=3"] + workdir_mode
    )  # resumes from the step-2 checkpoint
    rows.append(("restart (copy)", _run(config, moved, os.path.join(moved, "compile_cache"), restart)))
    rows.append(
        (
            "mega-cache only",
            _run(config, os.path.join(root, "mega"), os.path.join(root, "mega-cache"), base, {"load_mega": mega}),
        )
    )
    print(
        f"{variant}: cache dir after the cold run {size:.1f} MiB; mega-cache artifacts "
        f"{os.path.getsize(mega) / 2**20:.1f} MiB",
        flush=True,
    )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="default", help="comma-separated: default, tiny")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    wired = _has_config_key()
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            for name, r in _variant(variant, args.steps, tmp, wired):
                table.append((variant, name, r))
                print(f"  {variant} {name}: time to first step {r['ttfs']:.1f}s", flush=True)
    print(
        "| variant | case | time to first step s | vs cold | process wall s | dynamo trace s | "
        "AOT+inductor s | FX hit/miss | AOT hit/miss |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    cold = {}
    for variant, name, r in table:
        cold.setdefault(variant, r["ttfs"])
        s, t = r["stats"], r["times"]
        print(
            f"| {variant} | {name} | {r['ttfs']:.1f} | {r['ttfs'] / cold[variant]:.2f}x | {r['wall']:.1f} | "
            f"{t.get('bytecode_tracing', 0):.1f} | {t.get('OutputGraph.call_user_compiler', 0):.1f} | "
            f"{s['fxgraph_hit']}/{s['fxgraph_miss']} | {s['aot_hit']}/{s['aot_miss']} |"
        )
    for variant in cold:
        warm = next(r["ttfs"] for v, n, r in table if v == variant and n == "warm")
        print(f"{variant}: cold / warm time to first step = {cold[variant] / warm:.2f}x")


if __name__ == "__main__":
    main()
