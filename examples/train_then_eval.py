"""Train, and every N steps evaluate: two step functions over one state.

`make_train_step` gives `(state, batch) -> (state, metrics)` (dropout on, keyed by the state's RNG
and step counter); `make_eval_step` gives `(state, batch) -> metrics` with the same loss function
called with `key=None` (dropout off) and no gradients; it never changes the state. Both take the
same TrainState, so interleaving them is a plain loop. Validation uses a fixed set of windows from
the corpus's held-out files (`eval_batches`), so the numbers are comparable across evaluations.

    python examples/train_then_eval.py [--steps 60] [--eval-every 20] [--compile] [--cache-dir DIR]
"""

import argparse
import os
import tempfile

import torch

import functrain as ft
from functrain import optim, rng
from functrain.models import gpt

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--eval-every", type=int, default=20)
parser.add_argument("--compile", action="store_true", help="torch.compile both steps (~2 min on CPU)")
parser.add_argument("--cache-dir", default=os.environ.get(
    "FUNCTRAIN_CACHE_DIR", os.path.join(tempfile.gettempdir(), "functrain-data")))
parser.add_argument("--threads", type=int, default=1, help="a tiny model runs fastest on one thread")
args = parser.parse_args()
torch.set_num_threads(args.threads)

cfg = gpt.GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, dropout=0.1)
with torch.device("meta"):
    model = gpt.GPT(cfg)


def loss_fn(params, batch, key):  # key is None in the eval step: no dropout
    x, y = batch
    logits = ft.apply(model, params, x, dropout_key=key)
    acc = (logits.argmax(-1) == y).float().mean()
    return gpt.cross_entropy(logits, y), {"acc": acc}


opt = optim.chain(optim.clip_by_global_norm(1.0),
                  optim.adamw(optim.warmup_cosine(3e-3, 5, args.steps), weight_decay=0.1))
train_step = ft.make_train_step(loss_fn, opt, compile=args.compile)
eval_step = ft.make_eval_step(loss_fn, compile=args.compile)

ds = ft.load_dataset("stdlib", args.cache_dir)
val_batches = list(ft.eval_batches(ds.val, batch_size=32, block_size=cfg.block_size, num_batches=4))


def evaluate(state):
    """Mean of each eval metric over the fixed validation batches."""
    ms = [eval_step(state, b) for b in val_batches]
    return {k: sum(float(m[k]) for m in ms) / len(ms) for k in ms[0]}


state = ft.init_state(gpt.init_params(model, rng.key(0)), opt, seed=0)
history = [(0, evaluate(state))]
print(f"step   0 | val loss {history[0][1]['loss']:.3f} | val acc {history[0][1]['acc']:.3f}")
for i in range(1, args.steps + 1):
    batch = ft.get_batch(ds.train, batch_size=16, block_size=cfg.block_size, seed=0, step=i)
    state, metrics = train_step(state, batch)  # the old state is donated: use the new one
    if i % args.eval_every == 0 or i == args.steps:
        val = evaluate(state)
        history.append((i, val))
        print(f"step {i:3d} | train loss {float(metrics['loss']):.3f} | val loss {val['loss']:.3f} "
              f"| val acc {val['acc']:.3f} | lr {float(metrics['lr']):.2e}")

assert int(state.step) == args.steps
assert history[-1][1]["loss"] < history[0][1]["loss"] - 1.0, history
assert evaluate(state) == history[-1][1], "eval is not deterministic / changed the state"
print(f"train_then_eval: OK {len(history) - 1} evals, val loss {history[0][1]['loss']:.3f} -> "
      f"{history[-1][1]['loss']:.3f}, val acc {history[-1][1]['acc']:.3f}")
