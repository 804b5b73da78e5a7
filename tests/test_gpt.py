"""Tests of functrain.models.gpt: shapes, causality, tying, meta templates, functional use, dropout
keys, compile, FLOP count, sampling and the tensor-parallel rules."""

import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from functrain import rng
from functrain.models.gpt import (
    GPT,
    TP_RULES,
    GPTConfig,
    cross_entropy,
    flops_per_token,
    generate,
    init_params,
    num_params,
)

pytestmark = pytest.mark.numeric

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1, bias=True)


@pytest.fixture(scope="module")
def model():
    return GPT(CFG, key=rng.key(0))


@pytest.fixture(scope="module")
def idx():
    return torch.randint(0, CFG.vocab_size, (3, CFG.block_size), generator=torch.Generator().manual_seed(0))


def test_forward_shapes(model, idx):
    assert model(idx).shape == (3, CFG.block_size, CFG.vocab_size)
    assert model(idx[:, :5]).shape == (3, 5, CFG.vocab_size)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, CFG.block_size + 1, dtype=torch.long))


def test_causal(model, idx):
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % CFG.vocab_size
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_tied_weights_listed_once(model):
    names = [n for n, _ in model.named_parameters()]
    assert model.lm_head.weight is model.wte.weight
    assert "wte.weight" in names and "lm_head.weight" not in names
    assert sum(p.numel() for p in model.parameters()) == num_params(CFG)


def test_meta_template_has_same_parameters(model):
    with torch.device("meta"):
        template = GPT(CFG)
    assert all(p.is_meta for p in template.parameters())
    assert template.lm_head.weight is template.wte.weight
    assert [(n, p.shape) for n, p in template.named_parameters()] == [(n, p.shape) for n, p in model.named_parameters()]


def test_init_params_is_a_pure_function_of_the_key(model):
    with torch.device("meta"):
        template = GPT(CFG)
    a, b, c = (init_params(template, rng.key(s)) for s in (0, 0, 1))
    assert list(a) == [n for n, _ in model.named_parameters()]
    assert all(torch.equal(a[n], p) for n, p in model.named_parameters())  # GPT(cfg, key) agrees
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["wte.weight"], c["wte.weight"])
    assert torch.equal(a["blocks.0.ln_1.weight"], torch.ones(CFG.n_embd))
    assert torch.equal(a["blocks.0.attn.q.bias"], torch.zeros(CFG.n_embd))
    # residual projections get the 1/sqrt(2 n_layer) scaled init
    assert a["blocks.0.mlp.proj.weight"].std() < 0.7 * a["blocks.0.mlp.fc.weight"].std()


def test_functional_call_matches_module(idx):
    with torch.device("meta"):
        template = GPT(CFG)
    params = init_params(template, rng.key(7))
    module = GPT(CFG)
    module.load_state_dict(params, strict=False)  # lm_head.weight follows wte.weight (tied)
    key = rng.key(3)
    out = torch.func.functional_call(template, params, (idx,), {"dropout_key": key})
    torch.testing.assert_close(out, module(idx, dropout_key=key), rtol=0, atol=0)
    torch.testing.assert_close(torch.func.functional_call(template, params, (idx,)), module(idx))


def test_dropout_keys(model, idx):
    k1, k2 = rng.key(1), rng.key(2)
    a, b, c = model(idx, dropout_key=k1), model(idx, dropout_key=k1), model(idx, dropout_key=k2)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    none1, none2 = model(idx), model(idx, dropout_key=None)
    assert torch.equal(none1, none2)
    assert not torch.allclose(a, none1)
    # key None is the eval forward: equal to the same weights with dropout switched off
    no_drop = GPT(GPTConfig(**{**CFG.__dict__, "dropout": 0.0}))
    no_drop.load_state_dict(model.state_dict())
    assert torch.equal(no_drop(idx), none1)
    assert torch.equal(no_drop(idx, dropout_key=k1), none1)  # p = 0: the key is ignored


def test_each_dropout_site_has_its_own_key(model, idx, monkeypatch):
    import functrain.models.gpt.model as gpt

    seen = []
    real = gpt.rng.dropout
    monkeypatch.setattr(gpt.rng, "dropout", lambda x, p, key: seen.append(key) or real(x, p, key))
    model(idx, dropout_key=rng.key(1))
    assert len(seen) == 1 + 2 * CFG.n_layer  # embedding + (attention, MLP) per block
    assert len({tuple(k.tolist()) for k in seen}) == len(seen)


