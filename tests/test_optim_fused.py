"""adamw(fused=True): the eager, donated step runs torch's fused AdamW kernel in place; it equals the
chain's update (and torch.optim.AdamW(fused=True) after clip_grad_norm_) to float32 rounding, skips a
non-finite step the same way, and stays out of the way where it cannot run."""

from __future__ import annotations

import pytest
import torch

from functrain import init_state, make_train_step, optim, tree
from functrain.step.update import update_step

pytestmark = pytest.mark.numeric

STEPS, LR, WD, CLIP, BETAS, EPS = 8, 1e-2, 0.1, 0.5, (0.9, 0.95), 1e-8
EPS32 = torch.finfo(torch.float32).eps


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(48, 32, generator=g),
        "b": torch.randn(32, generator=g),
        "h.w": torch.randn(16, 48, generator=g),
    }


def _mask(params):
    return {k: v.ndim >= 2 for k, v in params.items()}


def _opt(fused, clip=True):
    adamw = optim.adamw(optim.warmup_cosine(LR, 3, 20, init_value=LR / 4), *BETAS, EPS, WD, mask=_mask, fused=fused)
    return optim.chain(optim.clip_by_global_norm(CLIP), adamw) if clip else adamw


def _grads(params, n=STEPS, seed=1, nan_at=None):
    g = torch.Generator().manual_seed(seed)
    out = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(n)]
    if nan_at is not None:
        out[nan_at]["b"][3] = float("nan")
    return out


def _atol(params, steps=STEPS):
    """Per update: a few ulp of the update (<= lr (1 + wd |p|)) and the rounding of p + u; summed over the steps.
    The kernel's float32 bias corrections add eps32 / (1 - b2) relative at the first steps."""
    pmax = max(float(p.abs().max()) for p in params.values())
    return steps * (LR * (1 + WD * pmax) * (16 * EPS32 + EPS32 / (1 - BETAS[1])) + EPS32 * pmax)


@pytest.mark.parametrize("clip", [True, False], ids=["clipped", "plain"])
def test_fused_route_equals_the_chain_and_skips_a_nonfinite_step(clip):
    params = _params()
    ref_state = init_state(tree.clone(params), _opt(False, clip))
    state = init_state(tree.clone(params), _opt(True, clip))
    ref_update, update = update_step(_opt(False, clip), compile=False), update_step(_opt(True, clip), compile=False)
    before = [x.data_ptr() for x in tree.leaves((state.params, state.opt_state))]
    lrs = []
    for i, g in enumerate(_grads(params, nan_at=4)):
        ref_state, ref_m = ref_update(ref_state, tree.clone(g), {"loss": torch.tensor(2.0)})
        state, m = update(state, tree.clone(g), {"loss": torch.tensor(2.0)})
        assert set(ref_m) - set(m) == {"update_norm"}  # the kernel does not expose the update
        assert float(m["skipped"]) == float(ref_m["skipped"]) == (1.0 if i == 4 else 0.0)
        torch.testing.assert_close(m["grad_norm"], ref_m["grad_norm"], rtol=0, atol=0, equal_nan=True)
        lrs.append((m["lr"], ref_m["lr"]))
    # read after every step ran (as a loop that logs every n steps reads them): each step's own learning rate,
    # not the state's buffer the kernel writes in place
    assert [float(a) for a, _ in lrs] == pytest.approx([float(b) for _, b in lrs], rel=EPS32)
    assert len({float(b) for _, b in lrs}) > 2  # (the warm-up and cosine change it every step but the skipped one)
    assert [x.data_ptr() for x in tree.leaves((state.params, state.opt_state))] == before  # in place
    atol = _atol(params)
    for k in params:
        torch.testing.assert_close(state.params[k], ref_state.params[k], rtol=0, atol=atol, msg=k)
        assert not torch.equal(state.params[k], params[k])
    adam, ref_adam = (s[1][0] if clip else s[0] for s in (state.opt_state, ref_state.opt_state))
    assert int(adam.count) == int(ref_adam.count) == STEPS - 1  # the skipped step did not count
    for k in params:
        torch.testing.assert_close(adam.nu[k], ref_adam.nu[k], rtol=8 * EPS32, atol=0)
    assert int(state.guard.skipped) == 1 and int(state.step) == STEPS


def test_fused_route_equals_torch_fused_adamw_after_clip_grad_norm():
    params = _params(seed=2)
    state = init_state(tree.clone(params), _opt(True))
    update = update_step(_opt(True), compile=False)
    theirs = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    groups = [
        {"params": [p for p in theirs.values() if p.ndim >= 2], "weight_decay": WD},
        {"params": [p for p in theirs.values() if p.ndim < 2], "weight_decay": 0.0},
    ]
    topt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)
    sched = optim.warmup_cosine(LR, 3, 20, init_value=LR / 4)
    for i, g in enumerate(_grads(params, seed=3)):
        state, _ = update(state, tree.clone(g), {"loss": torch.tensor(1.0)})
        for k, p in theirs.items():
            p.grad = g[k].clone()
        torch.nn.utils.clip_grad_norm_(list(theirs.values()), CLIP)
        for group in topt.param_groups:
            group["lr"] = float(sched(torch.tensor(i)))
        topt.step()
    for k, p in theirs.items():
        torch.testing.assert_close(state.params[k], p.detach(), rtol=0, atol=_atol(params), msg=k)


