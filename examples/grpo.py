"""GRPO with a verifiable reward: sample 4 completions per prompt, score them, train on their advantages.

Each step takes 4 prompts of 8 bytes from the corpus, samples 4 completions of 12 bytes each with the
KV-cache `Generator` (keyed: the run is the same on any machine), rewards each by its share of vowels,
normalizes the rewards within each prompt's group (`grpo.advantages`) and takes one step of the dapo loss.
The mean reward (first five steps -> last five) rises from 0.049 to 1.000: every byte a vowel (~20 s, one core).

    python examples/grpo.py [--steps 40] [--compile]
"""

import _common as common
import torch

import functrain as ft
from functrain import grpo, optim, rng
from functrain.generation import Generator, Sampling
from functrain.models import gpt

args = common.parse(steps=40, group=4)
model, ds = common.tiny_gpt(), common.corpus(args)
how = grpo.GRPO("dapo")
loss_fn = grpo.make_loss_fn(lambda p, x, key: ft.apply(model, p, x), how)
opt = optim.adamw(1e-2, weight_decay=0.0)
state = ft.init_state(gpt.init_params(model, rng.key(0)), opt, seed=0)
step = ft.make_train_step(loss_fn, opt, count_targets=grpo.count_for(how), compile=args.compile)
generate = Generator.of(model, batch_size=16, compile=args.compile)


def vowels(prompts, completions, **fields):  # the verifiable reward: the share of vowels in a completion
    return [sum(t in b"aeiou" for t in c) / len(c) for c in completions]


rewards = []
for i in range(args.steps):
    prompts = [ds.train[j : j + 8].tolist() for j in range(1000 * i, 1000 * i + 4000, 1000)]
    samples = generate(state.params, prompts, 12, key=rng.fold_in(rng.key(1), i), sampling=Sampling(1.0), n=args.group)
    completions = [c.tokens for group in samples for c in group]
    scores = grpo.score([vowels], [p for p in prompts for _ in range(args.group)], completions, {})
    adv, stats = grpo.advantages(scores, torch.ones(1), args.group)
    state, metrics = step(state, (*grpo.completion_rows(prompts, samples, common.BLOCK), adv))
    rewards.append(float(stats["reward"]))
first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
assert last > 3 * first and last > 0.2, rewards
print(f"grpo: OK mean reward (share of vowels) {first:.3f} -> {last:.3f} over {args.steps} steps")
