"""The token-weighted loss's shared problem: a tiny GPT, batches whose rows have different numbers of
targets (two rows none at all), and the reference gradient of one process: the sum of the
cross-entropy over every target of the global batch divided by their count, by plain autograd."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from functrain import apply, optim, rng
from functrain.models import gpt, lm

ROWS, T, V = 8, 16, 64


def model() -> gpt.GPT:
    """The tiny GPT every variant starts from (the same weights everywhere)."""
    cfg = gpt.GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=False)
    return gpt.GPT(cfg, key=rng.key(0))


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of ROWS rows: row i learns only its last targets (2 to T of them), rows 2 and 3 none."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (ROWS, T), generator=g)
    y = (3 * x + 1) % V
    start = torch.randint(0, T - 1, (ROWS,), generator=g)  # the prompt's length per row
    start[2] = start[3] = T  # a microbatch of prompts only (rows 2-3 in the (2 x 2) x 2 split)
    y = torch.where(torch.arange(T)[None] >= start[:, None], y, torch.full_like(y, -1))
    return x, y


def reference_grads(m: gpt.GPT, params: dict, x: torch.Tensor, y: torch.Tensor):
    """(loss, grads) of sum CE over every target / their count, one process, plain autograd."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    logits = apply(m, leaves, x)  # (B, T, V)
    total = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-1, reduction="sum")
    loss = total / (y != -1).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss.detach(), dict(zip(leaves, grads))


def sgd():
    """Plain SGD at lr 1: one step's params move by exactly minus the gradient."""
    return optim.sgd(1.0)


def loss_fn(m):
    """The GPT family's own loss."""
    return gpt.make_loss_fn(m)


COUNT = lm.count_targets()


def packed_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, y, positions) of ROWS packed rows: documents of 2 to 7 pairs, each restarting its positions,
    each learning all but its first 2 targets."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (ROWS, T), generator=g)
    y = (3 * x + 1) % V
    pos = torch.zeros(ROWS, T, dtype=torch.long)
    for r in range(ROWS):
        at = 0
        while at < T:
            n = min(int(torch.randint(2, 8, (1,), generator=g)), T - at)
            pos[r, at : at + n] = torch.arange(n)
            at += n
    y = torch.where(pos >= 2, y, torch.full_like(y, -1))
    return x, y, pos


def reference_packed(m: gpt.GPT, params: dict, x, y, pos):
    """(loss, grads) of the packed rows by plain autograd through the model's own (unstaged) forward."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    logits = apply(m, leaves, x, packed=lm.packed(pos))  # (B, T, V)
    total = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-1, reduction="sum")
    loss = total / (y != -1).sum()
    return loss.detach(), dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
