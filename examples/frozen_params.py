"""Frozen parameters (position embedding + first block), two ways; frozen leaves stay bit-identical.

  split: the state trains only the trainable params and holds the frozen ones apart
         (`init_state(trainable, opt, frozen=frozen)`: `TrainState.frozen`, which the step hands the
         loss merged with the params). No gradients, optimizer state or updates exist for the frozen
         leaves (the cheap way: fine-tuning, adapters, linear probes).
  mask:  the state holds every param and the optimizer freezes by mask:
         `chain(masked(adamw, trainable), masked(scale(0.0), frozen))`. Adam keeps moments only for
         the trainable leaves; the frozen updates are zeroed (their gradients are still computed).
Both runs see the same data, so their trainable params agree too.

    python examples/frozen_params.py [--steps 30] [--compile]
"""

import _common as common
import torch

import functrain as ft
from functrain import optim, rng, tree
from functrain.models import gpt

args = common.parse(steps=30)
model, ds = common.tiny_gpt(), common.corpus(args)
params, loss_fn = gpt.init_params(model, rng.key(0)), gpt.make_loss_fn(model)


def is_frozen(name):  # the lower layers; fine-tune the rest (not wte: it is also the tied head)
    return name == "wpe.weight" or name.startswith("blocks.0.")


frozen, trainable = ({k: v for k, v in params.items() if is_frozen(k) is want} for want in (True, False))
# fused=False: both styles run the same update math (adamw()'s eager kernel would round otherwise than masked's chain)
adamw = optim.adamw(optim.warmup_cosine(3e-3, 5, args.steps), weight_decay=0.1, fused=False)
mask_opt = optim.chain(
    optim.masked(adamw, lambda p: {k: not is_frozen(k) for k in p}),
    optim.masked(optim.scale(0.0), lambda p: {k: is_frozen(k) for k in p}),
)
final, runs = {}, {"split": (adamw, trainable, frozen), "mask": (mask_opt, params, None)}
for name, (opt, start, held) in runs.items():
    state = ft.init_state(start, opt, seed=0, frozen=held)
    step = ft.make_train_step(loss_fn, opt, compile=args.compile)
    for i in range(args.steps):
        state, metrics = step(state, common.batch(args, ds, i))
    final[name] = {**state.frozen, **state.params}
    print(
        f"{name:5s}: loss {float(metrics['loss']):.3f}, {len(state.params)} params in the state, "
        f"{tree.size(state.opt_state):,} optimizer-state numbers"
    )
    assert all(torch.equal(final[name][k], p) == is_frozen(k) for k, p in params.items()), name
    assert tree.size(state.opt_state) < tree.size(params) * 2  # no Adam moments for frozen leaves
diff = max(float((final["split"][k] - final["mask"][k]).abs().max()) for k in trainable)
assert diff < 1e-5, diff
print(
    f"frozen_params: OK {len(frozen)} frozen leaves bit-identical after {args.steps} steps (split and mask), "
    f"{len(trainable)} trained; split vs mask max diff {diff:.1e}"
)
