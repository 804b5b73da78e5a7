"""GRPO against TRL's `GRPOTrainer` on fixed rollouts: its own loss code (`_compute_loss`, on a tiny Qwen2 through
its fused head) for every loss type, with and without the KL to a reference, one or two iterations per batch of
rollouts; the advantages as its `nanstd`-based normalization makes them; the step's weighting of microbatches."""

from __future__ import annotations

import collections
import contextlib
import types

import pytest
import torch
import transformers
from _routes import three_routes
from _tol import assert_close, rtol
from trl.trainer import grpo_trainer as trl_grpo
from trl.trainer.utils import add_fused_lm_head

from functrain import functional, grpo
from functrain import metric_names as M

B, P, C, V = 6, 3, 7, 48  # completions, prompt tokens, completion slots, vocabulary


def _nets(seed: int = 0):
    """A tiny Qwen2, moved away from its start, and the start itself (the reference), each with TRL's fused head."""
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    net = transformers.AutoModelForCausalLM.from_config(config)
    start = {n: p.detach().clone() for n, p in net.named_parameters()}
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return config, net, start


def _rollouts():
    """Prompts (B, P), completions (B, C) of varied lengths (right-padded), advantages of both signs."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (B, P), generator=g)
    completion = torch.randint(0, V, (B, C), generator=g)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    mask = (torch.arange(C) < lengths[:, None]).long()  # (B, C)
    adv = torch.tensor([1.2, -0.7, 0.3, -1.5, 0.9, -0.2])
    return prompt, completion, mask, adv


def _trl_trainer(net, how: grpo.GRPO):
    """A `GRPOTrainer` holding what `_compute_loss` reads (one process, no accumulation)."""
    trainer = object.__new__(trl_grpo.GRPOTrainer)
    trainer.__dict__.update(
        model=net, beta=how.beta, loss_type=how.loss, epsilon_low=how.epsilon, epsilon_high=how.high,
        importance_sampling_level="token", off_policy_mask_threshold=None, top_entropy_quantile=1.0,
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        use_vllm=False, current_gradient_accumulation_steps=1, max_completion_length=how.max_completion_length,
        accelerator=types.SimpleNamespace(
            num_processes=1, is_main_process=True, autocast=contextlib.nullcontext, gather=lambda x: x,
            reduce=lambda x, reduction: x,
            gather_for_metrics=lambda x: x,
        ),
        _metrics={"train": collections.defaultdict(list)}, _entropy_bonus_enabled=False, aux_loss_enabled=False,
    )  # fmt: skip
    return trainer


def _completion_logps(net, input_ids, attention_mask) -> torch.Tensor:
    """(B, C) log-probs of each completion token under `net` (TRL's fused head)."""
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :P] = -100
    with torch.no_grad():
        return net(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True).log_probs[
            :, -C:
        ]


def _at_targets(per_completion: torch.Tensor) -> torch.Tensor:
    """(B, C) values of the completion tokens -> (B, P + C) aligned with the next-token targets y."""
    out = torch.zeros(B, P + C)
    out[:, P - 1 : P + C - 1] = per_completion
    return out


