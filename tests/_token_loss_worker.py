"""One of 2 gloo ranks of the token-weighted loss test (tests/test_token_loss.py).

Usage: python tests/_token_loss_worker.py <outdir>
Each scenario takes one SGD step at lr 1 on the shared batch (`_token_loss.batch`) and writes the
gradient (the params' move), the loss and the target count to <outdir>/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys

import _token_loss as P
import torch

from functrain import init_state, make_train_step, parallel, tree
from functrain.models import gpt
from functrain.parallel import pipeline

# name -> (mesh, rows per microbatch on a rank, staged loss, context-parallel)
SCENARIOS = {
    "dp_accum4": ({"dp_shard": 2}, 1, False, False),
    "dp_accum2": ({"dp_shard": 2}, 2, False, False),
    "fsdp_staged_accum2": ({"dp_shard": 2}, 2, True, False),
    "cp_accum2": ({"dp_shard": 1, "cp": 2}, 4, True, True),
}


def one_step(mesh: dict, rows: int, staged: bool, cp: bool, batch=None) -> dict:
    """The scenario's gradient, loss and target count (gathered whole)."""
    ctx = parallel.setup(mesh, timeout_s=300)
    template = P.model()
    rules = parallel.default_rules(gpt.TP_RULES)
    model = template
    if cp:
        model = parallel.context.context_parallel(template, parallel.context.split_of(ctx.mesh))
    model = parallel.tensor_parallel(model, ctx.mesh, rules)
    state = parallel.shard_state(init_state(template, P.sgd()), ctx.mesh, rules)
    before = tree.clone(parallel.gather(state.params))
    local = parallel.split_batch(batch or P.batch(), ctx.dp_rank, ctx.dp_world)
    step = make_train_step(
        gpt.make_loss_fn(model, staged=staged),
        P.sgd(),
        accum_steps=local[0].shape[0] // rows,
        count_targets=P.COUNT,
        compile=False,
        donate=False,
    )
    state, metrics = step(state, local)
    after = parallel.gather(state.params)
    return {
        "grads": {k: (before[k] - after[k]).tolist() for k in before},
        "loss": float(metrics["loss"]),
        "targets": int(metrics["targets"]),
    }


def pipeline_step(batch=None) -> dict:
    """Two pipeline stages, 4 microbatches: this rank's stage's gradient, the loss and the count."""
    ctx = parallel.setup({"pp": 2}, timeout_s=300)
    template = P.model()
    params = dict(template.named_parameters())
    pipe = pipeline.place(gpt.make_loss_fn(template, staged=True), params, group=ctx.pp_group)
    state = init_state(pipe.params(params), P.sgd())
    before = tree.clone(state.params)
    step = pipeline.make_pipeline_step(pipe, P.sgd(), microbatches=4, count_targets=P.COUNT, donate=False)
    state, metrics = step(state, batch or P.batch())
    return {
        "grads": {k: (before[k] - state.params[k]).tolist() for k in before},
        "loss": float(metrics["loss"]),
        "targets": int(metrics["targets"]),
    }


def main(outdir: str) -> None:
    results = {name: one_step(*spec) for name, spec in SCENARIOS.items()}
    results["pp_micro4"] = pipeline_step()
    # packed rows (x, y, positions): the staged losses carry the document layout to every block
    results["packed_fsdp_staged_accum2"] = one_step({"dp_shard": 2}, 2, True, False, P.packed_batch())
    results["packed_pp_micro4"] = pipeline_step(P.packed_batch())
    rank = int(os.environ["RANK"])
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    parallel.teardown()


if __name__ == "__main__":
    torch.manual_seed(0)
    main(sys.argv[1])
