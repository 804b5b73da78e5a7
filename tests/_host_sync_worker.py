"""One rank of the no-host-sync tests (launched by tests/test_host_sync.py through _dist_launch).

    python tests/_host_sync_worker.py <outdir> <compile 0|1>

Runs the tiny GPT job for 12 steps (log every 4, a checkpoint every 6) counting, per step, the
tensor values the main thread reads into Python; then checks the preemption flag's agreement with a
flag raised on the last rank only. Writes <outdir>/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from _host_reads import Reads, counting

from functrain import parallel
from functrain.trainer import loop, preemption
from functrain.trainer import optimizer as trainer_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "configs"))
import gpt as gpt_config  # noqa: E402

from functrain.models.gpt import task as gpt_task  # noqa: E402


class StepLabel(loop.Hook):
    """Labels the reads made from this step's `before` to its `after` with the step's number; with
    `cuda_quiet`, a steady-state step (not in `busy`) also runs under
    `torch.cuda.set_sync_debug_mode("error")`: anything that waits for the GPU raises."""

    every = 1

    def __init__(self, reads, cuda_quiet=False, busy=()):
        self.reads, self.cuda_quiet, self.busy = reads, cuda_quiet, set(busy)

    def before(self, step):
        self.reads.label = step + 1
        if self.cuda_quiet and step > 0 and step + 1 not in self.busy:
            torch.cuda.set_sync_debug_mode("error")

    def after(self, info):
        self.reads.label = None
        if self.cuda_quiet:
            torch.cuda.set_sync_debug_mode("default")


def tiny_config(workdir: Path, compile: bool):
    """The tiny job: 12 steps, logs at 4, 8, 12, checkpoints at 6, 12, no evaluation until the end."""
    c = gpt_config.get_config("tiny")
    c.steps, c.log_every, c.eval_every, c.checkpoint.every = 12, 4, 1000, 6
    c.compile, c.tensorboard = compile, False
    c.sample.max_new_tokens = 2
    c.data.cache_dir = str(workdir / "data")
    return c


def count_reads(workdir: Path, compile: bool, then=None, cuda_quiet=False):
    """({step: reads}, {step: where the first read was}) of a tiny run (steps without reads left
    out); `then()`, if given, runs afterwards on the same process group. `cuda_quiet`: on a GPU,
    any sync in a steady-state step raises (see `StepLabel`)."""
    c = tiny_config(workdir, compile)
    if cuda_quiet:
        c.device = "cuda"
    busy = {s for s in range(1, c.steps + 1) if s % c.log_every == 0 or s % c.checkpoint.every == 0}
    reads = Reads()
    with parallel.setup(c.mesh) as ctx:
        task = gpt_task.build(c, ctx, workdir / "run")
        opt = trainer_optimizer.from_config(c.optim, c.steps)
        with counting(reads):
            loop.run(
                task, opt, c, workdir / "run", ctx, hooks=[StepLabel(reads, cuda_quiet, busy)], print_fn=lambda *a: None
            )
        if then is not None:
            then()
    return {int(k): v for k, v in reads.counts.items()}, {int(k): v for k, v in reads.where.items()}


def preemption_checks(raise_at: int, checks: int) -> list[bool]:
    """`requested()` at each of `checks` checks, the last rank raising its flag before check `raise_at`."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    seen = []
    with preemption.PreemptionFlag() as flag:
        for i in range(checks):
            if i == raise_at and rank == world - 1:
                flag._handle(signal.SIGTERM, None)
            seen.append(flag.requested())
    return seen


def main():
    out, compile = Path(sys.argv[1]), sys.argv[2] == "1"
    rank = int(os.environ.get("RANK", 0))
    flag = []
    counts, where = count_reads(out, compile, then=lambda: flag.extend(preemption_checks(raise_at=3, checks=6)))
    result = {"counts": counts, "where": where, "flag": flag}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
