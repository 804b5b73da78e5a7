"""Time to first step of a restart: async restore (overlapped with compilation) vs blocking restore.

Runs the main job three times in subprocesses on one model: once to write a checkpoint, then a
restart with `checkpoint.async_restore=True` and one with `False`, each with a fresh, empty inductor
cache (so both compile cold), and prints their "time to first step" side by side.

    python bench/restart.py [--n_layer 8 --n_embd 512]   # ~25M params, ~300 MB of state with Adam
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(workdir: str, extra: list[str], cache: str) -> str:
    """Runs the main job; returns its stdout."""
    env = dict(os.environ, PYTHONPATH=REPO, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="0")
    out = subprocess.run(
        [sys.executable, "-m", "functrain.main", "--config=configs/gpt.py", f"--workdir={workdir}", *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return out.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n_layer", type=int, default=8)
    p.add_argument("--n_embd", type=int, default=512)
    args = p.parse_args()
    base = [
        f"--config.model.n_layer={args.n_layer}",
        f"--config.model.n_embd={args.n_embd}",
        "--config.model.n_head=8",
        "--config.batch_size=8",
        "--config.log_every=1",
        "--config.eval_every=1000",
        "--config.eval_batches=1",
        "--config.sample.max_new_tokens=1",
        "--config.checkpoint.every=1",
        "--config.tensorboard=False",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        work = os.path.join(tmp, "run")
        _run(work, base + ["--config.steps=1", "--config.compile=False"], os.path.join(tmp, "c0"))
        size = sum(
            os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(work, "checkpoints")) for f in fs
        )
        rows = []
        for i, mode in enumerate(["True", "False"]):
            w = os.path.join(tmp, f"restart{i}")
            subprocess.run(["cp", "-r", work, w], check=True)
            out = _run(
                w,
                base + ["--config.steps=2", f"--config.checkpoint.async_restore={mode}"],
                os.path.join(tmp, f"cache{i}"),
            )
            ttfs = float(re.search(r"time to first step ([\d.]+)s", out).group(1))
            restore = float(re.search(r"restored checkpoint step 1 in ([\d.]+)s", out).group(1))
            rows.append(("async (overlapped)" if mode == "True" else "blocking", restore, ttfs))
    print(f"checkpoint on disk: {size / 2**20:.0f} MiB")
    print("| restore mode | restore phase s (async: with the overlapped compile) | time to first step s |")
    for name, restore, ttfs in rows:
        print(f"| {name} | {restore:.1f} | {ttfs:.1f} |")
    print(f"ratio blocking / async: {rows[1][2] / rows[0][2]:.2f}x")


if __name__ == "__main__":
    main()
