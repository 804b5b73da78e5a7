"""DP-SGD: per-example clipping and Gaussian noise, then the ordinary update via `apply_gradients`.

The gradient is not the loss's: each example's gradient (`vmap(grad(...))`) is clipped to norm
`--clip`, the clipped gradients are summed, Gaussian noise of std `--noise * --clip` is added
(drawn from the state's own RNG key: the same state and batch give the same noise), and the sum is
divided by the batch size. `functrain.apply_gradients` then does exactly what the train step's
second half does: the optimizer update, the norms, the skip of a non-finite update, `step + 1`.

Checks: with no noise and a clip no gradient reaches, one DP step equals one
`make_train_step` step; with noise the per-example clipping bound holds and the loss still falls.

    python examples/dp_sgd.py [--steps 30] [--clip 1.0] [--noise 0.5] [--cache-dir DIR]

It runs eagerly (5 s): `torch.compile` of vmap(grad) over the GPT plus the update had not finished
after 10 minutes on 2 CPU cores, so this script offers no --compile.
"""

import argparse
import math
import os
import tempfile
import warnings

import torch

import functrain as ft
from functrain import optim, rng, tree
from functrain.models import gpt

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--clip", type=float, default=1.0, help="per-example gradient norm bound C")
parser.add_argument("--noise", type=float, default=0.5, help="noise multiplier sigma (std = sigma * C)")
parser.add_argument("--cache-dir", default=os.environ.get(
    "FUNCTRAIN_CACHE_DIR", os.path.join(tempfile.gettempdir(), "functrain-data")))
parser.add_argument("--threads", type=int, default=1, help="a tiny model runs fastest on one thread")
args = parser.parse_args()
torch.set_num_threads(args.threads)
# torch has no vmap rule for the CPU flash-attention kernel: it loops over the batch (correct, slower).
warnings.filterwarnings("ignore", message=".*not yet implemented the batching rule.*")

cfg = gpt.GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
with torch.device("meta"):
    model = gpt.GPT(cfg)
ds = ft.load_dataset("stdlib", args.cache_dir)
opt = optim.adamw(3e-3, weight_decay=0.0)


def loss_fn(params, batch, key):  # mean next-token cross-entropy over the batch
    x, y = batch
    return gpt.cross_entropy(ft.apply(model, params, x), y), {}


def example_loss(params, x, y):  # one example: x, y are (T,)
    return loss_fn(params, (x[None], y[None]), None)[0]


per_example_grads = torch.func.vmap(torch.func.grad(example_loss), in_dims=(None, 0, 0))


def normal(key, shape):
    """Standard normal noise from a key (Box-Muller over two keyed uniforms)."""
    k1, k2 = rng.split(key)
    u1 = rng.uniform(k1, shape).clamp_min(1e-12)
    u2 = rng.uniform(k2, shape)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


def dp_step(state, batch, clip: float, noise: float, optimizer=opt):
    """One DP-SGD step: clipped per-example grads + noise, then `apply_gradients`."""
    x, y = batch
    grads = per_example_grads(state.params, x, y)  # {name: (B, *shape)}
    norms = torch.stack([g.flatten(1).square().sum(1) for g in grads.values()]).sum(0).sqrt()  # (B,)
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)  # (B,)
    keys = rng.split(rng.fold_in(state.rng, state.step), len(grads))  # one noise key per leaf
    noisy = {}
    for i, (name, g) in enumerate(grads.items()):
        summed = torch.einsum("b,b...->...", factor, g)  # sum of clipped per-example grads
        noisy[name] = (summed + noise * clip * normal(keys[i], summed.shape)) / len(x)
    loss = loss_fn(state.params, batch, None)[0].detach()
    new_state, metrics = ft.apply_gradients(state, noisy, optimizer, aux={"loss": loss})
    metrics["max_example_norm"] = norms.max()
    metrics["clipped_fraction"] = (norms > clip).float().mean()
    return new_state, metrics


params = gpt.init_params(model, rng.key(0))

# Check 1: no noise and an unreachable clip -> the plain step (mean of per-example grads). SGD, so
# the check sees gradient differences at their size (Adam's first step would magnify rounding).
x, y = ft.get_batch(ds.train, batch_size=args.batch, block_size=cfg.block_size, seed=0, step=0)
sgd = optim.sgd(0.5)
plain, _ = ft.make_train_step(loss_fn, sgd, compile=False, donate=False)(ft.init_state(params, sgd), (x, y))
dp, _ = dp_step(ft.init_state(params, sgd), (x, y), clip=1e9, noise=0.0, optimizer=sgd)
diff = max(float((dp.params[k] - plain.params[k]).abs().max()) for k in plain.params)
assert diff < 1e-6, diff

# Check 2: real DP-SGD trains, each example's contribution bounded by the clip.
state = ft.init_state(params, opt, seed=0)
losses = []
for s in range(args.steps):
    batch = ft.get_batch(ds.train, batch_size=args.batch, block_size=cfg.block_size, seed=0, step=s)
    state, m = dp_step(state, batch, args.clip, args.noise)
    losses.append(float(m["loss"]))
    if s % 10 == 0 or s == args.steps - 1:
        print(f"step {s + 1:3d} | loss {losses[-1]:.4f} | clipped {float(m['clipped_fraction']):.0%} "
              f"| max example norm {float(m['max_example_norm']):.2f} | grad norm {float(m['grad_norm']):.3f}")
assert int(state.step) == args.steps and int(state.guard.skipped) == 0
assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses
assert all(torch.isfinite(p).all() for p in tree.leaves(state.params))

print(f"dp_sgd: OK {args.steps} steps, loss {losses[0]:.3f} -> {sum(losses[-5:]) / 5:.3f} "
      f"(clip {args.clip}, noise {args.noise}); no-noise step equals make_train_step (max diff {diff:.1e})")
