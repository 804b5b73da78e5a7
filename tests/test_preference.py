"""functrain.preference against TRL's own loss code: `DPOTrainer._compute_loss` driven on the same log-probabilities
(its model's outputs stubbed) and on a transformers model (its fused head, its reference model), the loss, its
gradients and the metrics it logs; then the loss in `make_train_step` (compiled, microbatches) and its three
references (a frozen copy, LoRA's adapters off, log-probs computed beforehand)."""

from __future__ import annotations

import collections
import types

import pytest
import torch
import torch.nn.functional as F
import transformers
from _routes import three_routes
from _tol import assert_close, rtol
from trl.trainer import dpo_trainer as trl_dpo
from trl.trainer.utils import add_fused_lm_head

from functrain import preference

PAIRS, LENGTH = 6, 12


def _batch(seed: int):
    """Per-token log-probs of 2 x PAIRS rows (chosen rows, then rejected: TRL's order), their completion masks
    (prompts and completions of varied lengths, right padding) and reference summed log-probs per row."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * PAIRS
    prompt = torch.randint(1, 5, (rows,), generator=g)
    completion = torch.randint(1, LENGTH - 5, (rows,), generator=g)
    t = torch.arange(LENGTH)
    mask = ((t >= prompt[:, None]) & (t < (prompt + completion)[:, None])).long()  # (2P, T)
    per_token = -torch.rand(rows, LENGTH - 1, generator=g, dtype=torch.float64) * 3  # (2P, T-1): token t+1's
    ref = per_token.sum(1) + torch.randn(rows, generator=g, dtype=torch.float64)  # (2P,)
    return per_token, mask, ref


def _trl(per_token, mask, ref, loss: str, beta: float) -> tuple[torch.Tensor, dict]:
    """TRL's loss and logged metrics for these log-probs: `_compute_loss` on a trainer holding only what it reads."""
    trainer = object.__new__(trl_dpo.DPOTrainer)
    identity = types.SimpleNamespace(device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x)
    outputs = types.SimpleNamespace(
        log_probs=per_token * mask[:, 1:],  # unscored positions: 0, as TRL's fused head gives for label -100
        entropy=torch.zeros_like(per_token),
        mean_logits=torch.zeros_like(per_token),
        is_top1=torch.zeros_like(per_token, dtype=torch.bool),
    )
    model = types.SimpleNamespace(training=True)
    trainer.__dict__.update(
        model=model,
        accelerator=identity,
        beta=beta,
        loss_types=[loss],
        loss_weights=[1.0],
        label_smoothing=0.0,
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        precompute_ref_logps=True,
        use_weighting=False,
        aux_loss_enabled=False,
        _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros_like(mask),
        "attention_mask": torch.ones_like(mask),
        "completion_mask": mask,
        "ref_chosen_logps": ref[:PAIRS],
        "ref_rejected_logps": ref[PAIRS:],
    }
    loss = trainer._compute_loss(lambda **kwargs: outputs, inputs, False)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _ours(per_token, mask, ref, how: preference.Preference):
    """functrain's loss and metrics of the same log-probs: pairs as rows (chosen, rejected)."""
    scored = mask[:, 1:].bool()
    logps = torch.where(scored, per_token, 0.0).sum(1)  # (2P,)
    counts = scored.sum(1).to(per_token.dtype)
    pairs = lambda t: torch.stack([t[:PAIRS], t[PAIRS:]], 1)  # (2P,) -> (P, 2)  # noqa: E731
    losses, metrics = preference.preference_loss(pairs(logps), pairs(ref), pairs(counts), how)
    return losses.mean(), metrics


