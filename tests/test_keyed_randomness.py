"""Every random draw inside a module comes from the step's key (functrain.nn.randomness).

Each case trains a module whose randomness torch would take from its global generator
(`nn.MultiheadAttention`'s attention dropout, `nn.TransformerEncoderLayer`, DropPath's
`bernoulli_`, `rand_like` noise, RReLU, `gumbel_softmax`, fractional max pooling) under two torch
global seeds: the runs must be equal bit for bit, a function of functrain's seed alone; another
functrain seed must give other numbers; the compiled step must equal the eager one. Without the
mode (the negative control) the two torch seeds give different numbers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _tol import assert_close, rtol
from torch import nn

import functrain as ft
from functrain import optim, rng
from functrain.nn import randomness


class DropPath(nn.Module):
    """Stochastic depth as timm writes it: a per-row mask drawn with `x.new_empty(...).bernoulli_(p)`."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)  # (B, 1, 1)
        return x * mask / keep


class Noisy(nn.Module):
    """Gaussian noise, an RReLU, a Gumbel softmax and a fractional max pool: draws of four kinds."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.act = nn.RReLU()
        self.pool = nn.FractionalMaxPool2d(2, output_size=(2, 2))

    def forward(self, x):  # x: (B, T, 16)
        h = self.lin(x + 0.1 * torch.randn_like(x) * self.training)
        h = self.act(h) + F.gumbel_softmax(h, tau=0.5)
        return h + self.pool(h.view(-1, 1, 4, 4)).mean() + torch.rand(h.shape[-1]) * 0.01


def _modules():
    return {
        "mha": lambda: nn.MultiheadAttention(16, 2, dropout=0.1, batch_first=True),
        "encoder": lambda: nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True),
        "droppath": lambda: nn.Sequential(nn.Linear(16, 16), DropPath(0.3)),
        "noise": Noisy,
    }


def _forward(name, net, x, params=None):
    """The module's output on x (params: functionally, with these params)."""
    call = net if params is None else (lambda *a: ft.apply(net, params, *a))
    return call(x, x, x)[0] if name == "mha" else call(x)


def _run(name, *, torch_seed, seed=0, compile=False, steps=3):
    torch.manual_seed(0)
    net = _modules()[name]()

    def loss_fn(params, batch, key):
        return _forward(name, net, batch, params).pow(2).mean()

    opt = optim.sgd(0.1)
    state = ft.init_state(net, opt, seed=seed)
    options = {"backend": "aot_eager"} if compile == "aot_eager" else None
    step = ft.make_train_step(loss_fn, opt, compile=bool(compile), compile_options=options)
    g = torch.Generator().manual_seed(5)
    data = [torch.randn(4, 8, 16, generator=g) for _ in range(steps)]
    torch.manual_seed(torch_seed)
    losses = []
    for b in data:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


@pytest.mark.parametrize("name", sorted(_modules()))
def test_draws_follow_functrains_seed_not_torchs(name):
    _, a = _run(name, torch_seed=1)
    _, b = _run(name, torch_seed=2)
    _, c = _run(name, torch_seed=1, seed=1)
    assert a == b
    assert a != c


@pytest.mark.parametrize("name", ["mha", "encoder"])
def test_without_the_mode_torchs_seed_decides(name):
    """The negative control: the same forward outside `keyed` depends on torch's global seed."""
    torch.manual_seed(0)
    net = _modules()[name]().train()
    x = torch.randn(4, 8, 16)
    outs = []
    for s in (1, 2):
        torch.manual_seed(s)
        outs.append(_forward(name, net, x))
    assert not torch.equal(*outs)
    for s in (1, 2):
        torch.manual_seed(s)
        with randomness.keyed(rng.key(0)):
            outs.append(_forward(name, net, x))
    assert torch.equal(outs[2], outs[3])


@pytest.mark.parametrize("name", sorted(_modules()))
def test_compiled_draws_equal_eager(name):
    eager, a = _run(name, torch_seed=1)
    compiled, b = _run(name, torch_seed=2, compile="aot_eager")
    assert_close(torch.tensor(b), torch.tensor(a), rtol(8 * 32 * 16))
    assert_close(compiled.params, eager.params, rtol(8 * 32 * 16))


@pytest.mark.exhaustive
@pytest.mark.numeric
def test_inductor_draws_equal_eager():
    eager, a = _run("encoder", torch_seed=1)
    compiled, b = _run("encoder", torch_seed=2, compile=True)
    assert_close(torch.tensor(b), torch.tensor(a), rtol(8 * 32 * 16))
    assert_close(compiled.params, eager.params, rtol(8 * 32 * 16))