@pytest.mark.slow
def test_compiled_grad_matches_eager(idx):
    """The one compile test: loss through functional_call + grad_and_value, fullgraph.

    The default backend is aot_eager (Dynamo + AOTAutograd tracing in ~5 s; the inductor C++
    codegen of even this tiny graph takes ~45 s on 2 CPU cores). FUNCTRAIN_TEST_INDUCTOR=1 runs
    the same test with inductor.
    """
    backend = "inductor" if os.environ.get("FUNCTRAIN_TEST_INDUCTOR") == "1" else "aot_eager"
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.1)
    with torch.device("meta"):
        template = GPT(cfg)
    params = init_params(template, rng.key(0))
    x, y = idx[:2, :8], idx[:2, 1:9] % cfg.vocab_size

    def loss_fn(p, x, y, key):
        return cross_entropy(torch.func.functional_call(template, p, (x,), {"dropout_key": key}), y)

    step = torch.func.grad_and_value(loss_fn)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    import _tol

    tol = _tol.rtol(x.numel() * 4 * cfg.n_embd)  # tokens x the widest matmul
    for s in (0, 1):  # step as a tensor: a new key per step, no recompile
        key = rng.fold_in(rng.key(5), torch.tensor(s))
        g_eager, l_eager = step(params, x, y, key)
        g_comp, l_comp = compiled(params, x, y, key)
        _tol.assert_close(l_comp, l_eager, tol, msg="loss")
        _tol.assert_close(g_comp, g_eager, tol, msg="grads")
    g_again, l_again = compiled(params, x, y, key)
    assert torch.equal(l_again, l_comp)  # same (params, batch, key): same result
    assert counter.frame_count == 1  # one graph, no recompile across steps


def test_num_params_and_flops_hand_count():
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=True)
    ln, attn, mlp = 2 * 32, 4 * (32 * 32 + 32), (32 * 128 + 128) + (128 * 32 + 32)
    per_layer = 2 * ln + attn + mlp  # 12704
    total = 64 * 32 + 16 * 32 + 2 * per_layer + ln
    assert total == 28032
    assert num_params(cfg) == total
    assert num_params(cfg, non_embedding=True) == total - 16 * 32
    assert flops_per_token(cfg) == 6 * (total - 16 * 32) + 12 * 2 * 32 * 16 == 177408
    no_bias = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
    assert num_params(no_bias) == sum(p.numel() for p in GPT(no_bias).parameters())


def test_cross_entropy_matches_torch():
    logits = torch.randn(2, 5, 7, dtype=torch.bfloat16)
    targets = torch.randint(0, 7, (2, 5))
    targets[0, 0] = -1
    got = cross_entropy(logits, targets)
    assert got.dtype == torch.float32 and got.ndim == 0
    want = F.cross_entropy(logits.float().reshape(10, 7), targets.reshape(10), ignore_index=-1)
    torch.testing.assert_close(got, want)


def test_generate(model):
    params = dict(model.named_parameters())
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    a = generate(model, params, prompt, 20, key=rng.key(0))
    b = generate(model, params, prompt, 20, key=rng.key(0))
    c = generate(model, params, prompt, 20, key=rng.key(1))
    assert a.shape == (2, 23) and a.dtype == torch.int64
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[:, :3], prompt) and int(a.max()) < CFG.vocab_size
    greedy = generate(model, params, prompt, 20, temperature=0.0, key=rng.key(0))
    assert torch.equal(generate(model, params, prompt, 20, top_k=1, key=rng.key(9)), greedy)
    assert torch.equal(greedy[:, 3], model(prompt)[:, -1].argmax(-1))
    long = generate(model, params, torch.arange(30) % CFG.vocab_size, 5, key=rng.key(0))  # > block_size
    assert long.shape == (35,)


def test_tp_rules_cover_every_parameter(model):
    def kind(name):
        return next(k for pat, k in TP_RULES if re.search(pat, name))

    kinds = {n: kind(n) for n, _ in model.named_parameters()}
    assert kinds["blocks.1.attn.q.weight"] == kinds["blocks.0.attn.v.bias"] == "colwise"
    assert kinds["blocks.0.mlp.fc.weight"] == "colwise"
    assert kinds["blocks.0.attn.proj.weight"] == kinds["blocks.1.mlp.proj.bias"] == "rowwise"
    assert kinds["wte.weight"] == kinds["wpe.weight"] == kinds["ln_f.weight"] == "replicate"
    assert kinds["blocks.0.ln_1.weight"] == "replicate"


def test_tp_local_attention_sums_to_full(model):
    """colwise q/k/v + rowwise proj: each half of the heads gives a partial sum of the output."""
    attn = model.blocks[0].attn
    x = torch.randn(2, 6, CFG.n_embd)
    full = attn(x)
    p = dict(attn.named_parameters())
    half = CFG.n_embd // 2
    parts = []
    for r in range(2):
        rows = slice(r * half, (r + 1) * half)
        local = {f"{n}.{t}": p[f"{n}.{t}"][rows] for n in "qkv" for t in ("weight", "bias")}
        local["proj.weight"] = p["proj.weight"][:, rows]
        local["proj.bias"] = p["proj.bias"] if r == 0 else torch.zeros_like(p["proj.bias"])
        parts.append(torch.func.functional_call(attn, local, (x,)))
    torch.testing.assert_close(parts[0] + parts[1], full)
