"""A small BatchNorm CNN, its batches and a plain PyTorch training loop: the reference of the model-state tests.

`torch_loop(model, batches, shards, sync)` trains a copy of `model` with `torch.optim.AdamW` and
`clip_grad_norm_` as a data-parallel run of `shards` ranks would, in one process: each rank's rows
go through their own forward (BatchNorm normalizes with that rank's batch statistics and updates its
own copy of the running statistics), the gradients are the ranks' mean, and the statistics kept are
rank 0's ("broadcast", as DDP's broadcast_buffers) or the ranks' mean ("mean"). With one shard it is
the ordinary torch loop.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import functrain as ft
from functrain import optim

LR, CLIP = 1e-2, 1.0


class CNN(nn.Module):
    """conv (no bias: BatchNorm removes it) -> BatchNorm2d -> ReLU -> dropout -> mean pool -> linear."""

    def __init__(self, p: float = 0.0, classes: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(8, classes)

    def forward(self, x):  # x: (B, 3, H, W)
        h = F.relu(self.bn(self.conv(x)))  # (B, 8, H, W)
        return self.head(self.drop(h.mean((2, 3))))  # (B, classes)


def model(seed: int = 0, p: float = 0.0) -> CNN:
    """The CNN with its init drawn from `seed`."""
    torch.manual_seed(seed)
    return CNN(p)


def batches(n: int, size: int = 16, seed: int = 1, shift_second_half: float = 1.0):
    """`n` batches (x (size, 3, 6, 6), y (size,)); the second half of each batch's rows is shifted, so
    that two data-parallel ranks see different statistics."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(size, 3, 6, 6, generator=g)
        x[size // 2 :] += shift_second_half
        out.append((x, torch.randint(0, 4, (size,), generator=g)))
    return out


def optimizer():
    """Clipping + AdamW, as the torch loop runs them."""
    return optim.chain(optim.clip_by_global_norm(CLIP), optim.adamw(LR, weight_decay=0.0))


def loss_fn_for(template: nn.Module):
    """The functrain loss with model state: cross-entropy of the CNN's logits."""

    def loss_fn(params, batch, key, model_state):
        x, y = batch
        logits, model_state = ft.apply(template, params, x, model_state=model_state)
        return F.cross_entropy(logits, y), {}, model_state

    return loss_fn


def torch_loop(template: nn.Module, batches, shards: int = 1, sync: str = "broadcast"):
    """(losses, final module) of the plain torch loop, as `shards` data-parallel ranks would train."""
    net = copy.deepcopy(template).train()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
    params = dict(net.named_parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad()
        if shards == 1:  # the ordinary loop: the module updates its own statistics
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
            opt.step()
            losses.append(loss.item())
            continue
        start = {k: b.clone() for k, b in net.named_buffers()}
        total, kept = 0.0, []
        for xs, ys in zip(x.chunk(shards), y.chunk(shards)):
            bufs = {k: b.clone() for k, b in start.items()}  # this rank's copy of the statistics
            loss = F.cross_entropy(torch.func.functional_call(net, {**params, **bufs}, (xs,)), ys) / shards
            loss.backward()
            total += loss.item()
            kept.append(bufs)
        with torch.no_grad():
            for k, b in net.named_buffers():
                if sync == "mean" and b.is_floating_point():
                    b.copy_(torch.stack([s[k] for s in kept]).mean(0))
                else:
                    b.copy_(kept[0][k])
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        losses.append(total)
    return losses, net
