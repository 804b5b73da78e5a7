"""Per-example gradient norms: `torch.func.vmap(torch.func.grad(...))` over a batch.

`functrain.apply` makes the model a pure function of its params, so `grad` of a one-example loss
is an ordinary function and `vmap` maps it over the batch: one call gives every example's
gradient, `{name: (B, *shape)}`. Checked against a Python loop of single-example gradients
(`functrain.value_and_grad`), and their mean against the batch gradient. The norms are what
DP-SGD clips, or what a data-quality study ranks examples by; the per-example clipped mean is
computed at the end.

    python examples/per_example_grad_norms.py [--batch 8] [--compile] [--cache-dir DIR]
"""

import argparse
import os
import tempfile
import warnings

import torch

import functrain as ft
from functrain import rng, tree
from functrain.models import gpt

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--clip", type=float, default=1.0, help="per-example clipping norm")
parser.add_argument("--compile", action="store_true", help="torch.compile the vmapped grad")
parser.add_argument("--cache-dir", default=os.environ.get(
    "FUNCTRAIN_CACHE_DIR", os.path.join(tempfile.gettempdir(), "functrain-data")))
parser.add_argument("--threads", type=int, default=1, help="a tiny model runs fastest on one thread")
args = parser.parse_args()
torch.set_num_threads(args.threads)

cfg = gpt.GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
with torch.device("meta"):
    model = gpt.GPT(cfg)
params = gpt.init_params(model, rng.key(0))
ds = ft.load_dataset("stdlib", args.cache_dir)
x, y = ft.get_batch(ds.train, batch_size=args.batch, block_size=cfg.block_size, seed=0, step=0)


def loss_fn(params, batch, key):  # the usual batched loss: mean over the batch's tokens
    x, y = batch
    return gpt.cross_entropy(ft.apply(model, params, x, dropout_key=key), y), {}


def example_loss(params, x, y):  # one example: x, y are (T,); the model wants a batch of 1
    return loss_fn(params, (x[None], y[None]), None)[0]


# torch has no vmap rule for the CPU flash-attention kernel: it loops over the batch (correct, slower).
warnings.filterwarnings("ignore", message=".*not yet implemented the batching rule.*")
per_example_grads = torch.func.vmap(torch.func.grad(example_loss), in_dims=(None, 0, 0))
if args.compile:
    per_example_grads = torch.compile(per_example_grads, fullgraph=True, dynamic=False)
grads = per_example_grads(params, x, y)  # {name: (B, *shape)}
norms = torch.stack([g.flatten(1).square().sum(1) for g in grads.values()]).sum(0).sqrt()  # (B,)

# Cross-checks: a loop of single-example gradients, and the batch gradient (= their mean, since
# every example has the same number of tokens).
loop = [ft.value_and_grad(loss_fn, params, (x[i:i + 1], y[i:i + 1]), None)[2] for i in range(len(x))]
loop_norms = torch.stack([tree.global_norm(g) for g in loop])
assert torch.allclose(norms, loop_norms, rtol=1e-4, atol=1e-6), (norms, loop_norms)
_, _, batch_grads = ft.value_and_grad(loss_fn, params, (x, y), None)
for name, g in grads.items():
    assert torch.allclose(g.mean(0), batch_grads[name], rtol=1e-4, atol=1e-6), name

# DP-SGD-style per-example clipping: scale each example's gradient to norm <= clip, then average.
factor = (args.clip / (norms + 1e-6)).clamp(max=1.0)  # (B,)
clipped = {k: torch.einsum("b,b...->...", factor, g) / len(x) for k, g in grads.items()}
assert float(tree.global_norm(clipped)) <= args.clip + 1e-4

print("per-example grad norms:", " ".join(f"{v:.3f}" for v in norms.tolist()))
print(f"per_example_grad_norms: OK {len(x)} examples, norms {float(norms.min()):.3f}.."
      f"{float(norms.max()):.3f} (loop max diff {float((norms - loop_norms).abs().max()):.1e}), "
      f"clipped-mean norm {float(tree.global_norm(clipped)):.3f}")
