"""chunked_cross_entropy and gpt_loss against the plain full-logits cross-entropy."""

from __future__ import annotations

import _tol
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from functrain import apply, make_train_step, optim, rng
from functrain import tree as tree_lib
from functrain.losses import chunked_cross_entropy
from functrain.models import gpt, lm
from functrain.models.gpt import gpt_hidden, gpt_loss
from functrain.models.gpt import make_loss_fn as make_gpt_loss_fn
from functrain.state import init_state
from functrain.step import value_and_grad

pytestmark = pytest.mark.numeric


def _problem(n=37, c=16, v=50, dtype=torch.float32, ignore_every=5, seed=0):
    """hidden (n, c), weight (v, c), targets (n,) with every `ignore_every`-th target = -1."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, c, generator=g).to(dtype)
    w = torch.randn(v, c, generator=g).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        t[::ignore_every] = -1
    return h, w, t


def _reference(h, w, t, ignore_index=-1):
    """F.cross_entropy over the full float32 logits."""
    return F.cross_entropy((h @ w.t()).float(), t, ignore_index=ignore_index)


def _grads(loss_fn, h, w):
    """((grad_h, grad_w), loss) with torch.func.grad_and_value."""
    return torch.func.grad_and_value(loss_fn, argnums=(0, 1))(h, w)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 37, 1000])
def test_matches_reference_loss_and_grads(chunk_size):
    h, w, t = _problem()
    (gh, gw), loss = _grads(lambda a, b: chunked_cross_entropy(a, b, t, chunk_size=chunk_size), h, w)
    (rh, rw), ref = _grads(lambda a, b: _reference(a, b, t), h, w)
    assert loss.dtype == torch.float32 and loss.ndim == 0
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh, rh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, rw, atol=1e-5, rtol=1e-5)
    assert gh[::5].abs().max() == 0  # ignored positions get no gradient


def test_batched_shape_other_ignore_index_and_autograd_backward():
    h, w, t = _problem(n=24, ignore_every=0)
    t[3] = t[10] = 7  # ignore_index=7 must drop exactly these (and any other 7s)
    hb, tb = h.reshape(2, 12, -1), t.reshape(2, 12)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = chunked_cross_entropy(h1.reshape(2, 12, -1), w1, tb, chunk_size=5, ignore_index=7)
    loss.backward()
    ref = _reference(h2, w2, t, ignore_index=7)
    ref.backward()
    assert hb.shape == (2, 12, 16)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=1e-5)


def test_gradcheck_float64():
    h, w, t = _problem(n=9, c=4, v=6, dtype=torch.float64, ignore_every=4)
    fn = lambda a, b: chunked_cross_entropy(a, b, t, chunk_size=4)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (h.requires_grad_(), w.requires_grad_()))


def test_bfloat16_inputs_follow_the_reference():
    h, w, t = _problem(n=64, c=32, v=100, dtype=torch.bfloat16)
    (gh, gw), loss = _grads(lambda a, b: chunked_cross_entropy(a, b, t, chunk_size=16), h, w)
    (rh, rw), ref = _grads(lambda a, b: _reference(a, b, t), h, w)
    assert loss.dtype == torch.float32 and gh.dtype == gw.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gh.float(), rh.float(), atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(gw.float(), rw.float(), atol=2e-3, rtol=2e-2)


def test_all_targets_ignored_gives_zero_and_zero_grads_where_the_reference_gives_nan():
    """A microbatch of prompts only adds nothing to a step weighted by its targets: 0, never NaN."""
    h, w, t = _problem(n=8)
    t[:] = -1
    (gh, gw), loss = _grads(lambda a, b: chunked_cross_entropy(a, b, t, chunk_size=3), h, w)
    assert loss == 0 and torch.isnan(_reference(h, w, t))
    assert gh.abs().max() == 0 and gw.abs().max() == 0
    (gh, gw), loss = _grads(lambda a, b: lm.cross_entropy((a @ b.t())[None], t[None]), h, w)
    assert loss == 0 and gh.abs().max() == 0 and gw.abs().max() == 0


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_vmap_per_example_losses_and_grads():
    _, w, t = _problem()
    hb = torch.randn(3, 37, 16, generator=torch.Generator().manual_seed(1))
    ours = torch.vmap(lambda a: chunked_cross_entropy(a, w, t, chunk_size=8))(hb)
    ref = torch.stack([_reference(a, w, t) for a in hb])
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    g = torch.vmap(torch.func.grad(lambda a: chunked_cross_entropy(a, w, t, chunk_size=8)))(hb)
    r = torch.vmap(torch.func.grad(lambda a: _reference(a, w, t)))(hb)
    torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


class _LargestOutput(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op returns."""

    def __init__(self):
        """Starts at zero."""
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Runs the op and records its outputs' sizes."""
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor):
                self.max_numel = max(self.max_numel, o.numel())
        return out


