"""The Llama model: stages compose to the forward, remat gradients, grouped-query semantics, sharded init."""

from __future__ import annotations

import _tol
import pytest
import torch

from functrain import rng
from functrain.models import llama

pytestmark = pytest.mark.numeric


def _model(**kw):
    cfg = llama.LlamaConfig(**{**dict(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32), **kw})
    with torch.device("meta"):
        template = llama.Llama(cfg)
    return template, cfg, llama.init_params(template, rng.key(3))


def _batch(cfg, b=3, t=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (b, t + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def test_num_params_counts_the_module_tied_or_not():
    for kw in ({}, {"tie_embeddings": True}, {"attention_bias": True, "mlp_bias": True, "head_dim": 12}):
        template, cfg, params = _model(**kw)
        assert llama.num_params(cfg) == sum(p.numel() for p in params.values())
        assert ("lm_head.weight" in params) == (not cfg.tie_embeddings)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_stages_compose_to_the_forward(dropout):
    template, cfg, params = _model(dropout=dropout)
    x, _ = _batch(cfg)
    key = rng.key(7)
    whole = torch.func.functional_call(template, params, (x,), {"dropout_key": key, "return_hidden": True})
    st = llama.stages(template)
    h = st.embed.fn(st.embed.params(params), x, key)
    for b in st.blocks:
        h = b.fn(b.params(params), h, key)
    torch.testing.assert_close(st.final.fn(st.final.params(params), h, key), whole, rtol=0, atol=0)
    if dropout:  # the key matters, and None turns dropout off
        other = torch.func.functional_call(template, params, (x,), {"dropout_key": rng.key(8), "return_hidden": True})
        assert not torch.equal(other, whole)


@pytest.mark.parametrize("tied", [False, True])
def test_remat_and_chunked_losses_match_the_plain_loss_and_grads(tied):
    template, cfg, params = _model(tie_embeddings=tied)
    batch = _batch(cfg)
    key = rng.key(1)
    plain = llama.make_loss_fn(template)
    grads, (loss, _) = torch.func.grad_and_value(lambda p: plain(p, batch, key), has_aux=True)(params)
    for kwargs in ({"remat": "full"}, {"remat": 1, "chunk_size": 16}, {"staged": True}):
        fn = llama.make_loss_fn(template, **kwargs)
        l2, _, g2 = fn.value_and_grad(params, batch, key)
        n = batch[0].numel() * cfg.n_embd  # reductions over tokens and width
        _tol.assert_close(l2, loss, _tol.rtol(n))
        _tol.assert_close(g2, grads, _tol.rtol(n), msg=str(kwargs))  # norm-wise over the whole tree


def test_grouped_query_attention_equals_mha_with_repeated_kv_heads():
    """kv head j serves query heads j*group .. (j+1)*group-1 (Hugging Face's repeat_kv order)."""
    gqa, cfg, params = _model(n_head=4, n_kv_head=2)
    mha, _, _ = _model(n_head=4, n_kv_head=4)
    d, group = cfg.head_dim, cfg.n_head // cfg.n_kv_head
    wide = dict(params)
    for i in range(cfg.n_layer):
        for kv in "kv":
            name = f"layers.{i}.self_attn.{kv}_proj.weight"
            heads = params[name].reshape(cfg.n_kv_head, d, cfg.n_embd)  # (Hkv, D, C)
            wide[name] = heads.repeat_interleave(group, dim=0).reshape(cfg.n_head * d, cfg.n_embd)  # (H*D, C)
    x, _ = _batch(cfg)
    a = torch.func.functional_call(gqa, params, (x,))
    b = torch.func.functional_call(mha, wide, (x,))
    torch.testing.assert_close(a, b, rtol=_tol.rtol(cfg.n_embd * 16), atol=0)


def test_any_block_of_the_init_is_drawn_alone():
    template, cfg, whole = _model()

    def where(name, shape):  # the second half of the rows (an FSDP shard of 2), all columns
        rows = shape[0] // 2
        return [rows] + [0] * (len(shape) - 1), [shape[0] - rows, *shape[1:]]

    blocks = llama.init_params(template, rng.key(3), where=where)
    for name, t in whole.items():
        assert torch.equal(blocks[name], t[t.shape[0] // 2 :]), name
    init = {n: float(t.std()) for n, t in whole.items() if t.ndim == 2}
    assert init["layers.0.self_attn.o_proj.weight"] < init["layers.0.self_attn.q_proj.weight"]  # depth-scaled
    assert all(torch.equal(t, torch.ones_like(t)) for n, t in whole.items() if n.endswith("norm.weight"))


def test_sequence_longer_than_block_size_is_refused():
    template, cfg, params = _model()
    with pytest.raises(ValueError, match="exceeds block_size 32"):
        torch.func.functional_call(template, params, (torch.zeros(1, 33, dtype=torch.long),))


def test_bad_configs_name_the_problem():
    with pytest.raises(ValueError, match="n_kv_head=3 must divide n_head=4"):
        llama.LlamaConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="head_dim=5 must be even"):
        llama.LlamaConfig(n_head=4, n_kv_head=2, head_dim=5)
    assert llama.LlamaConfig(n_embd=576).intermediate_size == 1536  # SmolLM's 8/3 width, rounded to 64
