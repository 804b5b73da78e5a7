"""EMA of the params in the state: extend the state pytree, compose the train step.

The state becomes `EMAState(train, ema)`, still one pytree. `ema_step` runs the eager train step,
then moves the EMA with the public tree helper `tree.incremental_update` (one fused lerp over all
leaves, pure): the composition is a pure `(state, batch) -> (state, metrics)` that `--compile`
compiles whole as one graph. The EMA weights are evaluated by swapping them into the TrainState.

    python examples/ema.py [--steps 60] [--decay 0.9] [--compile]
"""

from typing import NamedTuple

import _common as common
import torch

import functrain as ft
from functrain import optim, rng, tree
from functrain.models import gpt

args = common.parse(steps=60, decay=0.9)
model, ds = common.tiny_gpt(), common.corpus(args)
loss_fn, opt = gpt.make_loss_fn(model), optim.adamw(optim.warmup_cosine(3e-3, 5, args.steps), weight_decay=0.1)
train_step = ft.make_train_step(loss_fn, opt, compile=False, donate=False)  # eager: composable


class EMAState(NamedTuple):
    train: ft.TrainState
    ema: dict  # {name: tensor}, an exponential moving average of train.params


def ema_step(state, batch):
    train, metrics = train_step(state.train, batch)
    return EMAState(train, tree.incremental_update(train.params, state.ema, 1 - args.decay)), metrics


step = torch.compile(ema_step, fullgraph=True) if args.compile else ema_step
eval_step, val = ft.make_eval_step(loss_fn, compile=False), common.val_batches(ds)
evaluate = lambda train_state: sum(float(eval_step(train_state, b)["loss"]) for b in val) / len(val)  # noqa: E731
params = gpt.init_params(model, rng.key(0))
state = EMAState(ft.init_state(params, opt, seed=0), tree.clone(params))
ref, init_loss = params["ln_f.weight"], evaluate(state.train)  # ref: one leaf's EMA, by hand
for i in range(args.steps):
    before = tree.clone(state)
    new_state, metrics = step(state, common.batch(args, ds, i))
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(before), tree.leaves(state)))  # pure
    state, ref = new_state, args.decay * ref + (1 - args.decay) * new_state.train.params["ln_f.weight"]
params_loss, ema_loss = evaluate(state.train), evaluate(state.train.replace(params=state.ema))
assert torch.allclose(state.ema["ln_f.weight"], ref, rtol=1e-5, atol=1e-6) and ema_loss < init_loss - 1.0
print(f"ema: OK val loss init {init_loss:.3f} | params {params_loss:.3f} | ema {ema_loss:.3f}")
