"""A small CNN with BatchNorm, trained by functrain and checked against the plain PyTorch loop.

BatchNorm's running statistics are model state (`TrainState.model_state`, taken from the module by
`init_state`): the loss takes them as a fourth argument and returns the updated ones that
`functrain.apply(..., model_state=...)` gives back. The train step runs the module in training mode
and the eval step in eval mode (running statistics, no updates), whatever mode the module was left
in. Checks, on synthetic images: over `--steps` AdamW steps the losses and the running statistics
equal the torch loop's within float32 tolerance and `num_batches_tracked` is equal; the eval-mode
loss equals torch's `model.eval()` loss.

    python examples/batchnorm.py [--steps 20] [--compile]
"""

import copy

import _common as common
import torch
import torch.nn.functional as F
from torch import nn

import functrain as ft
from functrain import optim

args = common.parse(steps=20, batch=32)
torch.manual_seed(0)
conv = [nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]  # (B, 16, 8, 8)
net = nn.Sequential(*conv, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))  # (B, 4)
ref, data = copy.deepcopy(net), common.synthetic_images(args.steps + 1, args.batch)  # the torch loop trains ref


def loss_fn(params, batch, key, model_state):
    x, y = batch
    logits, model_state = ft.apply(net, params, x, model_state=model_state)  # (B, 4)
    return F.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}, model_state


opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.0))
state, torch_opt = ft.init_state(net, opt), torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
step = ft.make_train_step(loss_fn, opt, compile=args.compile)
evaluate = ft.make_eval_step(loss_fn, compile=args.compile)  # eval mode: running statistics, no updates
tol = 16 * torch.finfo(torch.float32).eps * (args.batch * 27) ** 0.5 * args.steps  # reductions of B*27 terms, fed back
for x, y in data[:-1]:
    state, metrics = step(state, (x, y))
    torch_opt.zero_grad()
    (loss := F.cross_entropy(ref(x), y)).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    torch_opt.step()
    assert abs(float(metrics["loss"]) - loss.item()) <= tol * loss.item(), (float(metrics["loss"]), loss.item())
for name, buf in ref.named_buffers():
    assert torch.allclose(state.model_state[name].double(), buf.double(), rtol=tol, atol=tol), name
assert int(state.model_state["1.num_batches_tracked"]) == args.steps and not net[1].num_batches_tracked
ref.eval()
val, want = evaluate(state, data[-1]), F.cross_entropy(ref(data[-1][0]), data[-1][1])
assert abs(float(val["loss"]) - float(want)) <= tol * float(want), (float(val["loss"]), float(want))
loss, val_loss, acc = (f"{float(v):.3f}" for v in (metrics["loss"], val["loss"], val["acc"]))
print(f"batchnorm: OK {args.steps} steps equal to the torch loop, loss {loss}, eval loss {val_loss}, eval acc {acc}")
