"""Context parallelism's attention: a sequence's tokens split over a process group, causal attention
over the whole sequence with each rank holding only its part.

Split (zig-zag, as TorchTitan's load balancing): the sequence is cut into 2N chunks for N ranks and
rank r holds chunks r and 2N-1-r. Under a causal mask a token attends to the tokens before it, so an
early chunk is cheap and a late one dear; pairing them gives every rank the same attention work
(N=2, T=8: rank 0 holds positions 0,1,6,7 and rank 1 positions 2,3,4,5).

Attention (all-gather, the Llama 3 paper's choice for long sequences): each rank computes queries,
keys and values for its own tokens, gathers every rank's keys and values (grouped-query attention
gathers the few kv heads, not the repeated ones), puts them in sequence order and attends with the
causal mask written in global positions (a query at position p sees keys at positions <= p). The
scores a rank holds are (T/N) x T: 1/N of one rank's full attention. The gather's backward is a
reduce-scatter: each rank gets the gradient of its own keys and values summed over every rank's
queries. Rotary or learned positions take `positions` (the global positions of the rank's tokens).

The collectives are functional collectives inside a `torch.autograd.Function`: they work under
`torch.func.grad_and_value`, eagerly and inside `torch.compile(fullgraph=True)`.

Example:
    >>> pos = context.positions(T, cp, cp_rank, device=x.device)        # (T/cp,) global positions
    >>> x_local = context.shard_sequence(x, cp, cp_rank)                 # (B, T/cp, ...)
    >>> y = context.attention(q, k, v, pos, group=(mesh, "cp"), world=cp)  # q, k, v: (B, H, T/cp, D)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from functrain.parallel.spmd import _all_gather, _reduce_scatter, _wait  # (torch's renamed collectives)

__all__ = ["attention", "gather_sequence", "positions", "shard_sequence"]


def positions(seq_len: int, world: int, rank: int, device: Any = None) -> torch.Tensor:
    """The global positions of the tokens rank `rank` of `world` holds under the zig-zag split.

    Args:
      seq_len: the sequence length T (a multiple of 2 x world).
      world: the number of ranks the sequence is split over (N).
      rank: this rank's index in [0, N).
      device: where the positions are made.

    Returns:
      (T / N,) int64: chunk `rank` then chunk `2N - 1 - rank`, each `T / 2N` consecutive positions.

    Example:
      >>> positions(8, 2, 0)    # tensor([0, 1, 6, 7])
    """
    if seq_len % (2 * world):
        raise ValueError(f"sequence length {seq_len} must divide by 2 x the context-parallel ranks "
                         f"({2 * world}): each rank holds two chunks")
    c = seq_len // (2 * world)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    last = torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c, device=device)
    return torch.cat([first, last])


def shard_sequence(x: torch.Tensor, world: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `x` (the zig-zag split along `dim`).

    Args:
      x: a tensor whose `dim` is the whole sequence (T).
      world: the number of ranks the sequence is split over.
      rank: this rank's index.
      dim: the sequence dimension.

    Returns:
      `x` with `dim` cut to this rank's T / world tokens, in `positions` order.

    Example:
      >>> idx_local = shard_sequence(idx, cp, cp_rank)   # (B, T) -> (B, T / cp)
    """
    return x.index_select(dim, positions(x.shape[dim], world, rank, device=x.device))


def _natural_order(seq_len: int, world: int, device) -> torch.Tensor:
    """Where each position sits in the rank-ordered concatenation of every rank's tokens."""
    order = torch.cat([positions(seq_len, world, r) for r in range(world)])  # slot -> position
    return torch.argsort(order).to(device)  # position -> slot


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim` forward (rank order), reduce-scatter (sum) of the gradient backward."""

    @staticmethod
    def forward(x, dim, group, world):
        moved = x.movedim(dim, 0).contiguous()  # (L, ...)
        full = _wait(_all_gather(moved, 0, group))  # (N L, ...)
        return full.movedim(0, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.dim, ctx.group, ctx.world = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, grad):
        with torch.no_grad():  # the collective's own autograd kernel is not a functorch-ready Function
            moved = grad.movedim(ctx.dim, 0).contiguous()  # (N L, ...)
            part = _wait(_reduce_scatter(moved, "sum", 0, ctx.group))  # (L, ...)
        return part.movedim(0, ctx.dim), None, None, None


def gather_sequence(x: torch.Tensor, group: Any, world: int, dim: int = 2) -> torch.Tensor:
    """The whole sequence of `x` from every rank's part, in sequence order (differentiable).

    Args:
      x: this rank's tokens along `dim` (zig-zag split, `shard_sequence`).
      group: the context-parallel group (a ProcessGroup, or `(mesh, axis name)`); None for one rank.
      world: its size.
      dim: the sequence dimension.

    Returns:
      `x` with `dim` the whole sequence T = world x the local length, position 0 first. Its gradient
      flows back to each rank's part (a reduce-scatter).

    Example:
      >>> k_full = gather_sequence(k, group, cp, dim=2)   # (B, Hkv, T/cp, D) -> (B, Hkv, T, D)
    """
    if world == 1:
        return x
    # view_as: Dynamo fails to trace the Function on an input of the transformed function itself
    # (a GradTrackingTensor leaf; torch 2.13), and an op in between is all it needs.
    full = _GatherSequence.apply(x.view_as(x), dim, group, world)  # rank-ordered
    return full.index_select(dim, _natural_order(full.shape[dim], world, x.device))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, group: Any,
              world: int, scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values.

    Args:
      q: (B, H, L, D) queries of this rank's L = T / world tokens.
      k: (B, Hkv, L, D) keys of the same tokens (Hkv divides H: grouped-query attention).
      v: (B, Hkv, L, D) values.
      pos: (L,) the global positions of this rank's tokens (`positions(T, world, rank)`).
      group: the context-parallel group (see `gather_sequence`); None for one rank.
      world: its size.
      scale: the softmax scale (default 1 / sqrt(D)).

    Returns:
      (B, H, L, D): what full causal attention over the T tokens gives at this rank's positions.

    Example:
      >>> y = attention(q, k, v, pos, (mesh, "cp"), cp)   # (B, H, T/cp, D)
    """
    k_all = gather_sequence(k, group, world, dim=2)  # (B, Hkv, T, D)
    v_all = gather_sequence(v, group, world, dim=2)  # (B, Hkv, T, D)
    if k_all.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves H / Hkv queries
        k_all = k_all.repeat_interleave(q.shape[1] // k_all.shape[1], dim=1)  # (B, H, T, D)
        v_all = v_all.repeat_interleave(q.shape[1] // v_all.shape[1], dim=1)  # (B, H, T, D)
    keys = torch.arange(k_all.shape[2], device=q.device)
    mask = pos[:, None] >= keys[None, :]  # (L, T): a query sees the keys at or before it
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)  # (B, H, L, D)
