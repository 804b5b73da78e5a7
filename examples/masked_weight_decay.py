"""Weight decay masked off biases and LayerNorms, two ways, checked with a zero-gradient step.

The usual GPT recipe decays the matrices (Linear weights, embeddings) and leaves the biases and
LayerNorm scales alone. A mask is a tree of Python bools shaped like the params, or a callable
`params -> mask`; here "decay the leaves with ndim >= 2". Two equivalent ways to apply it:
  a) `optim.adamw(lr, weight_decay=wd, mask=mask)` (the mask goes to `add_decayed_weights`);
  b) `optim.masked(optim.add_decayed_weights(wd), mask)` inside a hand-built Adam chain.
Check: one train step with a loss whose gradients are all zero. Adam's update is then exactly 0,
so the only change is decay: every matrix shrinks by (1 - lr * wd) and every bias and norm scale
is bit-identical. Then a short real training run with (a).

    python examples/masked_weight_decay.py [--steps 30] [--compile] [--cache-dir DIR]
"""

import argparse
import os
import tempfile

import torch

import functrain as ft
from functrain import optim, rng
from functrain.models import gpt

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--compile", action="store_true", help="torch.compile the steps (~1 min each on CPU)")
parser.add_argument("--cache-dir", default=os.environ.get(
    "FUNCTRAIN_CACHE_DIR", os.path.join(tempfile.gettempdir(), "functrain-data")))
parser.add_argument("--threads", type=int, default=1, help="a tiny model runs fastest on one thread")
args = parser.parse_args()
torch.set_num_threads(args.threads)

cfg = gpt.GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, bias=True)
with torch.device("meta"):
    model = gpt.GPT(cfg)
params = gpt.init_params(model, rng.key(0))
ds = ft.load_dataset("stdlib", args.cache_dir)
lr, wd = 1e-2, 0.1


def batch(i):
    return ft.get_batch(ds.train, batch_size=16, block_size=cfg.block_size, seed=0, step=i)


def decay_mask(params):  # matrices and embeddings decay; biases and LayerNorm scales do not
    return {k: v.ndim >= 2 for k, v in params.items()}


optimizers = {
    "adamw(mask=)": optim.adamw(lr, weight_decay=wd, mask=decay_mask),
    "masked(add_decayed_weights)": optim.chain(
        optim.scale_by_adam(), optim.masked(optim.add_decayed_weights(wd), decay_mask),
        optim.scale_by_learning_rate(lr)),
}


def loss_fn(params, batch, key):
    x, y = batch
    return gpt.cross_entropy(ft.apply(model, params, x, dropout_key=key), y), {}


def zero_grad_loss(params, batch, key):  # a loss that depends on every param with gradient 0
    return sum(p.sum() for p in params.values()) * 0.0, {}


mask = decay_mask(params)
after = {}
for name, opt in optimizers.items():
    step = ft.make_train_step(zero_grad_loss, opt, compile=args.compile)
    state, _ = step(ft.init_state(params, opt), batch(0))  # init_state copies: `params` stays put
    for k, p in params.items():
        new = state.params[k]
        if mask[k]:  # decayed: p - lr * wd * p
            assert torch.allclose(new, p * (1 - lr * wd), rtol=1e-6, atol=0), (name, k)
        else:  # masked off: untouched, bit for bit
            assert torch.equal(new.view(torch.int32), p.view(torch.int32)), (name, k)
    after[name] = state.params
a, b = after.values()
assert all(torch.equal(a[k], b[k]) for k in a), "the two masking styles disagree"
decayed = [k for k in mask if mask[k]]
print(f"zero-grad step: {len(decayed)} matrices scaled by {1 - lr * wd}, "
      f"{len(mask) - len(decayed)} biases/norms untouched, e.g. {[k for k in mask if not mask[k]][:3]}")

opt = optimizers["adamw(mask=)"]
state = ft.init_state(params, opt, seed=0)
step = ft.make_train_step(loss_fn, opt, compile=args.compile)
for i in range(args.steps):
    state, metrics = step(state, batch(i))
    if i == 0:
        first = float(metrics["loss"])
last = float(metrics["loss"])
assert last < first - 1.0, (first, last)
print(f"masked_weight_decay: OK {len(decayed)} decayed, {len(mask) - len(decayed)} masked, "
      f"both styles agree; loss {first:.3f} -> {last:.3f}")
