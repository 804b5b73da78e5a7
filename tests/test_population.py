"""Populations: K members in one vmapped step, each equal to its solo run; one graph compiled."""

from __future__ import annotations

import os
import subprocess
import sys

import optree
import pytest
import torch
from torch._dynamo.utils import counters

from functrain import init_state, make_train_step, optim, population, rng
from functrain.models import gpt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup(k=4, dropout=0.0, n_layer=2):
    # bias=False: Adam turns the rounding noise of (exactly) zero-gradient biases into full-size
    # steps (tests/_tol.py), so the 1e-5 comparison is made on the default GPT's bias-free blocks.
    cfg = gpt.GPTConfig(vocab_size=64, block_size=32, n_layer=n_layer, n_head=2, n_embd=32, bias=False, dropout=dropout)
    with torch.device("meta"):
        template = gpt.GPT(cfg)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.warmup_cosine(1e-2, 2, 20), weight_decay=0.1))
    lrs = [1e-2, 3e-3, 5e-3, 2e-2][:k]
    members = [
        optim.set_hyperparams(init_state(gpt.init_params(template, rng.key(s)), opt, seed=s), lr=lr)
        for s, lr in enumerate(lrs)
    ]
    return cfg, gpt.make_loss_fn(template), opt, members


def _batches(cfg, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def _max_diff(pop, members):
    return max(
        float((a - b).abs().max())
        for k, m in enumerate(members)
        for a, b in zip(optree.tree_leaves(population.member(pop, k).params), optree.tree_leaves(m.params))
    )


@pytest.mark.numeric
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_each_member_equals_its_solo_run_over_20_steps(dropout):
    cfg, loss_fn, opt, members = _setup(dropout=dropout)
    step = population.make_population_step(loss_fn, opt, compile=False, donate=False)
    solo = make_train_step(loss_fn, opt, compile=False, donate=False)
    pop = population.stack(members)
    lrs = []
    for batch in _batches(cfg, 20):
        pop, metrics = step(pop, batch)
        lrs.append(metrics["lr"])
        solo_metrics = []
        for i, m in enumerate(members):
            members[i], mm = solo(m, batch)
            solo_metrics.append(float(mm["loss"]))
        assert metrics["loss"].shape == (4,)
        torch.testing.assert_close(metrics["loss"], torch.tensor(solo_metrics), rtol=1e-5, atol=0)
    assert _max_diff(pop, members) <= 1e-5
    assert len({float(v) for v in lrs[4]}) == 4  # each member kept its own rate
    assert [int(s.step) for s in population.unstack(pop)] == [20] * 4


def test_per_member_batches_and_donation():
    cfg, loss_fn, opt, members = _setup(k=2)
    step = population.make_population_step(loss_fn, opt, compile=False, batch_axis=0)
    solo = make_train_step(loss_fn, opt, compile=False, donate=False)
    (a, b) = _batches(cfg, 2)
    pop = population.stack(members)
    ptr = optree.tree_leaves(pop.params)[0].data_ptr()
    pop, _ = step(pop, tuple(torch.stack([x, y]) for x, y in zip(a, b)))  # member 0 gets a, member 1 b
    assert optree.tree_leaves(pop.params)[0].data_ptr() == ptr  # written into the input's buffers
    want = [solo(members[0], a)[0], solo(members[1], b)[0]]
    assert _max_diff(pop, want) <= 1e-6


@pytest.mark.slow
def test_compiled_population_is_one_graph_and_matches_eager():
    cfg, loss_fn, opt, members = _setup(k=2, n_layer=1)
    torch._dynamo.reset()
    counters.clear()
    compiled = population.make_population_step(loss_fn, opt, donate=False)
    eager = population.make_population_step(loss_fn, opt, compile=False, donate=False)
    pc, pe = population.stack(members), population.stack(members)
    for batch in _batches(cfg, 3):
        pc, mc = compiled(pc, batch)
        pe, me = eager(pe, batch)
        torch.testing.assert_close(mc["loss"], me["loss"], rtol=1e-5, atol=0)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["recompiles"] and not counters["graph_break"], (
        dict(counters["recompiles"]),
        dict(counters["graph_break"]),
    )
    assert _max_diff(pc, population.unstack(pe)) <= 1e-5


@pytest.mark.numeric
def test_population_example_prints_its_difference():
    out = subprocess.run(
        [sys.executable, "examples/population.py", "--steps", "20"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=REPO),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("max |population - solo| = ") and float(last.split("= ")[1]) <= 1e-5, last
