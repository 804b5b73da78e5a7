"""functrain.tree helpers over pytrees of tensors."""

from __future__ import annotations

import collections
import contextlib
from typing import Any, NamedTuple

import optree
import pytest
import torch

from functrain import tree

pytestmark = pytest.mark.numeric


def _tree():
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3, 4, generator=g),
        "b": [torch.randn(5, generator=g), (torch.arange(6).reshape(2, 3), None)],
        "c": {"d.e": torch.randn(2, generator=g, dtype=torch.float64)},
    }


def test_named_leaves_names_follow_the_paths_in_flattening_order():
    t = _tree()
    named = list(tree.named_leaves(t))
    assert [n for n, _ in named] == ["a", "b.0", "b.1.0", "c.d.e"]  # None is an empty subtree
    for (_, x), y in zip(named, tree.leaves(t)):
        assert x is y
    assert tree.path_name(("params", "wte.weight")) == "params.wte.weight"
    assert list(tree.named_leaves({})) == []


def test_map_structure_unflatten_round_trip():
    t = _tree()
    doubled = tree.map(lambda x: x * 2, t)
    assert tree.structure(doubled) == tree.structure(t)
    rebuilt = tree.unflatten(tree.structure(t), tree.leaves(doubled))
    for x, y in zip(tree.leaves(rebuilt), tree.leaves(t)):
        assert torch.equal(x, y * 2)
    assert tree.size(t) == 12 + 5 + 6 + 2


def test_zeros_ones_full_like():
    t = _tree()
    for fn, value in ((tree.zeros_like, 0), (tree.ones_like, 1)):
        z = fn(t)
        assert tree.structure(z) == tree.structure(t)
        for x, y in zip(tree.leaves(z), tree.leaves(t)):
            assert x.shape == y.shape and x.dtype == y.dtype and x.device == y.device
            assert bool((x == value).all())
            assert x.data_ptr() != y.data_ptr()
    z32 = tree.zeros_like(t, dtype=torch.float32)
    assert all(x.dtype == torch.float32 for x in tree.leaves(z32))
    f = tree.full_like(t, 0.5, dtype=torch.float64)
    assert all(bool((x == 0.5).all()) and x.dtype == torch.float64 for x in tree.leaves(f))


def test_global_norm_matches_the_norm_of_the_concatenation():
    t = _tree()
    floats = {"a": t["a"], "b": t["b"][0], "c": t["c"]}
    want = torch.linalg.vector_norm(torch.cat([x.double().flatten() for x in tree.leaves(floats)]))
    got = tree.global_norm(floats)
    assert got.shape == () and got.dtype == torch.float32
    n = sum(x.numel() for x in tree.leaves(floats))  # squares summed in float32
    assert abs(float(got) - float(want)) <= 16 * torch.finfo(torch.float32).eps * n**0.5 * float(want)
    # Mixed precisions are accumulated in float32.
    bf = {"x": torch.full((1000,), 3.0, dtype=torch.bfloat16), "y": torch.full((1000,), 4.0)}
    want = 5.0 * 1000**0.5  # exact inputs; 2000 squares summed in float32
    assert abs(float(tree.global_norm(bf)) - want) <= 16 * torch.finfo(torch.float32).eps * 2000**0.5 * want
    assert float(tree.global_norm({})) == 0.0


def test_cast_converts_floating_leaves_only():
    t = _tree()
    c = tree.cast(t, torch.bfloat16)
    dtypes = [x.dtype for x in tree.leaves(c)]
    assert dtypes == [torch.bfloat16, torch.bfloat16, torch.int64, torch.bfloat16]
    torch.testing.assert_close(c["a"].float(), t["a"], rtol=1e-2, atol=1e-2)
    assert torch.equal(c["b"][1][0], t["b"][1][0])


def test_clone_makes_independent_copies():
    t = _tree()
    c = tree.clone(t)
    assert tree.structure(c) == tree.structure(t)
    for x, y in zip(tree.leaves(c), tree.leaves(t)):
        assert torch.equal(x, y) and x.data_ptr() != y.data_ptr()
    c["a"].add_(1.0)
    assert not torch.equal(c["a"], t["a"])


@pytest.mark.parametrize("per_tensor", [False, True])
def test_incremental_update_is_a_pure_lerp(per_tensor):
    from functrain.ops import foreach

    g = torch.Generator().manual_seed(1)
    old = {"w": torch.randn(4, 3, generator=g), "b": [torch.randn(5, generator=g, dtype=torch.float64)]}
    new = tree.map(lambda x: x + torch.randn(x.shape, generator=g, dtype=x.dtype), old)
    before = tree.clone(old)
    for step_size in (0.1, torch.tensor(0.1, dtype=torch.float64)):
        with foreach.per_tensor() if per_tensor else contextlib.nullcontext():
            out = tree.incremental_update(new, old, step_size)
        for o, n, r in zip(tree.leaves(old), tree.leaves(new), tree.leaves(out)):
            assert r.dtype == o.dtype
            torch.testing.assert_close(r, o + 0.1 * (n - o), rtol=4 * torch.finfo(o.dtype).eps, atol=0)
        assert all(torch.equal(a, b) for a, b in zip(tree.leaves(before), tree.leaves(old)))  # pure
    assert tree.structure(out) == tree.structure(old)


class _Pair(NamedTuple):
    mu: Any
    nu: Any


