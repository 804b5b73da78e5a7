"""The single-process routes the config can reach, compiled, against the eager step: route
("default": compile="step" with a plain loss, its forward one graph and autograd's backward between it and
the update, `functrain.step.grads.grads_by_autograd`; "step": a staged loss, the loss and its gradients one graph;
both with the update a graph per block kind; "blocks": a graph per stage kind) x precision (fp32, bf16,
fp16 with loss scaling) x gradient accumulation (1, 2 unrolled microbatches): every value pair in 9
cells, the whole product under `pytest -m exhaustive`. The sharded routes (FSDP,
TP) are the compiled2 and matrix2 suites of tests/test_parallel_dist.py.

The compiled side uses the "aot_eager" backend: Dynamo and AOTAutograd trace the same graphs the
step compiles (one graph, or the blocks' graphs), with no code generation, so every cell costs
seconds; inductor itself runs in tests/test_step.py, tests/test_compile_blocks.py and
tests/test_precision.py. Tolerances come from the compute dtype (tests/_tol.py).
"""

from __future__ import annotations

import itertools

import _tol
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from functrain import init_state, make_train_step, optim
from functrain.models.gpt import make_loss_fn as make_gpt_loss_fn
from functrain.step import grads as grads_lib

pytestmark = pytest.mark.numeric

LR, MOMENTUM, STEPS = 0.05, 0.9, 3
# default: the loss's forward, step: the loss and its grads; then per kind of update group (the blocks', the rest's)
# the grads' squared norms and the update, and the grad norm. blocks, remat none: prepare, embedding, block, head,
# the blocks' update, the rest's
GRAPHS = {"default": 6, "step": 6, "blocks": 6}


def _opt():
    """Clipping + SGD with momentum: trajectories comparable to rounding (tests/_tol.py)."""
    return optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(LR, momentum=MOMENTUM))


def _run(model, data, *, route, precision, accum):
    """Per-step metrics and the final state of `STEPS` steps (route None: eager, the staged loss)."""
    loss_fn = make_gpt_loss_fn(model, remat="none", staged=route != "default")
    compile = {None: False, "default": "step"}.get(route, route)
    step = make_train_step(
        loss_fn,
        _opt(),
        compile=compile,
        precision=precision,
        accum_steps=accum,
        compile_options={"backend": "aot_eager"} if compile else None,
    )
    state, hist = init_state(model, _opt(), seed=0), []
    for b in data:
        state, m = step(state, b)
        hist.append({k: float(v) for k, v in m.items()})
    return hist, state


UNITS, PRECISIONS, ACCUMS = ("default", "step", "blocks"), ("fp32", "bf16", "fp16"), (1, 2)
# Every value pair of the three axes in 9 cells (the fewest: route x precision alone has 9 pairs);
# the full product (18 cells) under `pytest -m exhaustive`.
PAIRWISE = [
    ("default", "fp32", 2),
    ("default", "bf16", 1),
    ("default", "fp16", 2),
    ("step", "fp32", 1),
    ("step", "bf16", 2),
    ("step", "fp16", 1),
    ("blocks", "fp32", 2),
    ("blocks", "bf16", 1),
    ("blocks", "fp16", 2),
]
CELLS = PAIRWISE + [
    pytest.param(*c, marks=pytest.mark.exhaustive)
    for c in itertools.product(UNITS, PRECISIONS, ACCUMS)
    if c not in PAIRWISE
]


def test_the_cells_hold_every_value_pair():
    for (i, xs), (j, ys) in itertools.combinations(enumerate((UNITS, PRECISIONS, ACCUMS)), 2):
        missing = set(itertools.product(xs, ys)) - {(c[i], c[j]) for c in PAIRWISE}
        assert not missing, (i, j, missing)


@pytest.mark.parametrize(
    "unit,precision,accum", CELLS, ids=[f"{u}-{p}-accum{a}" for u, p, a in (getattr(c, "values", c) for c in CELLS)]
)
def test_compiled_route_equals_eager(tiny_gpt, batches, monkeypatch, unit, precision, accum):
    model = tiny_gpt(n_layer=2, n_embd=32, block_size=16)
    data = batches(model.cfg, STEPS, batch_size=4)
    want, w_state = _run(model, data, route=None, precision=precision, accum=accum)
    torch._dynamo.reset()
    counters.clear()
    forwards: list = []  # the default route's steps: the compiled forward, then autograd
    real = grads_lib.grads_by_autograd
    monkeypatch.setattr(grads_lib, "grads_by_autograd", lambda *a: forwards.append(1) or real(*a))
    got, g_state = _run(model, data, route=unit, precision=precision, accum=accum)
    assert len(forwards) == (STEPS if unit == "default" else 0)
    assert counters["stats"]["unique_graphs"] == GRAPHS[unit], dict(counters["stats"])
    assert not counters["recompiles"] and not counters["graph_break"], (
        dict(counters["recompiles"]),
        dict(counters["graph_break"]),
    )
    n = 4 * model.cfg.block_size * 4 * model.cfg.n_embd  # tokens x the widest matmul
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    # fp32: reduction-order noise; bf16/fp16: one rounding of each op's output in the compute dtype
    # (traced decompositions may round an intermediate where eager kept it wide), growing per step
    per_step = _tol.rtol(n) if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    for i, (g, w) in enumerate(zip(got, want)):
        for k in ("loss", "grad_norm"):
            _tol.assert_close(torch.tensor(g[k]), torch.tensor(w[k]), per_step * (i + 1), msg=f"step {i} {k}")
        assert g.get("skipped", 0.0) == w.get("skipped", 0.0) == 0.0
    atol = 2 * STEPS * _tol.sgd_gain(LR, MOMENTUM) * per_step
    _tol.assert_close(g_state.params, w_state.params, atol, absolute=True, msg="params")
    assert {p.dtype for p in g_state.params.values()} == {torch.float32}
