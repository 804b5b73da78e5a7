"""functrain.functional.apply against torch.func.functional_call: the same outputs and gradients
(tied weights included), a tied parameter under either name, one clear error for two different
tensors under tied names, and one compiled graph that never walks the module's parameters."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from functrain import functional
from functrain.models.gpt import cross_entropy


@pytest.fixture
def model(tiny_gpt):
    return tiny_gpt(n_layer=2, bias=True)


@pytest.fixture
def batch(model, batches):
    return batches(model.cfg, 1, batch_size=3)[0]


def _params(model, scale=1.0):
    """The model's parameters (tied ones once, as the state holds them), scaled: not the module's own tensors."""
    return {n: p.detach() * scale for n, p in model.named_parameters()}


def test_tied_names_are_the_groups_of_one_tensor(model):
    assert functional.tied_names(model) == (("wte.weight", "lm_head.weight"),)
    assert functional.tied_names(torch.nn.Linear(2, 2)) == ()


def test_apply_equals_functional_call_in_outputs_and_grads(model, batch):
    x, y = batch
    params = _params(model, 0.5)  # other values than the module's: the swap must happen

    def loss(f, p):
        return cross_entropy(f(model, p, (x,)), y)

    ours = torch.func.grad_and_value(lambda p: loss(lambda m, q, a: functional.apply(m, q, *a), p))(params)
    ref = torch.func.grad_and_value(lambda p: loss(torch.func.functional_call, p))(params)
    assert torch.equal(ours[1], ref[1])
    assert ours[0].keys() == ref[0].keys() == params.keys()
    for name in params:  # wte.weight's gradient has both the embedding's and the head's share
        assert torch.equal(ours[0][name], ref[0][name]), name
    assert not torch.equal(functional.apply(model, _params(model), x), functional.apply(model, params, x))


def test_a_tied_parameter_may_come_under_any_of_its_names(model, batch):
    x, _ = batch
    params = _params(model, 0.5)
    by_head = {("lm_head.weight" if n == "wte.weight" else n): p for n, p in params.items()}
    assert torch.equal(functional.apply(model, by_head, x), functional.apply(model, params, x))


def test_two_tensors_under_tied_names_is_one_clear_error(model, batch):
    x, _ = batch
    params = {**_params(model), "lm_head.weight": torch.zeros_like(model.lm_head.weight)}
    with pytest.raises(
        ValueError, match=r"tied parameters \['wte.weight', 'lm_head.weight'\] were given different tensors"
    ):
        functional.apply(model, params, x)


def test_compiled_apply_is_one_graph_and_never_walks_the_parameters(model, batch, monkeypatch):
    """The tied names are a constant of the module, computed once outside the trace
    (assume_constant_result); functional_call's own tying walks the parameters in traced Python.
    Here a walk that Dynamo traced would meet a compiler-disabled function: a graph break, which
    fullgraph=True turns into an error."""
    x, _ = batch
    p1, p2 = _params(model, 0.5), _params(model, 2.0)
    want1, want2 = functional.apply(model, p1, x), functional.apply(model, p2, x)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    named = torch.nn.Module.named_parameters
    monkeypatch.setattr(
        torch.nn.Module, "named_parameters", torch.compiler.disable(lambda self, *a, **k: named(self, *a, **k))
    )
    f = torch.compile(lambda p, x: functional.apply(model, p, x), backend=counter, fullgraph=True)
    assert torch.equal(f(p1, x), want1)
    assert torch.equal(f(p2, x), want2)
    assert counter.frame_count == 1  # no recompile
    g = torch.compile(lambda p, x: torch.func.functional_call(model, p, (x,)), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="disable"):  # the check can fail: torch's own tying walks in the trace
        g(p1, x)