@pytest.mark.parametrize("iterations", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss", grpo.LOSSES)
def test_the_loss_its_gradients_and_metrics_equal_trls(loss, beta, iterations):
    """TRL's `_compute_loss` on a tiny Qwen2 (its fused head at temperature 0.7) against `make_loss_fn` through the
    hf family's template: the loss, every gradient and the logged metrics, from the same rollouts; with two
    iterations the sampling policy's log-probs are another model's (ratios away from 1: the clipping counts)."""
    from functrain.models import hf

    how = grpo.GRPO(loss, beta=beta, epsilon=0.2, epsilon_high=0.28, temperature=0.7, max_completion_length=C)
    config, net, start = _nets()
    prompt, completion, mask, adv = _rollouts()
    input_ids = torch.cat([prompt, completion], dim=1)  # (B, P + C)
    attention_mask = torch.cat([torch.ones_like(prompt), mask], dim=1)
    ref_net = transformers.AutoModelForCausalLM.from_config(config)
    ref_net.load_state_dict(start, strict=False)
    old_net = transformers.AutoModelForCausalLM.from_config(config)
    old_net.load_state_dict({n: t + 0.08 * torch.randn_like(t) for n, t in start.items()}, strict=False)
    for m in (net, ref_net, old_net):
        add_fused_lm_head(m, temperature=how.temperature, outputs=("log_probs", "entropy"))
    inputs = {
        "prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
        "completion_mask": mask, "advantages": adv, "num_items_in_batch": mask.sum(),
    }  # fmt: skip
    ref = _completion_logps(ref_net, input_ids, attention_mask) if beta else None
    old = _completion_logps(old_net, input_ids, attention_mask) if iterations > 1 else None
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    if old is not None:
        inputs["old_per_token_logps"] = old
    trainer = _trl_trainer(net, how)
    theirs = trainer._compute_loss(net, inputs)
    theirs.backward()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    template = hf.build_template(config)
    params = {n: p.detach().clone().requires_grad_() for n, p in net.named_parameters()}
    y = torch.full_like(input_ids, -1)
    y[:, P - 1 : P + C - 1] = torch.where(mask.bool(), completion, -1)  # the completion tokens are the targets
    batch = (
        input_ids,
        y,
        adv,
        None if old is None else _at_targets(old),
        None if ref is None else _at_targets(ref),
    )
    loss_fn = grpo.make_loss_fn(lambda p, x, key: functional.apply(template, p, input_ids=x).logits, how)
    ours, metrics = loss_fn(params, batch, None)
    grads = torch.autograd.grad(ours, list(params.values()))

    n = (P + C) * config.hidden_size
    assert_close(ours, theirs, rtol(n=n))
    assert_close(dict(zip(params, grads)), {k: p.grad for k, p in net.named_parameters()}, rtol(n=n))
    names = [M.CLIP_LOW, M.CLIP_HIGH, M.CLIP_REGION, M.ENTROPY] + ([M.KL] if beta else [])
    assert set(names) == set(metrics)
    for name in names:
        assert_close(metrics[name], torch.tensor(logged[name]), rtol(n=n), absolute=True, msg=name)
    if iterations > 1:
        assert float(metrics[M.CLIP_REGION]) > 0  # (the old policy differs: some ratios are clipped)


def _reward_table(group: int) -> torch.Tensor:
    """(3 groups x `group`, 2) rewards of two functions: NaN where a function returns None, one completion no
    function scores, a group whose rewards are all alike."""
    g = torch.Generator().manual_seed(2)
    rewards = torch.randint(0, 3, (3 * group, 2), generator=g).float()
    rewards[[1, 6], 1] = torch.nan  # the second function skips these
    rewards[9] = torch.nan  # no function scores this one
    rewards[group : 2 * group, 0] = 1.0  # the second group's rewards all alike
    rewards[group : 2 * group, 1] = torch.nan
    return rewards


@pytest.fixture(scope="module")
def trl_scoring(tmp_path_factory):
    """`scale -> (advantages, logged metrics)` of TRL's own `_generate_and_score_completions`: a real GRPOTrainer
    over a tiny Qwen2 (its completions sampled by transformers' generate), whose two reward functions return
    `_reward_table`'s columns (None for NaN)."""
    import _tokenizer_dirs as dirs
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    group, weights = 4, [1.0, 0.5]
    table = _reward_table(group)
    directory = dirs.write(tmp_path_factory.mktemp("qwen2") / "base", "qwen2.5")
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    config = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip

    def reward(column: int):
        def scores(prompts, completions, **kwargs):
            assert len(completions) == len(table)
            return [None if v != v else float(v) for v in table[:, column].tolist()]

        scores.__name__ = scores.__qualname__ = f"r{column}"
        return scores

    def run(scale: str):
        torch.manual_seed(0)
        args = GRPOConfig(
            output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=len(table),
            num_generations=group, max_completion_length=3, scale_rewards=scale, reward_weights=weights,
            use_cpu=True, report_to=[], bf16=False, logging_steps=1, save_strategy="no", disable_tqdm=True,
        )  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_config(config)
        prompts = [{"prompt": f"Say {i}."} for i in range(len(table) // group)]
        trainer = GRPOTrainer(
            model=model, reward_funcs=[reward(0), reward(1)], args=args, train_dataset=Dataset.from_list(prompts),
            processing_class=tok,
        )  # fmt: skip
        inputs = [prompts[i // group] for i in range(len(table))]  # each prompt's completions adjacent
        out = trainer._generate_and_score_completions(inputs)
        return out["advantages"], {k: v[-1] for k, v in trainer._metrics["train"].items()}

    return table, torch.tensor(weights), group, run, [reward(0), reward(1)]


@pytest.mark.parametrize("scale", grpo.SCALES)
def test_advantages_equal_trls_and_skip_unscored_completions(trl_scoring, scale):
    """Group (or batch) normalized advantages of two weighted reward functions, one returning None for some
    completions and a completion no function scores: equal to TRL's own, its logged reward statistics too."""
    table, weights, group, run, functions = trl_scoring
    want, logged = run(scale)
    rewards = grpo.score(functions, ["p"] * len(table), ["c"] * len(table), {})  # None -> NaN
    torch.testing.assert_close(rewards, table, equal_nan=True)
    got, stats = grpo.advantages(rewards, weights, group, scale)
    torch.testing.assert_close(got, want)
    assert got[9] == 0 and (got[group : 2 * group] == 0).all()  # unscored; a group of equal rewards
    for name in ("reward", "reward_std", "frac_reward_zero_std"):
        assert float(stats[name]) == pytest.approx(logged[name], rel=1e-6), name


def test_each_loss_weighs_microbatches_as_trls_normalizer():
    """Two microbatches of a step (accumulation 2): the step's loss, `count_for`'s weighted mean of the microbatch
    losses, is TRL's over the whole batch: dapo the token mean of the step, grpo the mean of the completions'
    token means, dr_grpo the sum over completions x max length, bnpo the mean of the microbatches' token means."""
    g = torch.Generator().manual_seed(3)
    logps, old = -torch.rand(B, C, generator=g), -torch.rand(B, C, generator=g)
    _, _, mask, adv = _rollouts()
    halves = (slice(0, 3), slice(3, 6))
    for loss in grpo.LOSSES:
        how = grpo.GRPO(loss, max_completion_length=C)
        count = grpo.count_for(how)
        parts = [grpo.policy_loss(logps[h], old[h], None, adv[h], mask[h].bool(), how)[0] for h in halves]
        weights = [count((None, torch.where(mask[h].bool(), 1, -1))).float() for h in halves]
        stepped = sum(p * w for p, w in zip(parts, weights)) / sum(weights)
        ratio = torch.exp(logps - old)
        per_token = -torch.min(ratio * adv[:, None], torch.clamp(ratio, 0.8, 1.2) * adv[:, None]) * mask
        whole = {
            "dapo": per_token.sum() / mask.sum(),
            "grpo": (per_token.sum(-1) / mask.sum(-1)).mean(),
            "dr_grpo": per_token.sum() / (B * C),
            "bnpo": sum(per_token[h].sum() / mask[h].sum() for h in halves) / 2,
        }[loss]
        torch.testing.assert_close(stepped, whole, msg=loss)


def _gpt_rollouts(vocab: int, length: int, n: int, rows: int = 4, seed: int = 0):
    """`n` batches (x, y, adv, old_logps) of `rows` completions: a prompt of 3 tokens, completions of varied lengths
    (the rest padding), advantages of both signs, old log-probs near the policy's (ratios around 1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (rows, length), generator=g)
        end = torch.randint(5, length + 1, (rows,), generator=g)  # each completion's end
        y = torch.full_like(x, -1)
        y[:, :-1] = x[:, 1:]
        t = torch.arange(length)
        y[(t < 2) | (t >= end[:, None] - 1)] = -1  # scored: the completion's tokens 3 .. end - 1
        adv = torch.randn(rows, generator=g)
        old = torch.where(y != -1, -torch.log(torch.tensor(float(vocab))) + 0.1 * torch.randn(y.shape, generator=g), 0)
        out.append((x, y, adv, old))
    return out


@pytest.mark.slow
@pytest.mark.numeric  # (compiled vs eager: once, in the numeric tier)
def test_a_grpo_step_compiles_one_graph_and_equals_eager_and_its_microbatches(tiny_gpt):
    """Through `make_train_step` (dapo, the KL to the frozen copy in the state): 10 steps of other completion lengths
    compile one graph and never recompile, equal to eager; 2 microbatches equal one batch (`count_for`'s tokens)."""
    from functrain import make_train_step, optim, preference

    model = tiny_gpt(n_layer=2)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = _gpt_rollouts(model.cfg.vocab_size, model.cfg.block_size, 10)
    how = grpo.GRPO("dapo", beta=0.04)
    logits_fn = lambda p, x, key: functional.apply(model, p, x, dropout_key=key)  # noqa: E731
    loss_fn = grpo.make_loss_fn(logits_fn, how, reference=preference.reference_of)

    def make_step(**kwargs):
        opt = optim.adamw(1e-2, weight_decay=0.0, fused=True)  # (the update: torch's kernel, outside the graph)
        return make_train_step(loss_fn, opt, count_targets=grpo.count_for(how), **kwargs), opt

    runs = three_routes(make_step, params, preference.frozen_reference, data)
    eager_state, eager = runs["eager"]
    assert float(eager[0][M.KL]) == 0 and float(eager[-1][M.KL]) > 0  # the policy leaves the reference
    assert int(eager[0]["targets"]) == int((data[0][1] != -1).sum())
    for name in ("accum", "compiled"):
        state, got = runs[name]
        tol = rtol(n=model.cfg.block_size * model.cfg.n_embd)
        assert_close(state.params, eager_state.params, tol, msg=name)
        for a, b in zip(got, eager):
            assert_close({k: a[k] for k in b}, b, tol, absolute=True, msg=name)


def test_reward_functions_load_by_name_score_with_the_records_fields_and_bad_ones_are_one_line(tmp_path, monkeypatch):
    """`load_rewards` imports "module:function"; `score` passes the records' fields and reads None as not scored;
    each way a reward function goes wrong stops in one line naming it (and the completion it raised on)."""
    (tmp_path / "my_rewards.py").write_text(
        "def correct(prompts, completions, answer, **kw):\n"
        "    return [float(c.strip() == str(a)) if c else None for c, a in zip(completions, answer)]\n"
        "def picky(prompts, completions, **kw):\n"
        "    return [1.0 / (len(c) - 2) for c in completions]\n"
        "def short(prompts, completions, **kw):\n"
        "    return [1.0]\n"
        "def wordy(prompts, completions, **kw):\n"
        "    return ['yes' for _ in completions]\n"
        "number = 3\n"
    )
    (tmp_path / "broken_rewards.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    correct, picky, short, wordy = grpo.load_rewards(
        [f"my_rewards:{n}" for n in ("correct", "picky", "short", "wordy")]
    )
    prompts, completions = ["17+25="] * 4, [" 42", "41", "", "42 "]
    rewards = grpo.score([correct], prompts, completions, {"answer": [42] * 4})
    torch.testing.assert_close(rewards, torch.tensor([[1.0], [0.0], [torch.nan], [1.0]]), equal_nan=True)
    cases = [
        (lambda: grpo.load_rewards(["my_rewards.correct"]), "is not 'module:function'"),
        (lambda: grpo.load_rewards(["broken_rewards:f"]), "module 'broken_rewards' does not import (ModuleNotFound"),
        (lambda: grpo.load_rewards(["my_rewards:nothing"]), "my_rewards has no function 'nothing'"),
        (lambda: grpo.load_rewards(["my_rewards:number"]), "my_rewards has no function 'number'"),
        (
            lambda: grpo.score([picky], prompts, ["abc", "ab", "abcd"], {}),
            "reward function picky raised ZeroDivisionError: float division by zero (on completion 1 of 3",
        ),
        (lambda: grpo.score([short], prompts, completions, {}), "short returned 1 values for 4 completions"),
        (lambda: grpo.score([wordy], prompts, completions, {}), "wordy returned 'yes' for completion 0"),
    ]
    for call, message in cases:
        with pytest.raises(grpo.RewardError) as e:
            call()
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="1 completion per prompt: a group's reward std needs 2 or more"):
        grpo.advantages(torch.ones(4, 1), torch.ones(1), group=1)


def test_completion_rows_put_each_completion_after_its_prompt_as_targets():
    """Rows of 2 prompts x 2 samples: x the prompt then the completion (padded), y the completion's tokens at the
    positions that predict them; a truncated completion scores nothing with `mask_truncated`; too long: one line."""
    from functrain.generation import Completion

    prompts = [[5, 6], [7]]
    samples = [
        [Completion([1, 2], [0.0, 0.0], "stop"), Completion([3], [0.0], "length")],
        [Completion([4, 4, 4], [0.0] * 3, "length"), Completion([], [], "stop")],
    ]
    x, y = grpo.completion_rows(prompts, samples, 5, pad_id=9)
    assert x.tolist() == [[5, 6, 1, 2, 9], [5, 6, 3, 9, 9], [7, 4, 4, 4, 9], [7, 9, 9, 9, 9]]
    assert y.tolist() == [[-1, 1, 2, -1, -1], [-1, 3, -1, -1, -1], [4, 4, 4, -1, -1], [-1] * 5]
    _, masked = grpo.completion_rows(prompts, samples, 5, mask_truncated=True)
    assert masked.tolist() == [[-1, 1, 2, -1, -1], [-1] * 5, [-1] * 5, [-1] * 5]
    with pytest.raises(ValueError, match="a prompt of 2 tokens and its completion of 2 make 4, more than the rows' 3"):
        grpo.completion_rows(prompts, samples, 3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loss": "ppo"}, "grpo.loss='ppo' is not one of dapo, grpo, dr_grpo, bnpo"),
        ({"beta": -0.1}, "grpo.beta=-0.1 is negative"),
        ({"epsilon": 0.0}, "give 0 < epsilon < 1"),
        ({"temperature": 0.0}, "give a temperature > 0"),
    ],
)
def test_a_bad_objective_is_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        grpo.GRPO(**kwargs)
    assert "\n" not in str(e.value)
