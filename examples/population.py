"""Population: 4 tiny GPTs (own seeds, own learning rates) trained by one vmapped step, each equal
to its solo run.

Hyper-parameters are optimizer state, so the members differ in their `lr` and share one graph:
`population.make_population_step` vmaps the whole train step over the stacked states.
Last line: `max |population - solo| = <value>` over every parameter after the last step.

    python examples/population.py [--steps 20] [--compile]
"""

import _common as common
import optree
import torch

from functrain import init_state, make_train_step, optim, population, rng
from functrain.models import gpt

args = common.parse(steps=20, batch=8)
model = common.tiny_gpt(vocab_size=64, n_embd=32, bias=False)
loss_fn, schedule = gpt.make_loss_fn(model), optim.warmup_cosine(1e-2, 2, args.steps)
opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(schedule, weight_decay=0.1))
members = [
    optim.set_hyperparams(init_state(gpt.init_params(model, rng.key(k)), opt, seed=k), lr=lr)
    for k, lr in enumerate([1e-2, 3e-3, 5e-3, 2e-2])
]
step = population.make_population_step(loss_fn, opt, compile=args.compile, donate=False)
solo = make_train_step(loss_fn, opt, compile=args.compile, donate=False)
pop, data = population.stack(members), torch.Generator().manual_seed(0)
for _ in range(args.steps):
    x = torch.randint(0, 64, (args.batch, common.BLOCK + 1), generator=data)  # random tokens
    pop, metrics = step(pop, (x[:, :-1], x[:, 1:]))  # every member, one call
    members = [solo(m, (x[:, :-1], x[:, 1:]))[0] for m in members]  # the reference: one by one
print("population losses:", [round(float(v), 4) for v in metrics["loss"]])
diff = max(
    float((a - b).abs().max())
    for k, m in enumerate(members)
    for a, b in zip(optree.tree_leaves(population.member(pop, k).params), optree.tree_leaves(m.params))
)
print(f"max |population - solo| = {diff:.3g}")
