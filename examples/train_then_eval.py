"""A train step (dropout on) and an eval step (dropout off, no gradients) over one state.

The loss returns accuracy as an aux metric; `make_eval_step` runs the same loss with no dropout
key and no gradients on fixed held-out batches every `--eval-every` steps. Checks: the val loss
falls, and evaluating twice gives the same numbers (eval neither draws randomness nor changes the
state).

    python examples/train_then_eval.py [--steps 60] [--eval-every 20] [--compile]
"""

import _common as common

import functrain as ft
from functrain import optim, rng
from functrain.models import gpt

args = common.parse(steps=60, eval_every=20)
model, ds = common.tiny_gpt(dropout=0.1), common.corpus(args)


def loss_fn(params, batch, key):  # key is None in the eval step: no dropout
    x, y = batch
    logits = ft.apply(model, params, x, dropout_key=key)  # (B, T, V)
    return gpt.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


opt = optim.chain(
    optim.clip_by_global_norm(1.0), optim.adamw(optim.warmup_cosine(3e-3, 5, args.steps), weight_decay=0.1)
)
train_step = ft.make_train_step(loss_fn, opt, compile=args.compile)
eval_step, val = ft.make_eval_step(loss_fn, compile=args.compile), common.val_batches(ds)


def evaluate(state):  # the mean of each eval metric over the fixed validation batches
    ms = [eval_step(state, b) for b in val]
    return {k: sum(float(m[k]) for m in ms) / len(ms) for k in ms[0]}


state = ft.init_state(gpt.init_params(model, rng.key(0)), opt, seed=0)
history = [evaluate(state)]
for i in range(1, args.steps + 1):
    state, metrics = train_step(state, common.batch(args, ds, i))  # the old state is donated
    if i % args.eval_every == 0 or i == args.steps:
        history.append(evaluate(state))
        print(
            f"step {i:3d} | train loss {float(metrics['loss']):.3f} | val loss {history[-1]['loss']:.3f} "
            f"| val acc {history[-1]['acc']:.3f}"
        )
assert int(state.step) == args.steps and history[-1]["loss"] < history[0]["loss"] - 1.0, history
assert evaluate(state) == history[-1], "eval is not deterministic / changed the state"
print(
    f"train_then_eval: OK {len(history) - 1} evals, val loss {history[0]['loss']:.3f} -> "
    f"{history[-1]['loss']:.3f}, val acc {history[-1]['acc']:.3f}"
)
