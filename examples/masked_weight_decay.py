"""Weight decay masked off biases and LayerNorms, two ways, checked with a zero-gradient step.

A mask is a tree of Python bools shaped like the params, or a callable `params -> mask`; here
"decay the leaves with ndim >= 2" (matrices and embeddings). Two equivalent ways to apply it:
`optim.adamw(lr, weight_decay=wd, mask=mask)`, and `optim.masked(optim.add_decayed_weights(wd),
mask)` inside a hand-built Adam chain. Check: one step of a loss whose gradients are all zero makes
Adam's update exactly 0, so every matrix shrinks by (1 - lr * wd) and every bias and norm scale is
bit-identical; then a short real run with the first.

    python examples/masked_weight_decay.py [--steps 30] [--compile]
"""

import _common as common
import torch

import functrain as ft
from functrain import optim, rng
from functrain.models import gpt

args = common.parse(steps=30)
model, ds = common.tiny_gpt(), common.corpus(args)
params, lr, wd = gpt.init_params(model, rng.key(0)), 1e-2, 0.1
decay_mask = lambda p: {k: v.ndim >= 2 for k, v in p.items()}  # noqa: E731
optimizers = [
    optim.adamw(lr, weight_decay=wd, mask=decay_mask, fused=False),  # (the chain's math, as the hand-built one's)
    optim.chain(
        optim.scale_by_adam(), optim.masked(optim.add_decayed_weights(wd), decay_mask), optim.scale_by_learning_rate(lr)
    ),
]
zero_grad_loss = lambda p, batch, key: (sum(v.sum() for v in p.values()) * 0.0, {})  # noqa: E731


def zero_grad_step(opt):  # one step whose gradients are all zero: Adam's update is exactly 0
    step = ft.make_train_step(zero_grad_loss, opt, compile=args.compile)
    return step(ft.init_state(params, opt), common.batch(args, ds, 0))[0].params


results = [zero_grad_step(opt) for opt in optimizers]
for k, p in params.items():  # decayed: p * (1 - lr wd); masked off: untouched, bit for bit
    got = results[0][k]
    assert torch.allclose(got, p * (1 - lr * wd), rtol=1e-6) if p.ndim >= 2 else torch.equal(got, p), k
    assert torch.equal(results[1][k], got), f"the two masking styles disagree on {k}"
state = ft.init_state(params, optimizers[0], seed=0)
step, losses = ft.make_train_step(gpt.make_loss_fn(model), optimizers[0], compile=args.compile), []
for i in range(args.steps):
    state, metrics = step(state, common.batch(args, ds, i))
    losses.append(float(metrics["loss"]))
decayed = sum(p.ndim >= 2 for p in params.values())
assert losses[-1] < losses[0] - 1.0, losses
print(
    f"masked_weight_decay: OK {decayed} decayed, {len(params) - decayed} masked, both styles agree; "
    f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
)
