"""functrain.rng: pure, distinct keys; uniform numbers and dropout drawn from them (eager)."""

from __future__ import annotations

import torch

from functrain import rng

MASK32 = (1 << 32) - 1


def _is_key(k):
    return k.shape == (2,) and k.dtype == torch.int64 and bool(((k >= 0) & (k <= MASK32)).all())


def test_key_is_a_pure_function_of_the_seed():
    assert _is_key(rng.key(0))
    assert torch.equal(rng.key(0), rng.key(0))
    keys = {tuple(rng.key(s).tolist()) for s in range(2000)}
    assert len(keys) == 2000
    for big in (2**32, 2**63 - 1, 2**64 - 1):  # the high word matters too
        assert _is_key(rng.key(big))
        assert not torch.equal(rng.key(big), rng.key(big & MASK32))
    assert torch.equal(rng.key(-1), rng.key(2**64 - 1))  # only the low 64 bits count


def test_fold_in_is_pure_and_gives_distinct_keys():
    k = rng.key(7)
    k_before = k.clone()
    a = rng.fold_in(k, 3)
    assert torch.equal(k, k_before)  # the input key is not touched
    assert _is_key(a)
    assert torch.equal(a, rng.fold_in(k, 3))
    assert torch.equal(a, rng.fold_in(k, torch.tensor(3)))  # int or tensor data: same key
    assert torch.equal(a, rng.fold_in(k, torch.tensor(3, dtype=torch.int32)))
    folded = {tuple(rng.fold_in(k, d).tolist()) for d in range(5000)}
    assert len(folded) == 5000
    assert tuple(k.tolist()) not in folded
    # The same data under different keys gives different keys.
    assert len({tuple(rng.fold_in(rng.key(s), 0).tolist()) for s in range(1000)}) == 1000


def test_split_is_pure_and_gives_distinct_keys():
    k = rng.key(11)
    ks = rng.split(k, 64)
    assert ks.shape == (64, 2) and ks.dtype == torch.int64
    assert torch.equal(ks, rng.split(k, 64))
    rows = {tuple(r) for r in ks.tolist()}
    assert len(rows) == 64 and tuple(k.tolist()) not in rows
    a, b = rng.split(k)  # the default: two keys, unpackable
    assert _is_key(a) and _is_key(b) and not torch.equal(a, b)
    # Keys from split and from fold_in of the same parent must not coincide.
    folded = {tuple(rng.fold_in(k, d).tolist()) for d in range(200)}
    assert not rows & folded


def test_key_data_round_trips_the_two_words():
    k = torch.tensor([0x12345678, 0x9ABCDEF0], dtype=torch.int64)
    assert rng.key_data(k) == 0x123456789ABCDEF0


def test_uniform_depends_only_on_the_key_and_leaves_global_rng_alone():
    k = rng.key(0)
    global_state = torch.get_rng_state()
    u = rng.uniform(k, (4, 8))
    torch.manual_seed(123)  # the global generator must not matter
    assert torch.equal(u, rng.uniform(k, (4, 8)))
    torch.set_rng_state(global_state)
    assert u.shape == (4, 8) and u.dtype == torch.float32
    assert not torch.equal(u, rng.uniform(rng.fold_in(k, 1), (4, 8)))
    assert rng.uniform(k, (3,), dtype=torch.float64).dtype == torch.float64


def test_uniform_depends_on_both_key_words():
    # torch's CPU generator keeps only the low 32 bits of its seed: both words must reach them.
    a = torch.tensor([1, 12345], dtype=torch.int64)
    b = torch.tensor([999, 12345], dtype=torch.int64)
    assert not torch.equal(rng.uniform(a, (16,)), rng.uniform(b, (16,)))