@pytest.mark.parametrize(
    "case", ["nested", "namedtuple", "none", "leaf", "empty", "ordered_dict", "int_keys", "ordered_dict_inside"]
)
def test_flatten_agrees_with_optree_and_falls_back_to_it(case):
    """tree.flatten walks plain nodes itself (cheap under Dynamo) and must give optree's leaves, order
    and structure; other node types go to optree whole."""
    x = torch.ones(2)
    t = {
        "nested": {"z": x, "b": [1, (2.0, None)], "a": {"q": "s", "p": x + 1}},
        "namedtuple": _Pair({"w": x, "b": x * 2}, [None, x * 3]),
        "none": None,
        "leaf": x,
        "empty": {"a": [], "b": ()},
        "ordered_dict": collections.OrderedDict(b=x, a=x + 1),
        "int_keys": {1: x, 0: x + 1},
        "ordered_dict_inside": {"o": collections.OrderedDict(b=x, a=x + 1)},
    }[case]
    leaves, spec = tree.flatten(t)
    ref_leaves, ref_spec = optree.tree_flatten(t)
    assert len(leaves) == len(ref_leaves) and all(a is b for a, b in zip(leaves, ref_leaves))
    assert tree.leaves(t) == leaves or all(a is b for a, b in zip(tree.leaves(t), ref_leaves))
    rebuilt = spec.unflatten([object() for _ in leaves])
    assert optree.tree_structure(rebuilt) == ref_spec
    assert type(rebuilt) is (object if ref_spec.is_leaf() else type(t))
    if isinstance(t, dict):
        assert list(rebuilt) == list(t)  # the template's key order, as optree's unflatten keeps it
    doubled = optree.tree_map(lambda v: [v, v], t)
    assert all(a == b for a, b in zip(spec.flatten_up_to(doubled), ref_spec.flatten_up_to(doubled)))


def test_flatten_spec_rejects_other_structures_with_optrees_error():
    _, spec = tree.flatten({"a": torch.ones(1), "b": [torch.ones(1)]})
    with pytest.raises(ValueError, match="key"):
        spec.flatten_up_to({"a": 1, "c": [2]})
    with pytest.raises(ValueError):
        spec.flatten_up_to({"a": 1, "b": (2,)})  # a tuple where the template has a list
    with pytest.raises(ValueError, match="expected 2 leaves, got 1"):
        spec.unflatten([1])


def _state_like(n: int):
    """A param dict of `n` tensors (keys in a non-sorted order) inside a state-like tree."""
    names = [f"h.{i % 3}.w{i}" for i in range(n)][::-1]
    params = {k: torch.full((2,), float(i)) for i, k in enumerate(names)}
    return (params, _Pair(dict(params), [None, torch.zeros(())]), {"b": 1, "a": (2.0, params)})


@pytest.mark.parametrize("n", [3, 40])
def test_flatten_traced_by_dynamo_equals_eager(n):
    """Under torch.compile (fullgraph) the walks give the eager leaves and structure (bulk paths included)."""
    t = _state_like(n)

    def walk(t):
        xs, spec = tree.flatten(t)
        doubled = spec.unflatten([x * 2 if isinstance(x, torch.Tensor) else x for x in xs])
        return xs, doubled, spec.flatten_up_to(doubled), tree.leaves(t)

    got = torch.compile(walk, backend="eager", fullgraph=True)(t)
    ref = walk(t)
    assert optree.tree_structure(got) == optree.tree_structure(ref)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(ref)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert list(got[1][0]) == list(t[0])  # the template's key order


def test_walks_cost_dynamo_few_bytecodes_per_leaf_of_a_param_dict(monkeypatch):
    """Dynamo steps through bytecodes one by one (and inlines calls at a far higher cost): the walks
    take a node whose children are all tensors whole, so tracing `flatten` and `leaves` does not grow
    with its size, and `unflatten` only by the dict's construction (Dynamo's `dict(zip(...))` is a
    polyfill: ~9 bytecodes per entry). The recursive walks cost ~40 bytecodes and two inlined calls
    per leaf and walk (this test fails on them: 15480 more bytecodes for 180 more leaves)."""
    symbolic_convert = pytest.importorskip("torch._dynamo.symbolic_convert")
    base = symbolic_convert.InstructionTranslatorBase
    if not hasattr(base, "step"):
        pytest.skip("this torch's Dynamo has no per-bytecode step to count")
    steps = []
    original = base.step

    def counting_step(self):
        steps[-1] += 1
        return original(self)

    monkeypatch.setattr(base, "step", counting_step)

    def traced_bytecodes(fn, n: int) -> int:
        """Bytecodes Dynamo steps through to trace `fn` on `_state_like(n)`."""
        torch._dynamo.reset()
        steps.append(0)
        torch.compile(fn, backend="eager", fullgraph=True)(_state_like(n))
        return steps[-1]

    more_leaves = 3 * (64 - 4)  # three param dicts of 64 tensors instead of 4
    for fn, per_leaf in [
        (lambda t: (tree.leaves(t), tree.flatten(t)[0]), 0),
        (lambda t: tree.flatten(t)[1].unflatten(tree.leaves(t)), 12),
    ]:
        small, large = traced_bytecodes(fn, 4), traced_bytecodes(fn, 64)
        assert small > 0
        assert large - small <= per_leaf * more_leaves + 30, (small, large)
