"""One rank of the data-parallel BatchNorm runs (launched by tests/test_own_module.py).

    python tests/_model_state_worker.py <outdir>

Trains the `_bn_model` CNN on FSDP-sharded params over every rank (dp_shard), each rank on its own
rows of the same global batches, under each `model_state_sync` ("broadcast", "mean"), eagerly and
compiled (aot_eager: the collectives traced into the step's graph), and writes each run's losses
and final model state to <outdir>/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist
from _bn_model import batches, loss_fn_for, model, optimizer

import functrain as ft
from functrain import parallel

STEPS = 10


def run(ctx, sync: str, compiled: bool) -> dict:
    template = model(0)
    state = parallel.shard_state(ft.init_state(template, optimizer()), ctx.mesh)
    step = ft.make_train_step(
        loss_fn_for(template),
        optimizer(),
        compile=compiled,
        model_state_sync=sync,
        compile_options={"backend": "aot_eager"} if compiled else None,
    )
    losses = []
    for b in batches(STEPS):
        state, m = step(state, parallel.split_batch(b, ctx.dp_rank, ctx.dp_world))
        losses.append(float(m["loss"]))
    return {"losses": losses, "model_state": {k: v.tolist() for k, v in state.model_state.items()}}


def main(outdir: str) -> None:
    ctx = parallel.setup({"dp_shard": -1})
    results = {
        f"{sync}-{'compiled' if compiled else 'eager'}": run(ctx, sync, compiled)
        for sync in ("broadcast", "mean")
        for compiled in (False, True)
    }
    with open(os.path.join(outdir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    parallel.teardown()


if __name__ == "__main__":
    main(sys.argv[1])
