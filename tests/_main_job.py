"""The command that starts the main job in a test: one process, or `nproc` ranks under torchrun."""

from __future__ import annotations

import sys


def command(nproc: int = 1) -> list[str]:
    """`python -m functrain.main` (under `torch.distributed.run --standalone` when nproc > 1): the args follow."""
    if nproc <= 1:
        return [sys.executable, "-m", "functrain.main"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*torchrun, "-m", "functrain.main"]
