"""LR sweep with one compile: the peak learning rate is data in the state, not a graph constant.

`optim.set_hyperparams(state, lr=...)` swaps the schedule's peak lr (a 0-d tensor in the optimizer
state); the compiled step runs every point of the sweep with the graph it compiled for the first,
so a 4-point sweep pays one compile. With `--compile` the recipe checks that with torch._dynamo's
counters (exactly one graph for all 4 runs) and that the runs did differ.

    python examples/lr_sweep.py [--steps 20] [--compile]
"""

import _common as common
from torch._dynamo.utils import counters

import functrain as ft
from functrain import optim, rng
from functrain.models import gpt

args = common.parse(steps=20)
model, ds = common.tiny_gpt(), common.corpus(args)
opt = optim.adamw(optim.warmup_cosine(1e-3, 5, args.steps), weight_decay=0.1)
step = ft.make_train_step(gpt.make_loss_fn(model), opt, compile=args.compile, donate=False)
start, final = ft.init_state(gpt.init_params(model, rng.key(0)), opt, seed=0), {}
counters.clear()
for lr in (1e-3, 3e-3, 1e-2, 3e-2):
    state, lrs = optim.set_hyperparams(start, lr=lr), []  # the same graph, a new value
    for i in range(args.steps):
        state, metrics = step(state, common.batch(args, ds, i))
        lrs.append(float(metrics["lr"]))
    final[lr] = float(metrics["loss"])
    assert abs(max(lrs) - lr) <= 1e-6 * lr, (max(lrs), lr)  # the schedule peaked at the new value
    print(f"lr {lr:.0e} | loss after {args.steps} steps {final[lr]:.3f}")
graphs = counters["stats"]["unique_graphs"]
assert graphs == (1 if args.compile else 0) and len(set(final.values())) == 4, (graphs, final)
best = min(final, key=final.get)
print(f"lr_sweep: OK 4 learning rates, {graphs} compiled graph(s), best lr {best:.0e} (loss {final[best]:.3f})")
