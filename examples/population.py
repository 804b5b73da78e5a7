"""Population: 4 tiny GPTs (own seeds, own learning rates) trained by one vmapped step, each equal
to its solo run.

    python examples/population.py [--steps 20] [--compile]

Hyper-parameters are optimizer state, so the members differ in their `lr` and share one graph.
Last line: `max |population - solo| = <value>` over every parameter after the last step.
"""

import argparse

import optree
import torch

from functrain import init_state, make_train_step, optim, population, rng
from functrain.models import gpt

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--compile", action="store_true")
args = ap.parse_args()

cfg = gpt.GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=False)
with torch.device("meta"):
    template = gpt.GPT(cfg)
loss_fn = gpt.make_loss_fn(template)
opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.warmup_cosine(1e-2, 2, args.steps), weight_decay=0.1))
members = [optim.set_hyperparams(init_state(gpt.init_params(template, rng.key(k)), opt, seed=k), lr=lr)
           for k, lr in enumerate([1e-2, 3e-3, 5e-3, 2e-2])]
step = population.make_population_step(loss_fn, opt, compile=args.compile, donate=False)
solo = make_train_step(loss_fn, opt, compile=args.compile, donate=False)
pop = population.stack(members)
data = torch.Generator().manual_seed(0)
for i in range(args.steps):
    x = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1), generator=data)
    pop, metrics = step(pop, (x[:, :-1], x[:, 1:]))  # every member, one call
    members = [solo(m, (x[:, :-1], x[:, 1:]))[0] for m in members]  # the reference: one by one
print("population losses:", [round(float(v), 4) for v in metrics["loss"]])
diff = max(float((a - b).abs().max()) for k, m in enumerate(members)
           for a, b in zip(optree.tree_leaves(population.member(pop, k).params), optree.tree_leaves(m.params)))
print(f"max |population - solo| = {diff:.3g}")