@pytest.mark.parametrize("loss", preference.LOSSES)
@pytest.mark.parametrize("beta", [0.1, 0.7])
def test_each_loss_its_gradients_and_metrics_equal_trls(loss, beta):
    per_token, mask, ref = _batch(seed=10 * preference.LOSSES.index(loss) + (1 if beta < 0.5 else 2))  # (fixed seeds)
    theirs_in, ours_in = per_token.clone().requires_grad_(), per_token.clone().requires_grad_()
    theirs, logged = _trl(theirs_in, mask, ref, loss, beta)
    ours, metrics = _ours(ours_in, mask, ref, preference.Preference(loss, beta))
    assert_close(ours, theirs, rtol(n=LENGTH, dtype=torch.float64))
    (g_theirs,) = torch.autograd.grad(theirs, theirs_in)
    (g_ours,) = torch.autograd.grad(ours, ours_in)
    assert_close(g_ours, g_theirs, rtol(n=LENGTH, dtype=torch.float64))
    assert g_ours.abs().sum() > 0  # (the loss reaches the log-probs)
    for name, value in metrics.items():  # (TRL takes the accuracies' mean in float32)
        dtype = torch.float32 if name == "rewards/accuracies" else torch.float64
        assert_close(
            value, torch.tensor(logged[name], dtype=torch.float64), rtol(n=LENGTH * PAIRS, dtype=dtype), msg=name
        )
    assert 0.0 < metrics["rewards/accuracies"] < 1.0  # (the batch has pairs either way: the comparison is seen)


def test_label_smoothing_is_the_mixture_of_the_pair_and_the_swapped_pair():
    """Conservative DPO: with probability e a pair's label is flipped; TRL's sigmoid loss (which takes no smoothing)
    on the pairs and on the swapped pairs, mixed 1 - e : e, is the smoothed loss."""
    per_token, mask, ref = _batch(seed=3)
    swap = torch.cat([torch.arange(PAIRS, 2 * PAIRS), torch.arange(PAIRS)])  # rejected rows first
    e, beta = 0.2, 0.3
    straight, _ = _trl(per_token, mask, ref, "sigmoid", beta)
    flipped, _ = _trl(per_token[swap], mask[swap], ref[swap], "sigmoid", beta)
    ours, _ = _ours(per_token, mask, ref, preference.Preference("sigmoid", beta, label_smoothing=e))
    assert_close(ours, (1 - e) * straight + e * flipped, rtol(n=LENGTH, dtype=torch.float64))
    plain, _ = _ours(per_token, mask, ref, preference.Preference("sigmoid", beta))
    assert not torch.allclose(ours, plain)


def test_sequence_logps_sums_each_rows_scored_targets():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 7, 11, generator=g)
    y = torch.randint(0, 11, (4, 7), generator=g)
    y[:, :3] = -1  # a prompt: not scored
    y[2, 5:] = -1  # padding
    logps, counts = preference.sequence_logps(logits, y)
    want = -F.cross_entropy(logits.transpose(1, 2), y, ignore_index=-1, reduction="none").sum(1)
    assert_close(logps, want, rtol(n=7 * 11))
    assert counts.tolist() == [4.0, 4.0, 2.0, 4.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss": "kto"}, "preference loss 'kto' is not one of sigmoid, ipo, hinge"),
        ({"beta": 0.0}, "beta=0.0 must be > 0"),
        ({"label_smoothing": 0.5}, r"label_smoothing=0.5 must lie in \[0, 0.5\)"),
        ({"loss": "ipo", "label_smoothing": 0.1}, "label_smoothing is the sigmoid loss's; the ipo loss takes none"),
    ],
)
def test_a_bad_objective_is_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        preference.Preference(**kwargs)


def _pairs_from_rows(input_ids, completion_mask, ignore_index=-1):
    """TRL's rows (chosen rows, then rejected; right padded) as functrain's pairs: x, y (B, 2, T), y the next token
    where it is the completion's."""
    y = torch.full_like(input_ids, ignore_index)
    y[:, :-1] = torch.where(completion_mask[:, 1:].bool(), input_ids[:, 1:], ignore_index)
    pairs = lambda t: torch.stack(t.chunk(2), 1)  # (2B, T) -> (B, 2, T)  # noqa: E731
    return pairs(input_ids), pairs(y)


