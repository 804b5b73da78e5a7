"""functrain.per_example: per-example gradients against a loop, clipping, DP-SGD's noisy mean."""

from __future__ import annotations

import pytest
import torch
from _tol import assert_close, rtol

import functrain as ft
from functrain import per_example, rng, tree
from functrain.models import gpt

pytestmark = pytest.mark.numeric

B, T, V, C = 4, 8, 32, 16


@pytest.fixture(scope="module")
def setup():
    cfg = gpt.GPTConfig(vocab_size=V, block_size=T, n_layer=1, n_head=2, n_embd=C, dropout=0.1)
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    params = gpt.init_params(model, rng.key(0))

    def loss_fn(p, batch, key):
        x, y = batch
        logits = ft.apply(model, p, x, dropout_key=key)  # (b, T, V)
        return gpt.cross_entropy(logits, y), {"first": logits[:, 0, 0].sum()}

    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g))
    return params, loss_fn, batch


def test_grads_equal_a_loop_of_single_example_gradients(setup):
    params, loss_fn, (x, y) = setup
    for key in (None, rng.key(7)):  # without and with dropout: example i gets split(key, B)[i]
        grads, losses, aux = per_example.grads(loss_fn, params, (x, y), key)
        keys = [None] * B if key is None else rng.split(key, B)
        for i in range(B):
            loss, aux_i, g = ft.value_and_grad(loss_fn, params, (x[i : i + 1], y[i : i + 1]), keys[i])
            tol = rtol(T * V)
            assert_close(tree.map(lambda t, i=i: t[i], grads), g, tol, msg=f"example {i}")
            assert_close(losses[i], loss, tol)
            assert_close(aux["first"][i], aux_i["first"], tol)
        assert set(grads) == set(params) and all(grads[k].shape == (B, *params[k].shape) for k in params)


def test_norms_and_clipped_sum(setup):
    params, loss_fn, batch = setup
    grads, _, _ = per_example.grads(loss_fn, params, batch)
    norms = per_example.norms(grads)
    want = torch.stack([tree.global_norm(tree.map(lambda t, i=i: t[i], grads)) for i in range(B)])
    assert_close(norms, want, rtol(tree.size(params)))
    assert norms.shape == (B,) and norms.dtype == torch.float32
    unclipped, _ = per_example.clipped_sum(grads, 1e9)  # no example reaches the bound: the plain sum
    assert_close(unclipped, tree.map(lambda t: t.sum(0), grads), rtol(B))
    bound = float(norms.min()) / 2  # every example is clipped to exactly `bound`
    clipped, n = per_example.clipped_sum(grads, bound)
    scaled = tree.map(lambda t: torch.einsum("b,b...->...", bound / norms, t), grads)
    assert_close(clipped, scaled, rtol(B * tree.size(params)))
    assert float(tree.global_norm(clipped)) <= B * bound * (1 + rtol(tree.size(params)))
    assert torch.equal(n, norms)


def test_privatize_adds_keyed_gaussian_noise_of_std_sigma_c(setup):
    params, _, _ = setup
    zero = tree.map(lambda p: torch.zeros(B, *p.shape), params)  # zero gradients: only noise is left
    key, sigma, c = rng.key(3), 1.5, 0.5
    mean, norms = per_example.privatize(zero, c, sigma, key)
    again, _ = per_example.privatize(zero, c, sigma, key)
    other, _ = per_example.privatize(zero, c, sigma, rng.fold_in(key, 1))
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(mean), tree.leaves(again)))  # same key
    assert not torch.equal(mean["wte.weight"], other["wte.weight"])
    z = torch.cat([t.flatten() for t in tree.leaves(mean)]) * B / (sigma * c)  # ~ N(0, 1)
    n = z.numel()
    assert abs(float(z.mean())) < 5 / n**0.5 and abs(float(z.var()) - 1.0) < 5 * (2 / n) ** 0.5
    streams = [t.flatten()[:64] for t in tree.leaves(mean) if t.numel() >= 64]
    assert len({tuple(s.tolist()) for s in streams}) == len(streams)  # one key per leaf
    assert torch.equal(norms, torch.zeros(B))
    grads = tree.map(lambda p: torch.randn(B, *p.shape), params)  # no noise: the clipped mean
    quiet, _ = per_example.privatize(grads, 1.0, 0.0, key)
    summed, _ = per_example.clipped_sum(grads, 1.0)
    assert_close(quiet, tree.map(lambda t: t / B, summed), rtol(1))