def test_the_eager_train_step_takes_the_route_in_place_or_on_a_copy(tiny_gpt, batches, gpt_loss_fn):
    """Donating, the kernel writes into the state's buffers; not donating, into a copy of them: the same numbers,
    the input untouched. `adamw()` (the kernel in eager steps) reports the update's norm, `fused=True` does not."""
    model = tiny_gpt(n_layer=1)
    loss_fn = gpt_loss_fn(model)
    batch = batches(model.cfg, 1)[0]
    donating = make_train_step(loss_fn, _opt(True), compile=False, donate=True)
    keeping = make_train_step(loss_fn, _opt(True), compile=False, donate=False)
    donated, m_donating = donating(init_state(model, _opt(True)), batch)
    state = init_state(model, _opt(True))
    snapshot = tree.clone(state)
    kept, m_keeping = keeping(state, batch)
    assert "update_norm" not in m_donating and "update_norm" not in m_keeping  # both the kernel's route
    for a, b in zip(tree.leaves(state), tree.leaves(snapshot)):
        assert torch.equal(a, b)  # donate=False: the input is untouched
    for a, b in zip(tree.leaves(donated), tree.leaves(kept)):
        assert torch.equal(a, b)
    auto = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
    new, m = make_train_step(loss_fn, auto, compile=False)(init_state(model, auto), batch)
    start = init_state(model, auto).params
    delta = torch.linalg.vector_norm(torch.cat([(new.params[k] - start[k]).flatten() for k in start]))
    torch.testing.assert_close(m["update_norm"], delta)


def test_tensors_the_kernel_does_not_take_run_the_chain():
    params = {"w": torch.randn(4, 4), "b": torch.randn(4, dtype=torch.float64)}  # two dtypes
    state = init_state(tree.clone(params), _opt(True))
    _, m = update_step(_opt(True), compile=False)(state, {k: torch.ones_like(v) for k, v in params.items()})
    assert "update_norm" in m


def test_fused_with_narrow_moments_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"^adamw\(fused=True\) keeps Adam's moments in the params' dtype"):
        optim.adamw(1e-3, mu_dtype=torch.bfloat16, fused=True)


def test_fused_route_reads_hyperparameters_once_and_sees_new_values():
    """The kernel takes betas, eps and decay as Python floats: the route reads them from their tensors
    (a host sync on a GPU) at the first update only, and again after `set_hyperparams` replaces them,
    whose new values the update then uses (it still equals the chain's)."""
    from _host_reads import Reads, counting

    params = _params(seed=3)
    ref_state = init_state(tree.clone(params), _opt(False))
    state = init_state(tree.clone(params), _opt(True))
    ref_update, update = update_step(_opt(False), compile=False), update_step(_opt(True), compile=False)
    reads = Reads()
    for i, g in enumerate(_grads(params)):
        if i == 4:
            ref_state = optim.set_hyperparams(ref_state, b2=0.5, weight_decay=0.3)
            state = optim.set_hyperparams(state, b2=0.5, weight_decay=0.3)
        ref_state, _ = ref_update(ref_state, tree.clone(g), {"loss": torch.tensor(2.0)})
        reads.label = i
        with counting(reads):
            state, _ = update(state, tree.clone(g), {"loss": torch.tensor(2.0)})
        reads.label = None
    assert reads.counts[0] > 0 and reads.counts[4] > 0, dict(reads.counts)  # the counter sees the reads
    assert not {i: n for i, n in reads.counts.items() if i not in (0, 4)}, (dict(reads.counts), reads.where)
    atol = _atol(params) / (1 - 0.5)  # b2 = 0.5 for the last steps: the kernel's float32 bias correction
    for k in params:
        torch.testing.assert_close(state.params[k], ref_state.params[k], rtol=0, atol=atol, msg=k)


def test_the_kernel_takes_the_expanded_gradients_autograd_hands_out(monkeypatch):
    """A sum's gradient is an expanded view (stride 0): the kernel gets it dense (it read past the one stored
    number: -lr on some entries of a zero-gradient step), so the step decays the matrices and leaves everything else
    as the chain does."""
    kernel = torch._fused_adamw_
    seen = []

    def spy(params, grads, *args, **kwargs):
        seen.extend(g.is_contiguous() for g in grads)
        return kernel(params, grads, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    params = {"w": torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), "b": torch.randn(8)}
    decay = lambda p: {k: v.ndim == 2 for k, v in p.items()}  # noqa: E731
    loss = lambda p, batch, key: (sum(v.sum() for v in p.values()) * 0.0, {})  # noqa: E731
    out = {}
    for fused in (None, False):
        opt = optim.adamw(1e-2, weight_decay=0.1, mask=decay, fused=fused)
        state, _ = make_train_step(loss, opt, compile=False)(init_state(params, opt), torch.zeros(1))
        out[fused] = state.params
    torch.testing.assert_close(out[None]["w"], params["w"] * (1 - 1e-3), rtol=2e-7, atol=0)
    assert torch.equal(out[None]["b"], params["b"]) and torch.equal(out[False]["b"], params["b"])
    torch.testing.assert_close(out[None]["w"], out[False]["w"], rtol=2e-7, atol=0)
    assert seen and all(seen)
