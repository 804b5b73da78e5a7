"""A custom loss with aux metrics: label-smoothed cross-entropy + z-loss, trained with accumulation.

`loss_fn(params, batch, key) -> (loss, aux)` is all `make_train_step` needs; the aux metrics (NLL,
z-loss, accuracy) come back averaged over the 2 accumulation micro-batches. The smoothing term is
checked against torch's own `label_smoothing`.

    python examples/custom_loss.py [--steps 40] [--compile]
"""

import _common as common
import torch
import torch.nn.functional as F

import functrain as ft
from functrain import optim, rng
from functrain.models import gpt

args = common.parse(steps=40)
model, ds = common.tiny_gpt(), common.corpus(args)


def loss_fn(params, batch, key, z_coef=1e-4):
    x, y = batch
    logits = ft.apply(model, params, x, dropout_key=key).float()  # (B, T, V)
    lse = torch.logsumexp(logits, dim=-1)  # (B, T)
    logp = logits - lse[..., None]  # (B, T, V)
    nll = -logp.gather(-1, y[..., None]).squeeze(-1)  # (B, T)
    z_loss = (lse**2).mean()
    loss = (0.9 * nll - 0.1 * logp.mean(-1)).mean() + z_coef * z_loss  # smoothing 0.1
    acc = (logits.argmax(-1) == y).float().mean()
    return loss, {"nll": nll.mean().detach(), "z_loss": z_loss.detach(), "acc": acc}


schedule = optim.warmup_cosine(3e-3, 5, args.steps)
opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(schedule, weight_decay=0.1))
state, history = ft.init_state(gpt.init_params(model, rng.key(0)), opt, seed=0), []
step = ft.make_train_step(loss_fn, opt, accum_steps=2, compile=args.compile)  # aux averaged over 2
for i in range(args.steps):
    state, metrics = step(state, common.batch(args, ds, i))
    history.append({k: float(v) for k, v in metrics.items()})
x, y = common.batch(args, ds, 0)
ref = F.cross_entropy(ft.apply(model, state.params, x).flatten(0, 1), y.flatten(), label_smoothing=0.1)
assert torch.allclose(loss_fn(state.params, (x, y), None, z_coef=0.0)[0], ref, rtol=1e-5)
first, last = history[0], history[-1]
assert {"nll", "z_loss", "acc", "grad_norm", "lr"} <= last.keys() and last["nll"] < first["nll"] - 1.0
print(
    f"custom_loss: OK nll {first['nll']:.3f} -> {last['nll']:.3f}, z_loss {last['z_loss']:.2f}, acc {last['acc']:.3f}"
)