def test_uniform_statistics():
    n = 200_000
    u = rng.uniform(rng.key(1), (n,), dtype=torch.float64)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # Mean 1/2 and variance 1/12; standard errors ~0.00065 and ~0.00015: allow 5 of them.
    assert abs(float(u.mean()) - 0.5) < 5 * (1 / 12) ** 0.5 / n**0.5
    assert abs(float(u.var()) - 1 / 12) < 0.001
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert float((counts - n / 10).abs().max()) < 5 * (n / 10) ** 0.5
    # Streams of neighbouring keys are uncorrelated.
    v = rng.uniform(rng.fold_in(rng.key(1), 1), (n,), dtype=torch.float64)
    corr = torch.corrcoef(torch.stack([u, v]))[0, 1]
    assert abs(float(corr)) < 5 / n**0.5


def test_bernoulli_rate():
    n = 100_000
    m = rng.bernoulli(rng.key(2), 0.3, (n,))
    assert m.dtype == torch.bool
    assert abs(float(m.float().mean()) - 0.3) < 5 * (0.3 * 0.7 / n) ** 0.5


def test_dropout_scales_kept_entries_and_drops_a_fraction_p():
    p = 0.25
    x = torch.randn(400, 500, generator=torch.Generator().manual_seed(0))
    k = rng.key(5)
    y = rng.dropout(x, p, k)
    assert torch.equal(y, rng.dropout(x, p, k))  # same key, same mask
    assert not torch.equal(y, rng.dropout(x, p, rng.fold_in(k, 1)))
    kept = y != 0
    frac_dropped = 1.0 - float(kept.float().mean())
    assert abs(frac_dropped - p) < 5 * (p * (1 - p) / x.numel()) ** 0.5
    torch.testing.assert_close(y[kept], x[kept] / (1.0 - p))  # inverted dropout: E[y] = x
    ones = torch.ones(x.numel())
    assert abs(float(rng.dropout(ones, p, k).mean()) - 1.0) < 0.01
    # Identity when off: p == 0 or no key (evaluation).
    assert rng.dropout(x, 0.0, k) is x
    assert rng.dropout(x, p, None) is x


