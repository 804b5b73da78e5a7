"""functrain.compiler.saved_steps: the key's fingerprint and when a step is saved whole.

A saved step's load across processes, its numbers against a plain `torch.compile` and the guards
it checks at load are in tests/test_compile_cache.py (real compiles in subprocesses).
"""

from __future__ import annotations

import functools

import pytest
import torch

from functrain.compiler import cache as compile_cache
from functrain.compiler import saved_steps
from functrain.compiler.saved_steps import fingerprint
from functrain.models import gpt

SCALE = 2.0  # a global the functions below read


def _scaled(x):
    return x * SCALE


def _doubled(x):
    return x * 2.0


def _mlp(act: torch.nn.Module, width: int = 8) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, width), act, torch.nn.Linear(width, 1))


def _closing_over(model, factor):
    def loss(x):
        return model(x).sum() * factor

    return loss


def test_the_same_step_built_twice_has_one_fingerprint():
    def build():
        with torch.device("meta"):
            template = gpt.GPT(gpt.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
        return gpt.make_loss_fn(template)

    assert fingerprint(build()) == fingerprint(build())
    one, two = _closing_over(_mlp(torch.nn.Tanh()), 1.0), _closing_over(_mlp(torch.nn.Tanh()), 1.0)
    assert fingerprint(one) == fingerprint(two)


def test_what_the_graph_is_built_from_changes_it():
    base = fingerprint(_closing_over(_mlp(torch.nn.Tanh()), 1.0))
    assert fingerprint(_closing_over(_mlp(torch.nn.ReLU()), 1.0)) != base  # another module, the same shapes
    assert fingerprint(_closing_over(_mlp(torch.nn.Tanh(), width=9), 1.0)) != base  # another shape
    assert fingerprint(_closing_over(_mlp(torch.nn.Tanh()).double(), 1.0)) != base  # another dtype
    assert fingerprint(_scaled) != fingerprint(_doubled)  # other code
    assert fingerprint(functools.partial(_scaled)) != fingerprint(functools.partial(_doubled))


def test_a_global_counts_by_value_a_closed_over_number_by_type(monkeypatch):
    """A saved step's guards check the closed-over numbers the trace reads; guards on globals are not saved."""
    before = fingerprint(_scaled)
    monkeypatch.setattr(__import__(__name__), "SCALE", 3.0)
    assert fingerprint(_scaled) != before
    model = _mlp(torch.nn.Tanh())
    assert fingerprint(_closing_over(model, 1.0)) == fingerprint(_closing_over(model, 5.0))
    assert fingerprint(_closing_over(model, 1.0)) != fingerprint(_closing_over(model, 1))  # a float, an int


def test_tensors_count_by_metadata_not_values():
    a, b = _mlp(torch.nn.Tanh()), _mlp(torch.nn.Tanh())
    with torch.no_grad():
        b[0].weight.add_(1.0)
    assert fingerprint(a) == fingerprint(b)
    b[0].weight.requires_grad_(False)
    assert fingerprint(a) != fingerprint(b)


def test_cycles_and_shared_objects_are_walked_once():
    loop: dict = {"x": 1}
    loop["self"] = loop
    shared = _mlp(torch.nn.Tanh())
    assert fingerprint(loop) == fingerprint(loop)
    assert fingerprint([shared, shared]) != fingerprint([shared, _mlp(torch.nn.Tanh())])  # one module twice


@pytest.fixture
def set_up(monkeypatch, tmp_path):
    """`compile_cache.setup` into tmp_path, undone after the test (the environment and the module's state)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/placeholder")
    for name in ("_set_by_setup", "_set_by_user", "_steps_dir"):
        monkeypatch.setattr(compile_cache, name, getattr(compile_cache, name))
    return compile_cache.setup(str(tmp_path / "cache"))


def test_steps_are_saved_under_setup_and_not_when_off(set_up):
    assert compile_cache.saved_steps_dir() == set_up / "steps"
    compile_cache.setup("off")
    assert compile_cache.saved_steps_dir() is None


def _tiny_step():
    w = torch.linspace(-1, 1, 6).reshape(2, 3)

    def tiny_step(x):
        return (x @ w).tanh().sum(0)

    return tiny_step


def test_a_second_build_of_the_step_loads_it_without_a_trace(set_up):
    from torch._dynamo.utils import counters

    from functrain import compiler

    x = torch.linspace(0, 1, 8).reshape(4, 2)
    before, frames = saved_steps.stats(), counters["stats"]["unique_graphs"]
    first = compiler.maybe_compile(_tiny_step(), True, None)(x)
    assert saved_steps.stats()["miss"] == before["miss"] + 1
    assert len(list((set_up / "steps").glob("tiny_step-*.pt2step"))) == 1
    traced = counters["stats"]["unique_graphs"]
    second = compiler.maybe_compile(_tiny_step(), True, None)(x)  # a new closure, a new torch.compile
    assert saved_steps.stats()["hit"] == before["hit"] + 1
    assert counters["stats"]["unique_graphs"] == traced > frames  # loaded: nothing traced
    assert torch.equal(first, second) and torch.equal(first, _tiny_step()(x))


def test_a_step_that_cannot_be_saved_runs_and_says_so(set_up, monkeypatch):
    from torch._dynamo.aot_compile import AOTCompiledFunction

    from functrain import compiler

    def refuse(*args, **kwargs):
        raise RuntimeError("Failed to serialize the following objects")

    monkeypatch.setattr(AOTCompiledFunction, "save_compiled_function", refuse)
    x = torch.linspace(0, 1, 8).reshape(4, 2)
    with pytest.warns(UserWarning, match="functrain: note: the compiled step tiny_step is not saved whole"):
        out = compiler.maybe_compile(_tiny_step(), True, None)(x)
    assert torch.equal(out, _tiny_step()(x))
    assert not list((set_up / "steps").glob("*.pt2step"))


def _with_a_local_class():
    class Rotate(torch.nn.Module):  # local, as the `Func` modules the `kernels` package hangs on transformers' layers
        def forward(self, x):
            return torch.cat((-x[..., 1:], x[..., :1]), dim=-1)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Rotate())
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, -2.0], [0.5, 3.0]]))
        model[0].bias.zero_()

    def local_step(x):
        return model(x).tanh().sum(0)

    return local_step


def test_a_module_of_a_local_class_is_saved_and_loaded(set_up):
    """Dynamo checks such a module's type with a guard torch cannot write down: the filter drops it (the class's
    name is in the key), so the step is saved and loaded, not refused by `aot_compile`."""
    from functrain import compiler

    x = torch.linspace(0, 1, 8).reshape(4, 2)
    before = saved_steps.stats()
    first = compiler.maybe_compile(_with_a_local_class(), True, None)(x)
    assert len(list((set_up / "steps").glob("local_step-*.pt2step"))) == 1
    second = compiler.maybe_compile(_with_a_local_class(), True, None)(x)
    assert saved_steps.stats() == {"hit": before["hit"] + 1, "miss": before["miss"] + 1}
    assert torch.equal(first, second)
    torch.testing.assert_close(first, _with_a_local_class()(x))  # (compiled vs eager: tanh's kernels differ)


def test_a_step_whose_guards_cannot_be_saved_runs_compiled_and_says_so(set_up, monkeypatch):
    from functrain import compiler

    monkeypatch.setattr(saved_steps, "_serializable_guards", lambda entries: [True] * len(entries))  # keep them all
    x = torch.linspace(0, 1, 8).reshape(4, 2)
    step = compiler.maybe_compile(_with_a_local_class(), True, None)
    with pytest.warns(UserWarning, match="functrain: note: the compiled step local_step is not saved whole"):
        out = step(x)
    assert torch.equal(step(x), out)
    torch.testing.assert_close(out, _with_a_local_class()(x))
    assert not list((set_up / "steps").glob("*.pt2step"))


def test_usable_only_for_inductor_with_caches_on():
    compiled = torch.compile(_doubled)
    args = (torch.ones(2),)
    assert saved_steps.usable(compiled, None, args)
    assert not saved_steps.usable(compiled, {"backend": "eager"}, args)
    assert not saved_steps.usable(compiled, {"options": {"triton.cudagraphs": True}}, args)
    assert not saved_steps.usable(_doubled, None, args)  # not a torch.compile'd function
    with torch._inductor.config.patch(force_disable_caches=True):
        assert not saved_steps.usable(compiled, None, args)


@pytest.mark.parametrize("hit", [0, 1])
def test_stats_count_in_the_report(hit, monkeypatch):
    from torch._dynamo.utils import counters

    before = compile_cache.stats()
    monkeypatch.setitem(counters["functrain"], "saved_step_hit", counters["functrain"]["saved_step_hit"] + hit)
    monkeypatch.setitem(counters["functrain"], "saved_step_miss", counters["functrain"]["saved_step_miss"] + 1 - hit)
    line = compile_cache.report("/c", since=before)
    assert f"whole steps {hit}/{1 - hit}" in line and f"{hit} hits, {1 - hit} misses" in line
