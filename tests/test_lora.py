"""LoRA (`functrain.nn.lora`) against PEFT on the same numbers: the same losses and adapters after 20 AdamW
steps on tiny transformers models, the base never written, merged and PEFT exports giving functrain's logits."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from _tol import adam_gain, assert_close, rtol, trajectory_atol
from functrain import init_state, optim
from functrain.nn import lora
from functrain.step import make_train_step

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

STEPS, LR, EPS, WD = 20, 1e-2, 1e-3, 0.01  # eps 1e-3: Adam's gain lr/eps bounded (tests/_tol.py)
B, T = 4, 16


def _tiny(model_type: str):
    """A tiny random transformers causal LM (fixed seed)."""
    from functrain.models.hf.tiny import TINY

    values = dict(TINY)
    if model_type == "gpt2":  # no dropout in the base: torch's draws and the step's keyed ones differ
        values.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config = transformers.AutoConfig.for_model(model_type, **values)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.eval()


def _batches():
    """STEPS batches of learnable byte sequences (each id the previous one plus 7, from a random start)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (B, 1), generator=g) + 7 * torch.arange(T + 1)) % 256 for _ in range(STEPS)]


def _peft_run(base, targets, batches):
    """PEFT's model trained by torch.optim.AdamW: (its initial adapters by functrain's names, losses, adapters)."""
    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    model = peft.get_peft_model(copy.deepcopy(base), cfg)
    model.train()
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ours = {n.removeprefix(lora.PEFT_PREFIX).replace(".default.", "."): p for n, p in named.items()}
    initial = {n: p.detach().clone() for n, p in ours.items()}
    opt = torch.optim.AdamW(list(named.values()), lr=LR, eps=EPS, weight_decay=WD)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return initial, losses, {n: p.detach().clone() for n, p in ours.items()}


def _functrain_run(base, spec, adapters, batches, compile=False):
    """functrain's step on the wrapped model: (losses, adapters, frozen base after, state)."""
    model = lora.wrap(base, spec)
    trained, frozen = lora.split({n: p.detach().clone() for n, p in model.named_parameters()})
    assert sorted(trained) == sorted(adapters)
    before = {n: v.clone() for n, v in frozen.items()}

    def loss_fn(params, ids, key):
        import functrain

        return functrain.apply(model, params, input_ids=ids[:, :-1], labels=ids[:, :-1]).loss, {}

    state = init_state(dict(adapters), optim.adamw(LR, eps=EPS, weight_decay=WD), frozen=frozen)
    step = make_train_step(loss_fn, optim.adamw(LR, eps=EPS, weight_decay=WD), compile=compile)
    losses = []
    for ids in batches:
        state, m = step(state, ids)
        losses.append(float(m["loss"]))
    return losses, state, before


@pytest.mark.parametrize("model_type,targets", [("qwen2", ["q_proj", "v_proj"]), ("qwen2", "all-linear"),
                                                ("gpt2", ["c_attn"]), ("gpt2", "all-linear")])
def test_lora_trains_equal_to_peft(model_type, targets):
    """20 AdamW steps, r=8 alpha=16: the same losses and adapter weights as PEFT trained by torch.optim.AdamW;
    the frozen base bitwise as it was; its optimizer state holds the adapters only."""
    base = _tiny(model_type)
    batches = _batches()
    initial, peft_losses, peft_adapters = _peft_run(base, targets, batches)
    regex = targets if isinstance(targets, str) else "|".join(targets)
    spec = lora.LoraSpec(rank=8, alpha=16, targets=regex)
    losses, state, before = _functrain_run(base, spec, initial, batches)
    assert sorted(state.params) == sorted(peft_adapters)  # the same layers adapted as PEFT's
    n = T * 128
    assert_close(torch.tensor(losses), torch.tensor(peft_losses), rtol(n) * STEPS)
    scale = max(v.abs().max().item() for v in peft_adapters.values())
    atol = trajectory_atol(steps=STEPS, gain=adam_gain(LR, EPS), grad_scale=1.0, n=n)
    assert_close(state.params, peft_adapters, atol, absolute=True, msg=f"adapters (scale {scale:.3g})")
    assert losses[-1] < losses[0] - 0.05  # it trained
    assert all(torch.equal(state.frozen[k], before[k]) for k in before)  # the base: bitwise unchanged
    opt_names = {".".join(map(str, p)) for p in __import__("optree").tree_paths(state.opt_state)}
    assert not any(k in name for name in opt_names for k in before)  # no optimizer state for the base


def test_init_adapters_draw_pefts_distribution_and_a_fresh_adapter_changes_nothing():
    """A ~ U(±1/√in) (kaiming-uniform, a=√5), B = 0: the wrapped model's logits equal the base's exactly."""
    import functrain
    from functrain import rng

    base = _tiny("qwen2")
    spec = lora.LoraSpec(rank=8, alpha=16, targets="all-linear")
    model = lora.wrap(base, spec)
    adapters = lora.init_adapters(model, rng.key(0))
    for name, value in adapters.items():
        if name.endswith("lora_A.weight"):
            bound = 1.0 / math.sqrt(value.shape[1])
            assert value.abs().max() <= bound and value.abs().max() > 0.9 * bound
            assert abs(value.mean().item()) < 0.1 * bound
        else:
            assert not value.any()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    base_params = {n: p.detach() for n, p in base.named_parameters()}
    with torch.no_grad():
        want = base(input_ids=ids).logits
        got = functrain.apply(model, {**base_params, **adapters}, input_ids=ids).logits
    assert torch.equal(got, want)
    assert lora.init_adapters(model, rng.key(0)).keys() == adapters.keys()
    assert all(torch.equal(a, b) for a, b in zip(lora.init_adapters(model, rng.key(0)).values(), adapters.values()))


def test_targets_that_match_nothing_are_refused_in_one_line():
    """A regex naming no linear layer: one line listing the layers' names."""
    with pytest.raises(ValueError, match=r"matches no linear layer .*q_proj"):
        lora.wrap(_tiny("qwen2"), lora.LoraSpec(targets="query"))
