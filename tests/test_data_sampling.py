"""Sampling: epochs cover every window once, mixtures keep their weights, batches are the same on
any world size (and so on a resume onto another one), and the prefetcher changes nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from functrain.data import Batching, DataError, Prefetcher, Sampler, get_batch, mixture_rows, permute
from functrain.data.sampling import mixture_counts


@pytest.mark.parametrize("n", [1, 2, 3, 17, 64, 1000, 4097])
def test_permute_is_a_bijection_that_depends_on_the_key(n):
    a = permute(np.arange(n), n, key=1)
    assert sorted(a.tolist()) == list(range(n))
    if n >= 17:
        assert not np.array_equal(a, permute(np.arange(n), n, key=2))
        assert not np.array_equal(a, np.arange(n))


def _global(sampler, step, world=1):
    """The global batch of `step`, assembled from `world` ranks' rows."""
    parts = [sampler.batch(step, rank=r, world=world) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def test_epochs_use_every_window_exactly_once_per_epoch_in_a_fresh_order():
    T, B = 8, 6
    tokens = np.arange(T * 25 + 1, dtype=np.uint16)  # W = 25 windows: B does not divide W
    sampler = Sampler([("d", tokens, 1.0)], batch_size=B, block_size=T, seed=3, sampling="epochs")
    W = sampler.windows[0]
    assert W == 25
    rows = torch.cat([_global(sampler, s)[0] for s in range(math.ceil(3 * W / B))])  # 3 epochs and a bit
    starts = (rows[:, 0] // 1).tolist()  # token ids equal positions: a row's first id is its start
    epochs = [starts[e * W : (e + 1) * W] for e in range(3)]
    for e in epochs:
        assert sorted(e) == [w * T for w in range(W)]  # each window once
    assert epochs[0] != epochs[1] != epochs[2]  # a new order each epoch
    x, y = _global(sampler, 4)
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert sampler.position(0) == {"epoch": 0, "epoch_fraction": 0.0}
    assert sampler.position(5) == {"epoch": 1, "epoch_fraction": 5 / 25}
    again = Sampler([("d", tokens, 1.0)], batch_size=B, block_size=T, seed=3, sampling="epochs")
    assert torch.equal(_global(again, 7)[0], _global(sampler, 7)[0])  # a pure function of (seed, step)
    other = Sampler([("d", tokens, 1.0)], batch_size=B, block_size=T, seed=4, sampling="epochs")
    assert not torch.equal(_global(other, 0)[0], _global(sampler, 0)[0])


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.3, 0.2), (1, 1, 1, 5)])
def test_mixture_rows_match_the_weights_on_every_prefix(weights):
    w = np.asarray(weights, float) / sum(weights)
    src, idx = mixture_rows(np.arange(20000), w, seed=0)
    for n in (10, 100, 1000, 20000):
        counts = np.bincount(src[:n], minlength=len(w))
        assert np.all(np.abs(counts - n * w) <= len(w)), (n, counts, n * w)  # within a row per source
        assert counts.tolist() == mixture_counts(n, w, seed=0)
    for k in range(len(w)):  # each source's rows are numbered 0, 1, 2, ... in order
        assert idx[src == k].tolist() == list(range((src == k).sum()))
    rows = np.array([5, 19999, 77, 3])
    s2, i2 = mixture_rows(rows, w, seed=0)  # a row's source is a function of the row alone
    assert s2.tolist() == src[rows].tolist() and i2.tolist() == idx[rows].tolist()


def _mixture(sampling, seed=0):
    web = np.full(4000, 1, np.uint16)  # every token of a source is its id: a row names its source
    code = np.full(3000, 2, np.uint16)
    return Sampler([("web", web, 0.7), ("code", code, 0.3)], batch_size=8, block_size=16, seed=seed, sampling=sampling)


@pytest.mark.parametrize("sampling", ["windows", "epochs"])
def test_mixture_batches_realize_the_weights(sampling):
    sampler = _mixture(sampling)
    ids = torch.cat([_global(sampler, s)[0][:, 0] for s in range(250)])
    share = (ids == 1).float().mean().item()
    assert abs(share - 0.7) <= 2 / len(ids)  # deterministic: off by at most a row per source
    position = sampler.position(250)
    if sampling == "epochs":
        assert set(position) == {"epoch/web", "epoch_fraction/web", "epoch/code", "epoch_fraction/code"}
        assert position["epoch/web"] == int(0.7 * 2000) // sampler.windows[0]
    else:
        assert position == {}


@pytest.mark.parametrize("sampling,mixed", [("windows", False), ("epochs", False), ("windows", True), ("epochs", True)])
def test_global_batches_are_the_same_on_1_2_and_4_ranks(sampling, mixed):
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint16)
    sources = [("a", tokens, 0.6), ("b", tokens[::-1].copy(), 0.4)] if mixed else [("a", tokens, 1.0)]
    sampler = Sampler(sources, batch_size=8, block_size=32, seed=1, sampling=sampling)
    for step in (0, 1, 19, 20, 123):
        one = _global(sampler, step, 1)
        for world in (2, 4):
            other = _global(sampler, step, world)
            assert torch.equal(one[0], other[0]) and torch.equal(one[1], other[1])


def test_one_source_with_windows_is_get_batch_bit_for_bit():
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint16)
    sampler = Sampler([("a", tokens, 1.0)], batch_size=8, block_size=32, seed=5)
    for step in (0, 9):
        x, y = sampler.batch(step, rank=1, world=2)
        gx, gy = get_batch(tokens, Batching(8, 32, seed=5), step, rank=1, world=2)
        assert torch.equal(x, gx) and torch.equal(y, gy)


def test_bad_sampler_inputs_are_one_line():
    tokens = np.zeros(100, np.uint16)
    for kw, words in (({"sampling": "shuffle"}, "data.sampling='shuffle'"),):
        with pytest.raises(DataError, match=words):
            Sampler([("a", tokens, 1.0)], batch_size=2, block_size=8, seed=0, **kw)
    with pytest.raises(DataError, match="fewer than block_size"):
        Sampler([("a", tokens, 1.0)], batch_size=2, block_size=200, seed=0)
    with pytest.raises(DataError, match="positive"):
        Sampler([("a", tokens, 0.0)], batch_size=2, block_size=8, seed=0)


def test_prefetcher_gives_the_same_batches_follows_jumps_and_raises_the_batch_error():
    sampler = _mixture("epochs")
    made = []

    def batch_at(step):
        made.append(step)
        if step == 42:
            raise DataError("bad step 42")
        return sampler.batch(step)

    with Prefetcher(batch_at, 3) as batches:
        for step in (3, 4, 5, 10, 11):  # 10: a jump, the thread starts again from there
            x, y = batches.get(step)
            ex, ey = sampler.batch(step)
            assert torch.equal(x, ex) and torch.equal(y, ey)
        assert 6 in made  # made ahead of the request
        with pytest.raises(DataError, match="bad step 42"):
            batches.get(42)
    assert batches.wait_s >= 0 and batches.make_s > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side-stream copy")
def test_prefetched_cuda_batches_equal_the_host_ones():
    sampler = _mixture("epochs")
    with Prefetcher(lambda s: sampler.batch(s, device="cuda"), 0, device="cuda") as batches:
        for step in range(5):
            x, y = batches.get(step)
            assert x.is_cuda and torch.equal(x.cpu(), sampler.batch(step)[0])