@pytest.mark.parametrize("model_type, loss", [("qwen2", "sigmoid"), ("qwen2", "ipo"), ("llama", "sigmoid")])
def test_a_models_loss_and_gradients_equal_trls_on_a_transformers_model(model_type, loss):
    """The model's side: TRL's `_compute_loss` on a tiny Qwen2 (a tied head) or Llama (its own head) (its fused
    head, its reference model a copy of the starting weights) against `make_loss_fn` through the hf family's
    template on the same params and rows."""
    from functrain import functional
    from functrain.models import hf

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=model_type == "qwen2",
    )  # fmt: skip
    net = transformers.AutoModelForCausalLM.from_config(config)
    start = {n: p.detach().clone() for n, p in net.named_parameters()}  # the reference: the starting weights
    with torch.no_grad():  # the policy moved away from it (at the start they are equal: every reward 0)
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ref_net = transformers.AutoModelForCausalLM.from_config(config)
    ref_net.load_state_dict(start, strict=False)
    fields = ("log_probs", "entropy", "mean_logits", "is_top1")
    add_fused_lm_head(net, outputs=fields)
    add_fused_lm_head(ref_net, outputs=fields)
    g = torch.Generator().manual_seed(1)
    rows, length = 2 * 3, 10
    input_ids = torch.randint(0, config.vocab_size, (rows, length), generator=g)
    prompt, end = torch.tensor([2, 3, 2, 2, 3, 2]), torch.tensor([9, 7, 10, 6, 10, 8])
    t = torch.arange(length)
    completion_mask = ((t >= prompt[:, None]) & (t < end[:, None])).long()
    attention_mask = (t < end[:, None]).long()
    beta = 0.2

    trainer = object.__new__(trl_dpo.DPOTrainer)
    trainer.__dict__.update(
        model=net, ref_model=ref_net, args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
        accelerator=types.SimpleNamespace(device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x),
        beta=beta, loss_types=[loss], loss_weights=[1.0], label_smoothing=0.0, ld_alpha=None,
        f_divergence_type="reverse_kl", precompute_ref_logps=False, use_weighting=False, aux_loss_enabled=False,
        _metrics={"train": collections.defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask}
    theirs = trainer._compute_loss(net, inputs, False)
    theirs.backward()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    template = hf.build_template(config)
    params = {n: p.detach().clone().requires_grad_() for n, p in net.named_parameters()}
    logits_fn = lambda p, x, key: functional.apply(template, p, input_ids=x).logits  # noqa: E731
    loss_fn = preference.make_loss_fn(logits_fn, preference.Preference(loss, beta), reference=lambda p: start)
    ours, metrics = loss_fn(params, _pairs_from_rows(input_ids, completion_mask), None)
    grads = torch.autograd.grad(ours, list(params.values()))

    n = length * config.hidden_size
    assert_close(ours, theirs, rtol(n=n))
    assert_close(dict(zip(params, grads)), {k: p.grad for k, p in net.named_parameters()}, rtol(n=n))
    for name, value in metrics.items():
        assert_close(value, torch.tensor(logged[name]), rtol(n=n), absolute=name.startswith("rewards/"), msg=name)
    assert abs(float(metrics["rewards/margins"])) > 1e-3  # (the policy and the reference differ)


def _pair_batches(vocab: int, length: int, n: int, pairs: int = 4, seed: int = 0):
    """`n` batches of `pairs` pairs (x, y) (pairs, 2, length): a shared prompt of 4 tokens, two completions of
    varied lengths, y the next token over each completion (-1 elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (pairs, 2, length), generator=g)
        x[:, 1, :4] = x[:, 0, :4]  # one prompt, two completions
        end = torch.randint(6, length + 1, (pairs, 2), generator=g)  # each completion's end
        y = torch.full_like(x, -1)
        y[..., :-1] = x[..., 1:]
        t = torch.arange(length)
        y[(t < 3) | (t >= end[..., None] - 1)] = -1  # scored: the completion's tokens 4 .. end - 1
        out.append((x, y))
    return out


def _preference_step(template, how, **kwargs):
    """A train step of the preference loss of a functrain GPT, the reference the state's frozen copy."""
    from functrain import functional, make_train_step, optim

    logits_fn = lambda p, x, key: functional.apply(template, p, x, dropout_key=key)  # noqa: E731
    loss_fn = preference.make_loss_fn(logits_fn, how, reference=preference.reference_of)
    opt = optim.adamw(1e-2, weight_decay=0.0, fused=True)
    return make_train_step(loss_fn, opt, count_targets=preference.count_pairs(), **kwargs), opt


def test_a_preference_step_compiles_one_graph_and_equals_eager_and_its_microbatches(tiny_gpt):
    """Through `make_train_step`: the reference frozen in the state (never written, no optimizer state), the pairs'
    loss falling; compiled (one graph, no recompile from step to step) equal to eager; 2 microbatches of pairs
    equal to one batch."""
    from functrain import init_state, tree

    model = tiny_gpt(n_layer=2)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = _pair_batches(model.cfg.vocab_size, model.cfg.block_size, 1) * 4  # one batch again: its loss falls
    how = preference.Preference("sigmoid", beta=0.5)
    _, opt = _preference_step(model, how)
    state = init_state(params, opt, frozen=preference.frozen_reference(params))
    assert not any(preference.REFERENCE in n for n, _ in tree.named_leaves(state.opt_state))
    runs = three_routes(lambda **kw: _preference_step(model, how, **kw), params, preference.frozen_reference, data)
    eager_state, eager = runs["eager"]
    assert eager[0]["loss"].item() == pytest.approx(0.6931471805599453, rel=1e-6)  # the policy is the reference
    assert eager[-1]["loss"] < eager[0]["loss"] and eager[-1]["rewards/margins"] > 0
    assert_close(eager_state.frozen, preference.frozen_reference(params), 0.0)  # never written
    for name in ("accum", "compiled"):
        state, got = runs[name]
        tol = rtol(n=model.cfg.block_size * model.cfg.n_embd)
        assert_close(state.params, eager_state.params, tol, msg=name)
        for a, b in zip(got, eager):
            assert_close({k: a[k] for k in b}, b, tol, msg=name)


def test_the_three_references_give_the_same_numbers(tiny_gpt):
    """A LoRA run's reference (a) as a frozen copy of the starting params, (b) as the base with the adapters off (no
    copy) and (c) as log-probs computed once beforehand and carried by the batch: the same steps, bit for bit."""
    from functrain import functional, init_state, make_train_step, optim, rng
    from functrain.models import gpt
    from functrain.nn import lora

    base = {n: p.detach().clone() for n, p in tiny_gpt(n_layer=2).named_parameters()}
    with torch.device("meta"):
        template = lora.wrap(gpt.GPT(tiny_gpt(n_layer=2).cfg), lora.LoraSpec(rank=4))
    adapters = lora.init_adapters(template, rng.key(1))  # B = 0: the policy starts as the reference
    logits_fn = lambda p, x, key: functional.apply(template, p, x, dropout_key=key)  # noqa: E731
    x, y = _pair_batches(64, 16, 1)[0]
    how, opt = preference.Preference("hinge", beta=0.5), optim.adamw(2e-2, weight_decay=0.0)
    runs = {
        "copy": (preference.reference_of, {**base, **preference.frozen_reference({**base, **adapters})}, (x, y)),
        "adapters off": (preference.adapters_off, base, (x, y)),
        "beforehand": (None, base, (x, y, preference.reference_logps(logits_fn, {**base, **adapters}, (x, y)))),
    }
    out = {}
    for name, (reference, frozen, batch) in runs.items():
        loss_fn = preference.make_loss_fn(logits_fn, how, reference=reference)
        step = make_train_step(loss_fn, opt, count_targets=preference.count_pairs(), compile=False)
        state, losses = init_state(adapters, opt, frozen=frozen), []
        for _ in range(3):
            state, m = step(state, batch)
            losses.append(m["loss"].item())
        out[name] = state.params, losses
    params, losses = out["copy"]
    assert losses[-1] < losses[0] and any(t.abs().sum() > 0 for n, t in params.items() if "lora_B" in n)
    for name in ("adapters off", "beforehand"):
        assert out[name][1] == losses, name
        assert_close(out[name][0], params, 0.0, absolute=True, msg=name)
