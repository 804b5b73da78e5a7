"""Shared fixtures: a tiny GPT, its loss function and random token batches; each test's compile-cache setup undone."""

from __future__ import annotations

import os

import pytest
import torch

from functrain import rng
from functrain.models import gpt


def pytest_collection_modifyitems(config, items):
    """Tests marked `exhaustive` run only when `-m` names the marker (`pytest -m exhaustive`)."""
    if "exhaustive" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="an exhaustive variant: `pytest -m exhaustive` runs it")
    for item in items:
        if "exhaustive" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _compile_cache_setup_undone():
    """A test that runs the main job in this process (`compile_cache.setup`) leaves steps unsaved for the next."""
    from functrain.compiler import cache

    before = cache._steps_dir
    yield
    cache._steps_dir = before


def _threads_per_worker() -> None:
    """pytest-xdist workers share the machine's cores: each (and each process it starts) takes its share of threads
    unless OMP_NUM_THREADS says otherwise; OpenMP threads oversubscribing the cores spin against each other (two
    workers of two threads each on 2 cores ran small steps ~10x slower than two of one)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        share = max(1, cores // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


_threads_per_worker()

# Every child process the tests start (torchrun ranks, workers) prints each thread's Python stack
# if it dies on a signal (SIGABRT from a heap check, SIGSEGV), so a crash names where it happened.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def _tiny_gpt(*, n_layer=1, dropout=0.0, bias=False, vocab_size=64, block_size=16, n_embd=32, n_head=2, seed=0):
    """A real (CPU) GPT whose initial weights are a pure function of `seed`."""
    cfg = gpt.GPTConfig(
        vocab_size=vocab_size,
        block_size=block_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        dropout=dropout,
        bias=bias,
    )
    return gpt.GPT(cfg, key=rng.key(seed))


def _batches(cfg: gpt.GPTConfig, n: int, batch_size: int = 8, seed: int = 0):
    """`n` learnable batches (x, y) of shape (batch_size, block_size): random ids x and targets
    y = (3 x + 1) mod vocab_size, so a model can drive the loss down."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch_size, cfg.block_size)
    out = []
    for _ in range(n):
        x = torch.randint(0, cfg.vocab_size, shape, generator=g)
        out.append((x, (3 * x + 1) % cfg.vocab_size))
    return out


def _loss_fn(model):
    """`loss_fn(params, (x, y), key)`: the GPT family's own loss (next-token cross-entropy)."""
    return gpt.make_loss_fn(model)


@pytest.fixture
def tiny_gpt():
    return _tiny_gpt


@pytest.fixture
def batches():
    return _batches


@pytest.fixture
def gpt_loss_fn():
    return _loss_fn