@pytest.mark.parametrize("chunk_size", [0, 16])
def test_full_logits_never_materialize_forward_or_backward(chunk_size):
    n, c, v = 64, 8, 1000  # N*V = 64000 > chunk*V = 16000 > V*C = 8000
    h, w, t = _problem(n=n, c=c, v=v)
    if chunk_size:
        fn = lambda a, b: chunked_cross_entropy(a, b, t, chunk_size=chunk_size)  # noqa: E731
    else:
        fn = lambda a, b: _reference(a, b, t)  # noqa: E731
    with _LargestOutput() as mode:
        _grads(fn, h, w)
    if chunk_size:
        assert mode.max_numel <= chunk_size * v
    else:  # the probe sees the plain loss's (N, V) logits: the check above can fail
        assert mode.max_numel >= n * v


@pytest.mark.slow
def test_compiled_grad_and_value_fullgraph_matches_eager():
    h, w, t = _problem(n=40)
    fn = torch.func.grad_and_value(lambda a, b: chunked_cross_entropy(a, b, t, chunk_size=16), argnums=(0, 1))
    (gh, gw), loss = torch.compile(fn, fullgraph=True, dynamic=False)(h, w)
    (rh, rw), ref = _grads(lambda a, b: _reference(a, b, t), h, w)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh, rh, atol=1e-5, rtol=1e-5)
    # Guards the needs_input_grad pitfall (weight grads came back zero when compiled).
    torch.testing.assert_close(gw, rw, atol=1e-5, rtol=1e-5)


def test_bad_arguments():
    h, w, t = _problem()
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_cross_entropy(h, w, t, chunk_size=0)
    with pytest.raises(ValueError, match="weight"):
        chunked_cross_entropy(h, w[:, :3], t)
    with pytest.raises(ValueError, match="targets"):
        chunked_cross_entropy(h, w, t[:5])


def _template_and_params(bias, dropout=0.0, seed=0):
    """A meta GPT template and real params for it."""
    cfg = gpt.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=dropout, bias=bias)
    with torch.device("meta"):
        template = gpt.GPT(cfg)
    return template, gpt.init_params(template, rng.key(seed))


@pytest.mark.parametrize("bias,dropout", [(False, 0.0), (True, 0.1)])
def test_gpt_hidden_is_the_forward_without_the_head(bias, dropout):
    template, params = _template_and_params(bias, dropout)
    x = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    key = rng.key(5)
    logits = apply(template, params, x, dropout_key=key)
    hidden = gpt_hidden(template, params, x, key)
    assert hidden.shape == (3, 16, 32)
    torch.testing.assert_close(hidden @ params["wte.weight"].t(), logits, atol=0, rtol=0)


def test_gpt_loss_chunked_equals_plain_with_grads():
    template, params = _template_and_params(bias=True, dropout=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
    y[:, :3] = -1
    key = rng.key(3)

    def reference(p, batch, k):
        """The model's own forward + models.gpt.cross_entropy."""
        return gpt.cross_entropy(apply(template, p, batch[0], dropout_key=k), batch[1])

    ref, _, ref_g = value_and_grad(reference, params, (x, y), key)
    tol = _tol.rtol(x.numel() * 4 * 32)  # weight grads sum over the tokens through 4C-wide matmuls
    for chunk_size in (0, 10):
        loss, _, grads = value_and_grad(make_gpt_loss_fn(template, chunk_size=chunk_size), params, (x, y), key)
        _tol.assert_close(loss, ref, tol, msg="loss")
        assert list(grads) == list(params)
        _tol.assert_close(grads, ref_g, tol, msg=f"chunk_size={chunk_size}")
    assert gpt_loss(template, params, x, y, key, chunk_size=10).dtype == torch.float32


def test_train_steps_with_chunked_loss_follow_the_plain_loss():
    template, params = _template_and_params(bias=False)
    # SGD: a gradient difference moves the params in proportion (Adam would turn the rounding noise of
    # near-zero gradients into full-size steps; tests/_tol.py).
    lr, momentum, steps = 0.1, 0.9, 4
    opt = optim.sgd(lr, momentum=momentum)
    g = torch.Generator().manual_seed(2)
    batches = [(x, (3 * x + 1) % 64) for x in (torch.randint(0, 64, (8, 16), generator=g) for _ in range(steps))]
    runs = {}
    for chunk_size in (0, 24):
        step = make_train_step(make_gpt_loss_fn(template, chunk_size=chunk_size), opt, compile=False)
        state = init_state(tree_lib.clone(params), opt, seed=0)
        losses = []
        for b in batches:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        runs[chunk_size] = (losses, state.params)
    assert runs[0][0][-1] < runs[0][0][0]
    n = 8 * 16 * 4 * 32  # tokens x the widest matmul
    _, _, grads = value_and_grad(make_gpt_loss_fn(template), params, batches[0], None)
    gmax = max(float(v.abs().max()) for v in grads.values())
    _tol.assert_close(torch.tensor(runs[24][0]), torch.tensor(runs[0][0]), _tol.rtol(n) * steps, msg="losses")
    atol = _tol.trajectory_atol(steps=steps, gain=_tol.sgd_gain(lr, momentum), grad_scale=gmax, n=n)
    _tol.assert_close(runs[24][1], runs[0][1], atol, absolute=True, msg="params")
