"""Three runs of one train step over the same batches (eager, eager over 2 microbatches, compiled with aot_eager),
the compiled one checked to be one graph that never recompiles (not a test)."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from functrain import init_state

ROUTES = {
    "eager": {"compile": False},
    "accum": {"compile": False, "accum_steps": 2},
    "compiled": {"compile_options": {"backend": "aot_eager"}},
}


def three_routes(make_step, params: dict, frozen_of, data: list) -> dict:
    """{route: (final state, each step's metrics)}; `make_step(**kwargs) -> (step, optimizer)`, `frozen_of(params)`
    each run's own frozen params."""
    runs = {}
    for name, kwargs in ROUTES.items():
        step, opt = make_step(**kwargs)
        state = init_state(params, opt, frozen=frozen_of(params))
        counters.clear()
        metrics = []
        with torch._dynamo.config.patch(error_on_recompile=True):
            for batch in data:
                state, m = step(state, batch)
                metrics.append({k: v.clone() for k, v in m.items()})
        if name == "compiled":
            assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"], dict(counters["stats"])
        runs[name] = state, metrics
    return runs
