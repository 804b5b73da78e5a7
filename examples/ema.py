"""EMA of the params carried in the state: extend the state pytree, compose the train step.

The state becomes `EMAState(train: TrainState, ema: {name: tensor})`, still one pytree (a
NamedTuple). `ema_train_step` calls the eager train step built by `make_train_step(...,
compile=False)` and then updates the EMA with one fused `torch._foreach_lerp`; the composition
is a pure function `(state, batch) -> (state, metrics)`, so `--compile` compiles it whole as one
`torch.compile(fullgraph=True)` graph. The default keeps it pure (`donate=False`, out-of-place
lerp: the input state stays valid); `--donate` consumes the input instead, like the library's
donating step, and writes the EMA in place with `torch._foreach_lerp_`. The EMA weights are then
evaluated with `make_eval_step` by swapping them into the TrainState.

    python examples/ema.py [--steps 60] [--decay 0.9] [--donate] [--compile] [--cache-dir DIR]
"""

import argparse
import os
import tempfile
from typing import NamedTuple

import torch

import functrain as ft
from functrain import optim, rng, tree
from functrain.models import gpt

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--decay", type=float, default=0.9)
parser.add_argument("--donate", action="store_true", help="consume the input state (in-place EMA)")
parser.add_argument("--compile", action="store_true", help="torch.compile the composed step (~1 min on CPU)")
parser.add_argument("--cache-dir", default=os.environ.get(
    "FUNCTRAIN_CACHE_DIR", os.path.join(tempfile.gettempdir(), "functrain-data")))
parser.add_argument("--threads", type=int, default=1, help="a tiny model runs fastest on one thread")
args = parser.parse_args()
torch.set_num_threads(args.threads)

cfg = gpt.GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
with torch.device("meta"):
    model = gpt.GPT(cfg)


def loss_fn(params, batch, key):
    x, y = batch
    return gpt.cross_entropy(ft.apply(model, params, x, dropout_key=key), y), {}


class EMAState(NamedTuple):
    train: ft.TrainState
    ema: dict  # {name: tensor}, an exponential moving average of train.params


opt = optim.adamw(optim.warmup_cosine(3e-3, 5, args.steps), weight_decay=0.1)
train_step = ft.make_train_step(loss_fn, opt, compile=False, donate=args.donate)  # eager: composable


def ema_train_step(state: EMAState, batch):
    train, metrics = train_step(state.train, batch)
    ema, new = list(state.ema.values()), [train.params[k] for k in state.ema]
    if args.donate:  # the input state is consumed anyway: write the EMA into its buffers
        torch._foreach_lerp_(ema, new, 1.0 - args.decay)  # ema += (1 - decay) * (new - ema)
    else:  # pure: fresh tensors, the input state is left as it was
        ema = torch._foreach_lerp(ema, new, 1.0 - args.decay)
    return EMAState(train, dict(zip(state.ema, ema))), metrics


step = torch.compile(ema_train_step, fullgraph=True, dynamic=False) if args.compile else ema_train_step
eval_step = ft.make_eval_step(loss_fn, compile=False)

ds = ft.load_dataset("stdlib", args.cache_dir)
val = list(ft.eval_batches(ds.val, batch_size=32, block_size=cfg.block_size, num_batches=4))


def evaluate(train_state):
    return sum(float(eval_step(train_state, b)["loss"]) for b in val) / len(val)


params = gpt.init_params(model, rng.key(0))
state = EMAState(ft.init_state(params, opt, seed=0), tree.clone(params))
init_loss = evaluate(state.train)
ref = params["ln_f.weight"].clone()  # one leaf's EMA, recomputed by hand as a cross-check
for i in range(args.steps):
    batch = ft.get_batch(ds.train, batch_size=16, block_size=cfg.block_size, seed=0, step=i)
    before = None if args.donate else tree.clone(state)
    new_state, metrics = step(state, batch)
    if before is not None:  # purity: the input state is bit-identical after the call
        assert all(torch.equal(a, b) for a, b in zip(tree.leaves(before), tree.leaves(state)))
    state = new_state
    ref = args.decay * ref + (1.0 - args.decay) * state.train.params["ln_f.weight"]
    if i % 20 == 0 or i == args.steps - 1:
        print(f"step {i:3d} | loss {float(metrics['loss']):.3f}")

params_loss = evaluate(state.train)
ema_loss = evaluate(state.train.replace(params=state.ema))  # eval the EMA weights, same eval step
gap = max(float((state.ema[k] - v).abs().max()) for k, v in state.train.params.items())
assert gap > 0, "the EMA equals the params"
assert torch.allclose(state.ema["ln_f.weight"], ref, rtol=1e-5, atol=1e-6)
assert ema_loss < init_loss - 1.0, (init_loss, ema_loss)
print(f"ema: OK val loss init {init_loss:.3f} | params {params_loss:.3f} | ema {ema_loss:.3f} "
      f"| max |ema - params| {gap:.2e}")