def test_normal_blocks_equal_the_slices_of_the_whole_tensor():
    """Any block is drawn alone and equals that block of the whole tensor, bit for bit (sharded init)."""
    k = rng.key(7)
    whole = rng.normal(k, (40, 6, 5))
    assert torch.equal(rng.normal(k, (40, 6, 5), offset=(13, 2, 1), local_shape=(9, 3, 4)), whole[13:22, 2:5, 1:5])
    vec = rng.normal(k, (50,))
    assert torch.equal(rng.normal(k, (50,), offset=(20,), local_shape=(7,)), vec[20:27])
    assert torch.equal(rng.normal(k, (40, 6, 5)), whole)  # a pure function of the key
    assert not torch.equal(rng.normal(rng.key(8), (40, 6, 5)), whole)
    assert rng.normal(k, (3, 4), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_normal_is_standard_normal_and_rows_are_independent():
    x = rng.normal(rng.key(0), (400, 500)).double()
    n = x.numel()
    # mean and variance within 5 standard errors of N(0, 1)'s
    assert abs(x.mean().item()) < 5 / n**0.5
    assert abs(x.var().item() - 1) < 5 * (2 / n) ** 0.5
    assert abs((x.abs() < 1).double().mean().item() - 0.6826894921) < 5 * (0.22 / n) ** 0.5
    c = torch.corrcoef(x[:50])  # (50, 50): rows from neighbouring seeds are uncorrelated
    off = c[~torch.eye(50, dtype=torch.bool)]
    assert off.abs().max().item() < 5 / 500**0.5


def _old_fold_in(key, data):  # the pre-op formulation (elementwise int64 ops), for the equality check
    m = rng._mix
    d = m(torch.as_tensor(data, dtype=torch.int64))
    n0 = m(key[0] ^ m(d + key[1]))
    return torch.stack([n0, m(key[1] ^ m(n0 + d + rng._GOLDEN))])


def test_fold_in_and_split_ops_keep_the_keys_and_vmap():
    keys = torch.stack([rng.key(s) for s in range(5)])  # (5, 2)
    data = torch.tensor([0, 1, 7, 2**33 + 5, -3])
    for k, d in zip(keys, data):
        assert torch.equal(rng.fold_in(k, d), _old_fold_in(k, d))
        words = rng._split_words(k[0], k[1], torch.arange(3))
        assert torch.equal(rng.split(k, 3), torch.stack(words, -1))
    by_key = torch.func.vmap(rng.fold_in)(keys, data)
    assert torch.equal(by_key, torch.stack([rng.fold_in(k, d) for k, d in zip(keys, data)]))
    one_key = torch.func.vmap(rng.fold_in, in_dims=(None, 0))(keys[0], data)
    assert torch.equal(one_key, torch.stack([rng.fold_in(keys[0], d) for d in data]))
    columns = torch.func.vmap(lambda k: rng.split(k, 4), in_dims=1)(keys.T.contiguous())
    assert torch.equal(columns, torch.stack([rng.split(k, 4) for k in keys]))


def test_key_derivation_is_one_opaque_op_in_a_compiled_graph():
    """fold_in / split are single ops for the compiler: as elementwise int64 chains inductor re-traced
    them per read (44 s to compile one draw from split(fold_in(k, step)), minutes for a few dozen)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def derive(key, step):
        k1, k2 = rng.split(rng.fold_in(key, step))
        return rng.uniform(k1, (3,)) + rng.gaussian(rng.fold_in(k2, 5), (3,))

    torch._dynamo.reset()
    out = torch.compile(derive, backend=capture, fullgraph=True)(rng.key(0), torch.tensor(4))
    assert torch.equal(out, derive(rng.key(0), torch.tensor(4)))
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("functrain.fold_in" in t for t in targets) == 2 and sum("functrain.split" in t for t in targets) == 1
    assert not [t for t in targets if any(op in t for op in ("xor", "rshift", "and_", "bitwise"))], targets


def test_gaussian_is_keyed_standard_normal_and_vmaps_per_key():
    n = 200_000
    z = rng.gaussian(rng.key(3), (n,), dtype=torch.float64)
    assert torch.equal(z, rng.gaussian(rng.key(3), (n,), dtype=torch.float64))
    assert not torch.equal(z[:100], rng.gaussian(rng.key(4), (100,), dtype=torch.float64))
    # Mean 0 and variance 1; standard errors 1/sqrt(n) and sqrt(2/n): allow 5 of them.
    assert abs(float(z.mean())) < 5 / n**0.5 and abs(float(z.var()) - 1.0) < 5 * (2 / n) ** 0.5
    keys = rng.split(rng.key(0), 3)
    batched = torch.func.vmap(lambda k: rng.gaussian(k, (4, 2)))(keys)
    assert torch.equal(batched, torch.stack([rng.gaussian(k, (4, 2)) for k in keys]))


def test_a_batch_of_keys_draws_each_keys_numbers_in_one_op_call():
    keys = rng.split(rng.key(1), 6).reshape(2, 3, 2)  # (2, 3, key)
    each = torch.stack([rng.uniform(k, (5,)) for k in keys.reshape(-1, 2)]).reshape(2, 3, 5)
    nested = torch.func.vmap(torch.func.vmap(lambda k: rng.uniform(k, (5,))))(keys)
    assert torch.equal(nested, each)
    inner_first = torch.func.vmap(lambda k: rng.uniform(k, (5,)), in_dims=1, out_dims=1)(keys.transpose(0, 1))
    assert torch.equal(inner_first, each.transpose(0, 1))

    def op_calls(n: int) -> int:
        with torch.profiler.profile() as prof:
            torch.func.vmap(lambda k: rng.uniform(k, (5,)))(rng.split(rng.key(2), n))
        return sum(e.count for e in prof.key_averages() if e.key == "functrain::uniform")

    assert op_calls(12) == op_calls(3)  # one draw op for the batch, not one per key
