"""Custom loss: label-smoothed cross-entropy + z-loss, with aux metrics, in `make_train_step`.

A loss is any pure `loss_fn(params, batch, key) -> (loss, aux)`. The step differentiates `loss`
and reports every aux entry (0-d tensors, averaged over microbatches) next to its own `loss`,
`grad_norm`, `lr`, ... Here the loss is cross-entropy with label smoothing plus the PaLM z-loss
`z_coef * logsumexp(logits)**2`, which keeps the softmax normalizer near 1; aux carries the plain
NLL, the z-loss and the accuracy. Trains a tiny GPT on the stdlib corpus.

    python examples/custom_loss.py [--steps 40] [--compile] [--cache-dir DIR]
"""

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F

import functrain as ft
from functrain import optim, rng
from functrain.models import gpt

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--compile", action="store_true", help="torch.compile the step (~1 min on CPU)")
parser.add_argument("--cache-dir", default=os.environ.get(
    "FUNCTRAIN_CACHE_DIR", os.path.join(tempfile.gettempdir(), "functrain-data")))
parser.add_argument("--threads", type=int, default=1, help="a tiny model runs fastest on one thread")
args = parser.parse_args()
torch.set_num_threads(args.threads)


def smoothed_ce_with_z_loss(logits, targets, smoothing=0.1, z_coef=1e-4):
    """(loss, aux) for logits (B, T, V) and int64 targets (B, T)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)  # (B, T)
    logp = logits - lse[..., None]  # (B, T, V)
    nll = -logp.gather(-1, targets[..., None]).squeeze(-1)  # (B, T)
    uniform_ce = -logp.mean(dim=-1)  # (B, T): cross-entropy against the uniform distribution
    z_loss = (lse**2).mean()
    loss = ((1 - smoothing) * nll + smoothing * uniform_ce).mean() + z_coef * z_loss
    acc = (logits.argmax(-1) == targets).float().mean()
    return loss, {"nll": nll.mean().detach(), "z_loss": z_loss.detach(), "acc": acc}


# The smoothing term is torch's own label smoothing: check it (z-loss off) on random logits.
logits, targets = torch.randn(2, 8, 256), torch.randint(0, 256, (2, 8))
ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=0.1)
assert torch.allclose(smoothed_ce_with_z_loss(logits, targets, z_coef=0.0)[0], ref, atol=1e-5)

cfg = gpt.GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, dropout=0.0)
with torch.device("meta"):
    model = gpt.GPT(cfg)  # a storage-free template; the weights live in the state


def loss_fn(params, batch, key):
    x, y = batch
    return smoothed_ce_with_z_loss(ft.apply(model, params, x, dropout_key=key), y)


ds = ft.load_dataset("stdlib", args.cache_dir)
opt = optim.chain(optim.clip_by_global_norm(1.0),
                  optim.adamw(optim.warmup_cosine(3e-3, 5, args.steps), weight_decay=0.1))
state = ft.init_state(gpt.init_params(model, rng.key(0)), opt, seed=0)
step = ft.make_train_step(loss_fn, opt, accum_steps=2, compile=args.compile)  # aux averaged over 2
for i in range(args.steps):
    batch = ft.get_batch(ds.train, batch_size=16, block_size=cfg.block_size, seed=0, step=i)
    state, metrics = step(state, batch)
    m = {k: float(v) for k, v in metrics.items()}
    if i == 0:
        first = m
    if i % 10 == 0 or i == args.steps - 1:
        print(f"step {i:3d} | loss {m['loss']:.3f} | nll {m['nll']:.3f} | z {m['z_loss']:.2f} "
              f"| acc {m['acc']:.3f} | lr {m['lr']:.2e}")

assert {"loss", "nll", "z_loss", "acc", "grad_norm", "lr"} <= m.keys(), m.keys()
assert m["nll"] < first["nll"] - 1.0, (first["nll"], m["nll"])
print(f"custom_loss: OK nll {first['nll']:.3f} -> {m['nll']:.3f}, z_loss {m['z_loss']:.2f}, "
      f"acc {m['acc']:.3f}")