def test_keyed_draws_have_torchs_distributions():
    n = 200_000
    with randomness.keyed(rng.key(0)):
        u, z = torch.rand(n), torch.randn(n, dtype=torch.float64)
        ints = torch.randint(3, 7, (n,))
        mask = torch.empty(n).bernoulli_(0.3)
        probs = torch.bernoulli(torch.full((n,), 0.8))
        e = torch.empty(n).exponential_(2.0)
        w = torch.empty(n).uniform_(-2.0, 4.0)
        r = F.rrelu(-torch.ones(n), 0.1, 0.3, training=True)
    assert abs(float(u.mean()) - 0.5) < 0.01 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1.0) < 0.01 and z.dtype == torch.float64
    assert set(ints.unique().tolist()) == {3, 4, 5, 6} and ints.dtype == torch.int64
    assert abs(float(mask.mean()) - 0.3) < 0.01 and set(mask.unique().tolist()) == {0.0, 1.0}
    assert abs(float(probs.mean()) - 0.8) < 0.01
    assert abs(float(e.mean()) - 0.5) < 0.01 and float(e.min()) >= 0.0
    assert abs(float(w.mean()) - 1.0) < 0.02 and float(w.min()) >= -2.0 and float(w.max()) < 4.0
    assert abs(float(r.mean()) + 0.2) < 0.01 and float(r.max()) <= -0.1 and float(r.min()) >= -0.3
    with randomness.keyed(rng.key(0)):  # the same key, the same numbers
        assert torch.equal(torch.rand(n), u)


def test_an_explicit_generator_is_kept():
    with randomness.keyed(rng.key(0)):
        a = torch.rand(8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, torch.rand(8, generator=torch.Generator().manual_seed(3)))


def test_an_unkeyable_draw_is_named_once():
    net = nn.Linear(4, 4)

    def loss_fn(params, batch, key):
        rows = batch[torch.randperm(batch.shape[0])]  # no key can stand in for randperm's generator
        return ft.apply(net, params, rows).pow(2).mean()

    opt = optim.sgd(0.1)
    state = ft.init_state(net, opt, seed=0)
    step = ft.make_train_step(loss_fn, opt, compile=False)
    with pytest.warns(UserWarning, match=r"functrain: warning: torch.randperm inside the loss draws from torch's"):
        state, _ = step(state, torch.randn(8, 4))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(state, torch.randn(8, 4))  # once


def test_python_tensor_methods_compile_under_the_mode():
    """`Tensor.unflatten` and other Python-level methods pass through the mode inside one graph."""
    net = nn.Linear(8, 8)

    def loss_fn(params, batch, key):
        h = ft.apply(net, params, batch).unflatten(-1, (2, 4))  # (B, 2, 4)
        return h.split(1, dim=1)[0].pow(2).mean() + h.norm()

    opt = optim.sgd(0.1)
    eager = ft.make_train_step(loss_fn, opt, compile=False, donate=False)
    compiled = ft.make_train_step(loss_fn, opt, compile=True, compile_options={"backend": "aot_eager"}, donate=False)
    state = ft.init_state(net, opt, seed=0)
    x = torch.randn(4, 8)
    _, a = eager(state, x)
    _, b = compiled(state, x)
    assert_close(b["loss"], a["loss"], rtol(64))


def test_scan_refuses_a_loss_whose_modules_draw():
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))

    def loss_fn(params, batch, key):
        return ft.apply(net, params, batch).pow(2).mean()

    opt = optim.sgd(0.1)
    step = ft.make_train_step(loss_fn, opt, compile=False, accum_steps=2, accum_impl="scan")
    with pytest.raises(ValueError, match="accum_impl='scan' cannot key the random draws"):
        step(ft.init_state(net, opt, seed=0), torch.randn(8, 4))


def _embedding_grads(net, x, keyed):
    params = {n: p.detach().clone() for n, p in net.named_parameters()}

    def loss(p):
        with randomness.keyed(rng.key(0) if keyed else None):
            return ft.apply(net, p, x).pow(2).sum()

    return torch.func.grad(loss)(params)


def test_a_users_embedding_gets_the_same_values_and_gradients():
    """nn.Embedding (with a padding row) under the mode: torch's gradients, the padding row's zero."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(50, 8, padding_idx=3), nn.Linear(8, 8))
    x = torch.randint(0, 50, (4, 12))
    x[0, :4] = 3
    ours, theirs = _embedding_grads(net, x, True), _embedding_grads(net, x, False)
    assert_close(ours, theirs, rtol(48))
    assert torch.equal(ours["0.weight"][3], torch.zeros(8))


@pytest.mark.slow
def test_a_users_embedding_compiles_to_bit_identical_steps():
    """The same (state, batch) six times through the compiled step on two threads: one result."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64))

        def loss_fn(params, batch, key):
            return F.cross_entropy(ft.apply(net, params, batch).flatten(0, 1), batch.flatten())

        opt = optim.sgd(0.1)
        step = ft.make_train_step(loss_fn, opt, donate=False)
        state = ft.init_state(net, opt, seed=0)
        x = torch.randint(0, 64, (16, 64), generator=torch.Generator().manual_seed(1))
        outs = [step(state, x)[0].params["0.weight"] for _ in range(6)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
