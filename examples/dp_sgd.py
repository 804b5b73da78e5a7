"""DP-SGD: per-example clipping and Gaussian noise, then the ordinary update via `apply_gradients`.

Each example's gradient (`per_example.grads`, vmap of grad over the batch) is clipped to norm
`--clip`, the clipped gradients are summed, Gaussian noise of std `--noise * --clip` drawn from the
state's own key is added (the same state and batch give the same noise) and the sum is divided by
the batch size (`per_example.privatize`). `functrain.apply_gradients` then does what the train
step's second half does: the update, the norms, the skip of a non-finite update, `step + 1`.
`--compile` compiles the whole DP step as one graph (~80 s on 2 CPU cores; see
`functrain.per_example` for what used to make it never finish).

Checks: with no noise and a clip no gradient reaches, one DP step equals one `make_train_step`
step (SGD); with noise each example is clipped and the loss still falls.

    python examples/dp_sgd.py [--steps 30] [--clip 1.0] [--noise 0.5] [--compile]
"""

import _common as common
import torch

import functrain as ft
from functrain import optim, per_example, rng, tree
from functrain.models import gpt

args = common.parse(steps=30, batch=8, clip=1.0, noise=0.5)
model, ds = common.tiny_gpt(), common.corpus(args)
params, loss_fn = gpt.init_params(model, rng.key(0)), gpt.make_loss_fn(model)


def dp_step(state, batch, clip, noise, optimizer):
    grads, losses, _ = per_example.grads(loss_fn, state.params, batch)  # {name: (B, *shape)}, (B,)
    mean, norms = per_example.privatize(grads, clip, noise, rng.fold_in(state.rng, state.step))
    new_state, metrics = ft.apply_gradients(state, mean, optimizer, aux={"loss": losses.mean()})
    return new_state, {**metrics, "max_example_norm": norms.max(), "clipped": (norms > clip).float().mean()}


sgd, batch = optim.sgd(0.5), common.batch(args, ds, 0)  # check 1: no noise, no clipping = plain SGD
plain, _ = ft.make_train_step(loss_fn, sgd, compile=False, donate=False)(ft.init_state(params, sgd), batch)
dp, _ = dp_step(ft.init_state(params, sgd), batch, torch.tensor(1e9), torch.tensor(0.0), sgd)
diff = max(float((dp.params[k] - plain.params[k]).abs().max()) for k in plain.params)
assert diff < 1e-6, diff
opt, clip, noise = optim.adamw(3e-3, weight_decay=0.0), torch.tensor(args.clip), torch.tensor(args.noise)
step = torch.compile(dp_step, fullgraph=True) if args.compile else dp_step
state, losses = ft.init_state(params, opt, seed=0), []
for i in range(args.steps):
    state, m = step(state, common.batch(args, ds, i), clip, noise, opt)
    losses.append(float(m["loss"]))
    if i % 10 == 0 or i == args.steps - 1:
        print(
            f"step {i + 1:3d} | loss {losses[-1]:.4f} | clipped {float(m['clipped']):.0%} "
            f"| max example norm {float(m['max_example_norm']):.2f} | grad norm {float(m['grad_norm']):.3f}"
        )
assert int(state.step) == args.steps and int(state.guard.skipped) == 0 and float(m["clipped"]) > 0
assert sum(losses[-5:]) / 5 < losses[0] - 0.5 and all(torch.isfinite(p).all() for p in tree.leaves(state.params))
print(
    f"dp_sgd: OK {args.steps} steps, loss {losses[0]:.3f} -> {sum(losses[-5:]) / 5:.3f} (clip {args.clip}, "
    f"noise {args.noise}); no-noise step equals make_train_step (max diff {diff:.1e})"
)
