"""Frozen parameters (position embedding + first block), two ways; frozen leaves stay bit-identical.

  split: the state holds only the trainable params; the loss closes over the frozen ones and
         merges them in for `functrain.apply`. No gradients, no optimizer state and no updates
         exist for the frozen leaves (the cheap way: fine-tuning, adapters, linear probes).
  mask:  the state holds every param and the optimizer freezes by mask:
         `chain(masked(adamw, trainable), masked(scale(0.0), frozen))`. Adam keeps state only for
         the trainable leaves (`masked` selects them); the frozen updates are zeroed. Gradients
         are still computed for the frozen leaves (wasted work), but the state keeps one layout.
Both runs see the same data, so their trainable params must agree too.

    python examples/frozen_params.py [--steps 30] [--compile] [--cache-dir DIR]
"""

import argparse
import os
import tempfile

import torch

import functrain as ft
from functrain import optim, rng, tree
from functrain.models import gpt

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--compile", action="store_true", help="torch.compile the steps (~1 min each on CPU)")
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


def is_frozen(name):  # the lower layers; fine-tune the rest (not wte: it is also the tied head)
    return name == "wpe.weight" or name.startswith("blocks.0.")


frozen = {k: v for k, v in params.items() if is_frozen(k)}
trainable = {k: v for k, v in params.items() if not is_frozen(k)}
adamw = optim.adamw(optim.warmup_cosine(3e-3, 5, args.steps), weight_decay=0.1)


def loss_fn(params, batch, key):
    x, y = batch
    return gpt.cross_entropy(ft.apply(model, params, x, dropout_key=key), y), {}


def split_loss_fn(trainable, batch, key):  # differentiated w.r.t. `trainable` only
    return loss_fn({**trainable, **frozen}, batch, key)


mask_opt = optim.chain(
    optim.masked(adamw, lambda p: {k: not is_frozen(k) for k in p}),
    optim.masked(optim.scale(0.0), lambda p: {k: is_frozen(k) for k in p}),
)
runs = {"split": (split_loss_fn, adamw, trainable), "mask": (loss_fn, mask_opt, params)}
final, opt_numbers = {}, {}
for name, (fn, opt, start) in runs.items():
    state = ft.init_state(start, opt, seed=0)  # copies `start`: the originals stay as they are
    step = ft.make_train_step(fn, opt, compile=args.compile)
    for i in range(args.steps):
        x, y = ft.get_batch(ds.train, batch_size=16, block_size=cfg.block_size, seed=0, step=i)
        state, metrics = step(state, (x, y))
        if i == 0:
            first = float(metrics["loss"])
    last = float(metrics["loss"])
    trained = {**frozen, **state.params} if name == "split" else state.params
    print(f"{name:5s}: loss {first:.3f} -> {last:.3f}, {len(state.params)} params in the state, "
          f"{tree.size(state.opt_state):,} optimizer-state numbers")
    assert last < first - 1.0, (name, first, last)
    for k, p in params.items():
        if is_frozen(k):  # bit for bit
            assert torch.equal(trained[k].view(torch.int32), p.view(torch.int32)), (name, k)
        else:
            assert not torch.equal(trained[k], p), (name, k, "did not train")
    final[name], opt_numbers[name] = trained, tree.size(state.opt_state)

diff = max(float((final["split"][k] - final["mask"][k]).abs().max()) for k in trainable)
assert diff < 1e-5, diff
assert opt_numbers["split"] == opt_numbers["mask"], opt_numbers  # no Adam moments for frozen leaves
print(f"frozen_params: OK {len(frozen)} frozen leaves bit-identical after {args.steps} steps "
      f"(split and mask), {len(trainable)} trained; split vs mask max diff {diff:.1e}")
