"""Per-example gradients and their norms with `functrain.per_example`, checked two ways.

`per_example.grads` is `vmap(grad_and_value)` of the train step's own loss over the examples (each
one a batch of one); `--compile` compiles it as one graph. Checks: the norms equal a Python loop of
single-example gradients, and the mean of the per-example gradients equals the batch gradient
(every example has the same number of tokens). Then DP-SGD-style clipping bounds the mean's norm.

    python examples/per_example_grad_norms.py [--batch 8] [--clip 1.0] [--compile]
"""

import _common as common
import torch

import functrain as ft
from functrain import per_example, rng, tree
from functrain.models import gpt

args = common.parse(batch=8, clip=1.0)
model, ds = common.tiny_gpt(), common.corpus(args)
params, loss_fn = gpt.init_params(model, rng.key(0)), gpt.make_loss_fn(model)
x, y = common.batch(args, ds, 0)


def grads_and_norms(params, batch):
    grads, losses, _ = per_example.grads(loss_fn, params, batch)  # {name: (B, *shape)}, (B,)
    return grads, per_example.norms(grads)


fn = torch.compile(grads_and_norms, fullgraph=True) if args.compile else grads_and_norms
grads, norms = fn(params, (x, y))
loop = [ft.value_and_grad(loss_fn, params, (x[i : i + 1], y[i : i + 1]), None)[2] for i in range(len(x))]
loop_norms = torch.stack([tree.global_norm(g) for g in loop])
assert torch.allclose(norms, loop_norms, rtol=1e-4, atol=1e-6), (norms, loop_norms)
batch_grads = ft.value_and_grad(loss_fn, params, (x, y), None)[2]
assert all(torch.allclose(g.mean(0), batch_grads[k], rtol=1e-4, atol=1e-6) for k, g in grads.items())
clipped_sum, _ = per_example.clipped_sum(grads, args.clip)
assert float(tree.global_norm(clipped_sum)) <= len(x) * args.clip * (1 + 1e-5)
print("per-example grad norms:", " ".join(f"{v:.3f}" for v in norms.tolist()))
print(
    f"per_example_grad_norms: OK {len(x)} examples, norms {float(norms.min()):.3f}..{float(norms.max()):.3f} "
    f"(loop max diff {float((norms - loop_norms).abs().max()):.1e}), "
    f"clipped-mean norm {float(tree.global_norm(clipped_sum)) / len(x):.3f}"
)
