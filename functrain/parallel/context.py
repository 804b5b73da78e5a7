"""Context parallelism's attention: a sequence's tokens split over a process group, causal attention
over the whole sequence with each rank holding only its part.

Internals: docs/internals.md "functrain.parallel.context".

Example:
    >>> pos = context.positions(T, cp, cp_rank, device=x.device)        # (T/cp,) global positions
    >>> x_local = context.shard_sequence(x, cp, cp_rank)                 # (B, T/cp, ...)
    >>> y = context.attention(q, k, v, pos, group=(mesh, "cp"), world=cp)  # q, k, v: (B, H, T/cp, D)
    >>> cp_model = context.context_parallel(template, context.split_of(ctx.mesh))
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from functrain.parallel.collectives import all_gather, reduce_scatter, wait
from functrain.parallel.mesh import CP_AXIS
from functrain.parallel.tp import meta_copy

__all__ = [
    "KERNELS",
    "Split",
    "attention",
    "context_parallel",
    "gather_sequence",
    "position_rows",
    "positions",
    "shard_sequence",
    "split_of",
    "zigzag_attention",
]


KERNELS = ("zigzag", "stream", "mask")  # the attention's kernels (`split_of`)


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
        raise ValueError(
            f"sequence length {seq_len} must divide by 2 x the context-parallel ranks "
            f"({2 * world}): each rank holds two chunks"
        )
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
        full = wait(all_gather(moved, 0, group))  # (N L, ...)
        return full.movedim(0, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.dim, ctx.group, ctx.world = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, grad):
        with torch.no_grad():  # the collective's own autograd kernel is not a functorch-ready Function
            moved = grad.movedim(ctx.dim, 0).contiguous()  # (N L, ...)
            part = wait(reduce_scatter(moved, "sum", 0, ctx.group))  # (L, ...)
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


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    group: Any,
    world: int,
    scale: float | None = None,
) -> torch.Tensor:
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
    # grouped-query attention: each kv head serves H / Hkv queries
    k_all, v_all = _repeat(k_all, q.shape[1]), _repeat(v_all, q.shape[1])  # (B, H, T, D) each
    keys = torch.arange(k_all.shape[2], device=q.device)
    mask = pos[:, None] >= keys[None, :]  # (L, T): a query sees the keys at or before it
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)  # (B, H, L, D)


def _causal_from(q, k, v, start: int, scale):
    """Queries (B, H, c, D) at positions [start, start + c) over keys and values (B, H, >= start + c, D)
    in sequence order, causally, without a mask tensor: the queries sit after `start` zero rows in one
    causal attention over the first start + c keys (the zero rows' outputs are dropped, so nothing
    flows back from them)."""
    c = q.shape[2]
    k, v = k[:, :, : start + c], v[:, :, : start + c]  # (B, H, start + c, D)
    if start:
        q = torch.cat([q.new_zeros(*q.shape[:2], start, q.shape[3]), q], dim=2)  # (B, H, start + c, D)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[:, :, start:]  # (B, H, c, D)


def _slots(x: torch.Tensor) -> torch.Tensor:
    """A rank's (B, Hkv, L, D) as its two chunks, (2, B, Hkv, L / 2, D): gathered, rank r's sit at 2r, 2r + 1."""
    c = x.shape[2] // 2
    return x.view(*x.shape[:2], 2, c, x.shape[3]).permute(2, 0, 1, 3, 4).contiguous()


def _slot(j: int, world: int) -> int:
    """Where the sequence's chunk j sits among the gathered slots (zig-zag: rank j's first or rank 2N-1-j's second)."""
    return 2 * j if j < world else 2 * (2 * world - 1 - j) + 1


def _flash(q, k, v, causal: bool, scale):
    """Flash attention on CPU: (B, H, c, D) output and its (B, H, c) float32 log-sum-exp."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _flash_backward(grad, q, k, v, out, lse, causal: bool, scale):
    """Gradients of q, k, v for one block of keys, given the output and log-sum-exp over all keys."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def _owner(j: int, world: int) -> tuple[int, int]:
    """(rank, which of its two chunks) that holds the sequence's chunk j under the zig-zag split."""
    return (j, 0) if j < world else (2 * world - 1 - j, 1)


class _KeyChunks:
    """The sequence's key and value chunks, one at a time, for this rank's flash blocks.

    gather  all-gathered once, (2N, B, Hkv, c, D) each: one collective each, T rows of keys and of
            values held while the attention runs;
    stream  chunk j broadcast from its owner when asked for: 2N collectives, one chunk held at a time (eager).
    """

    def __init__(self, k, v, group, world: int, rank: int, stream: bool):
        self.k, self.v, self.group, self.world, self.rank, self.stream = k, v, group, world, rank, stream
        if not stream:
            self.full = [wait(all_gather(_slots(x), 0, group)) for x in (k, v)]  # (2N, B, Hkv, c, D) each

    def __call__(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk j's keys and values, (B, Hkv, c, D) each."""
        if not self.stream:
            return self.full[0][_slot(j, self.world)], self.full[1][_slot(j, self.world)]
        owner, half = _owner(j, self.world)
        c = self.k.shape[2] // 2
        # (k | v, B, Hkv, c, D): the owner's chunk, sent; the others receive into their own chunk at
        # the same place. Every rank builds the same ops: a compiled graph (CSE, the forward/backward
        # partition) then treats every rank's broadcasts alike, and no two chunks' are equal.
        part = torch.stack([x[:, :, half * c : (half + 1) * c] for x in (self.k, self.v)])
        kv = wait(funcol.broadcast(part, owner, self.group))
        return kv[0], kv[1]


def _repeat(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, Hkv, c, D) keys or values with each kv head repeated for the q heads it serves: (B, H, c, D)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x


class _ZigzagFlash(torch.autograd.Function):
    """The zig-zag split's causal attention on CPU, block by block (see `zigzag_attention`).

    Each of this rank's query chunks attends to the sequence's key chunks before it (no mask) and to
    its own (causal), one flash call per key chunk, the outputs merged by their log-sum-exps. Only
    this rank's q, k, v, output and log-sum-exp are kept for the backward, which fetches the key
    chunks again and runs the flash backward of each (query chunk, key chunk) block with the merged
    output and log-sum-exp (exact: a block's gradients need only the softmax's global normalizer);
    each key chunk's gradient is summed over the ranks into its owner's (a reduce-scatter of all of
    them when gathered, an all-reduce per chunk when streamed).
    """

    @staticmethod
    def forward(q, k, v, group, world, rank, scale, stream):
        chunks = _KeyChunks(k, v, group, world, rank, stream)
        heads, c = q.shape[1], q.shape[2] // 2
        mine = (rank, 2 * world - 1 - rank)  # this rank's chunks, as sequence chunk indices
        outs: list[Any] = [None, None]
        lses: list[Any] = [None, None]
        for jk in range(2 * world):
            kc, vc = chunks(jk)  # (B, Hkv, c, D) each
            for h, jq in enumerate(mine):
                if jk > jq:
                    continue
                o, lse = _flash(q[:, :, h * c : (h + 1) * c], _repeat(kc, heads), _repeat(vc, heads), jk == jq, scale)
                if outs[h] is None:
                    outs[h], lses[h] = o.float(), lse
                    continue
                total = torch.logaddexp(lses[h], lse)  # (B, H, c): merge the two softmaxes
                outs[h] = outs[h] * (lses[h] - total).exp()[..., None] + o.float() * (lse - total).exp()[..., None]
                lses[h] = total
        return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)  # (B, H, L, D), (B, H, L)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, ctx.group, ctx.world, ctx.rank, ctx.scale, ctx.stream = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, grad, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        n, heads, c = ctx.world, q.shape[1], q.shape[2] // 2
        mine = (ctx.rank, 2 * n - 1 - ctx.rank)
        f32 = dict(dtype=torch.float32, device=k.device)
        with torch.no_grad():
            chunks = _KeyChunks(k, v, ctx.group, n, ctx.rank, ctx.stream)
            dq = torch.zeros(q.shape, **f32)  # (B, H, L, D)
            halves = [slice(h * c, (h + 1) * c) for h in range(2)]
            # key and value gradients in float32: gathered, every chunk's (2N slots, reduce-scattered at
            # the end); streamed, this rank's (B, Hkv, L, D), each chunk's summed over the ranks when done
            if ctx.stream:
                dk, dv = torch.zeros(k.shape, **f32), torch.zeros(v.shape, **f32)
            else:
                dk, dv = (torch.zeros((2 * n, *k.shape[:2], c, k.shape[3]), **f32) for _ in range(2))

            def kv_heads(d):
                """A (B, H, c, D) key gradient on the kv heads: each sums over the q heads it served (GQA)."""
                return d if d.shape[1] == k.shape[1] else d.view(d.shape[0], k.shape[1], -1, *d.shape[2:]).sum(2)

            # zero, computed from the output's cotangent: a streamed chunk's gradient starts from it,
            # so its all-reduce stays in the backward even where this rank adds nothing to the chunk
            # (a compiled graph would move an all-reduce of plain zeros into the forward on that rank only)
            nil: Any = grad.reshape(-1)[:1].float() * 0 if ctx.stream else None
            for jk in range(2 * n):
                kc, vc = chunks(jk)
                if ctx.stream:  # this chunk's gradient from this rank's queries, (2, B, Hkv, c, D)
                    d = torch.stack([kc, vc]).float() * nil  # zeros, distinct per chunk (no CSE of two)
                    dkc, dvc = d[0], d[1]
                else:
                    dkc, dvc = dk[_slot(jk, n)], dv[_slot(jk, n)]
                kc, vc = _repeat(kc, heads), _repeat(vc, heads)  # (B, H, c, D) each
                for h, jq in enumerate(mine):
                    if jk > jq:
                        continue
                    p = halves[h]
                    dq_b, dk_b, dv_b = _flash_backward(
                        grad[:, :, p], q[:, :, p], kc, vc, out[:, :, p], lse[:, :, p], jk == jq, ctx.scale
                    )
                    dq[:, :, p] += dq_b
                    dkc += kv_heads(dk_b)
                    dvc += kv_heads(dv_b)
                    del dq_b, dk_b, dv_b
                del kc, vc, dkc, dvc
                if ctx.stream:
                    total = wait(funcol.all_reduce(d, "sum", ctx.group))  # summed over every rank's queries
                    del d
                    owner, half = _owner(jk, n)
                    if owner == ctx.rank:
                        dk[:, :, halves[half]], dv[:, :, halves[half]] = total[0], total[1]
                    del total
            del chunks  # (the gathered keys go now)
            grads = []
            for x, d in ((k, dk), (v, dv)):
                if not ctx.stream:  # (2N, ...) summed over ranks -> this rank's two chunks
                    d = wait(reduce_scatter(d, "sum", 0, ctx.group)).permute(1, 2, 0, 3, 4).reshape(x.shape)
                grads.append(d.to(x.dtype))  # (B, Hkv, L, D)
            del dk, dv, d
        return dq.to(q.dtype), grads[0], grads[1], None, None, None, None, None


def zigzag_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any,
    world: int,
    rank: int,
    scale: float | None = None,
    stream: bool = False,
) -> torch.Tensor:
    """`attention` for the zig-zag split's two chunks, with no (T/N) x T mask (see the module docstring).

    On CPU: flash calls of one chunk of queries and one chunk of keys each, merged by log-sum-exp, and
    a backward of its own that keeps only this rank's tensors (`_ZigzagFlash`). Elsewhere: each of
    the rank's two chunks attends to the keys up to its end through the causal kernel, its queries
    placed after zero rows (`_causal_from`; the zero rows cost kernel work and memory, not results).

    Args:
      q: (B, H, L, D) queries of this rank's L = T / world tokens (`positions` order).
      k: (B, Hkv, L, D) keys of the same tokens (Hkv divides H).
      v: (B, Hkv, L, D) values.
      group: the context-parallel group; world: its size; rank: this rank's index.
      scale: the softmax scale (default 1 / sqrt(D)).
      stream: on CPU, fetch the key and value chunks one at a time (an all-reduce each) instead of
        all-gathering them: one chunk's keys and values held instead of the whole sequence's.

    Returns:
      (B, H, L, D), equal to `attention(q, k, v, positions(T, world, rank), group, world)`.

    Example:
      >>> y = zigzag_attention(q, k, v, mesh["cp"], 2, 0)
    """
    if q.device.type == "cpu" and world > 1:
        # view_as: see gather_sequence
        return _ZigzagFlash.apply(q.view_as(q), k.view_as(k), v.view_as(v), group, world, rank, scale, stream)[0]
    k_all = gather_sequence(k, group, world, dim=2)  # (B, Hkv, T, D)
    v_all = gather_sequence(v, group, world, dim=2)  # (B, Hkv, T, D)
    # grouped-query attention: each kv head serves H / Hkv queries
    k_all, v_all = _repeat(k_all, q.shape[1]), _repeat(v_all, q.shape[1])  # (B, H, T, D) each
    c = q.shape[2] // 2
    first = _causal_from(q[:, :, :c], k_all, v_all, rank * c, scale)  # (B, H, c, D)
    last = _causal_from(q[:, :, c:], k_all, v_all, (2 * world - 1 - rank) * c, scale)  # (B, H, c, D)
    return torch.cat([first, last], dim=2)  # (B, H, L, D)


@functools.lru_cache(maxsize=64)
def _row_plan(rows: int, seq_len: int, world: int, rank: int) -> tuple[tuple, tuple, tuple]:
    """How a table of `rows` rows, `Shard(0)` over the group (torch.chunk: ceil(rows / N) per rank), reaches
    each rank's token positions: (this part's rows to send, in destination order; rows sent to each
    rank; rows received from each owner). A rank's positions ascend and each owner holds a run of
    rows, so the rows received in owner order are in position order."""
    c, h = -(-rows // world), seq_len // (2 * world)
    # positions(seq_len, world, q) as Python ints (a constant plan, also while Dynamo traces)
    want = [[*range(q * h, (q + 1) * h), *range((2 * world - 1 - q) * h, (2 * world - q) * h)] for q in range(world)]
    send = [[p - rank * c for p in want[q] if p // c == rank] for q in range(world)]
    return (
        tuple(i for s in send for i in s),
        tuple(len(s) for s in send),
        tuple(sum(p // c == o for p in want[rank]) for o in range(world)),
    )


class _PositionRows(torch.autograd.Function):
    """This rank's rows of a row-sharded table from their owners (an all-to-all); backward, each
    row's gradient back to its owner, summed there over the ranks that read it."""

    @staticmethod
    def forward(part, send, sends, recvs, group):
        return wait(funcol.all_to_all_single(part.index_select(0, send), recvs, sends, group))  # (L, C)

    @staticmethod
    def setup_context(ctx, inputs, output):
        part, send, ctx.sends, ctx.recvs, ctx.group = inputs
        ctx.rows = part.shape[0]
        ctx.save_for_backward(send)

    @staticmethod
    def backward(ctx, grad):
        (send,) = ctx.saved_tensors
        with torch.no_grad():  # the collective's own autograd kernel is not a functorch-ready Function
            back = wait(funcol.all_to_all_single(grad.contiguous(), ctx.sends, ctx.recvs, ctx.group))  # (sent, C)
            out = grad.new_zeros((ctx.rows, *grad.shape[1:])).index_add_(0, send, back)  # (rows of the part, C)
        return out, None, None, None, None


def position_rows(table: torch.Tensor, rows: int, seq_len: int, group: Any, world: int, rank: int) -> torch.Tensor:
    """A position table's rows at this rank's token positions (learned position embeddings).

    Args:
      table: the whole table (`rows` rows), or this rank's `Shard(0)` part of it over the group
        (torch.chunk's blocks: ceil(rows / N) rows per rank), what `functrain.parallel.spmd.Spmd`
        hands a stage for the parameters it names in `Stage.rows`.
      rows: the table's global row count.
      seq_len: the whole sequence's length T.
      group: the context-parallel group; world: its size; rank: this rank's index.

    Returns:
      (T / N, ...): the rows at `positions(seq_len, world, rank)`. From a part, each rank's rows come
      from their owners (one all-to-all, T / N rows per rank, never the whole table) and their
      gradients go back to them.

    Example:
      >>> pe = position_rows(wpe_part, block_size, T, mesh["cp"], 4, rank)   # (T / 4, C)
    """
    if seq_len > rows:
        raise ValueError(f"sequence length {seq_len} exceeds the position table's {rows} rows")
    if table.shape[0] == rows:
        return table.index_select(0, positions(seq_len, world, rank, device=table.device))
    send, sends, recvs = _row_plan(rows, seq_len, world, rank)
    index = torch.tensor(send, dtype=torch.long, device=table.device)
    # view_as: see gather_sequence
    return _PositionRows.apply(table.view_as(table), index, list(sends), list(recvs), group)


class Split(NamedTuple):
    """This rank's place in a sequence split over a context-parallel group (see the module docstring).

    Attributes:
      group: the cp group (a 1-D DeviceMesh or a ProcessGroup).
      world: its size N.
      rank: this rank's index in it.

    Example:
      >>> split = split_of(ctx.mesh)
      >>> x_local = split.shard(x)                         # (B, T) -> (B, T / N)
      >>> y = split.attention(q, k, v)                     # q: (B, H, T / N, D)
    """

    group: Any
    world: int
    rank: int
    kernel: str = "zigzag"  # KERNELS: "zigzag"/"stream" (`zigzag_attention`, no mask), "mask" (`attention`)

    def positions(self, local_len: int, device: Any = None) -> torch.Tensor:
        """(L,) the global positions of this rank's L tokens (the sequence is N x L long)."""
        return positions(local_len * self.world, self.world, self.rank, device=device)

    def position_rows(self, table: torch.Tensor, rows: int, local_len: int) -> torch.Tensor:
        """(L, ...) the rows of a position table (whole, or this rank's part) at this rank's positions."""
        return position_rows(table, rows, local_len * self.world, self.group, self.world, self.rank)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of `x`, whose `dim` is the whole sequence."""
        return shard_sequence(x, self.world, self.rank, dim)

    def attention(self, q, k, v, scale: float | None = None) -> torch.Tensor:
        """Causal attention of this rank's (B, H, L, D) queries over the whole sequence (`kernel`)."""
        if self.kernel == "mask":
            return attention(q, k, v, self.positions(q.shape[2], q.device), self.group, self.world, scale)
        return zigzag_attention(q, k, v, self.group, self.world, self.rank, scale, stream=self.kernel == "stream")

    def token_mean(self, local_mean: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """This rank's share of the mean over the whole sequence's counted targets, scaled by N.

        `local_mean` is the mean loss over this rank's counted targets (`targets != ignore_index`); the
        result is `N x local sum / global count`, so its average over the N ranks is the global mean
        and so is the average of its gradients. A rank with no counted target contributes 0 (its
        gradient is NaN, as a mean over nothing is; the step's non-finite guard skips it).
        """
        count = (targets != ignore_index).sum().to(torch.float32)  # this rank's counted targets
        with torch.no_grad():  # a count: nothing to differentiate, and collectives' autograd is not functorch's
            total = wait(funcol.all_reduce(count, "sum", self.group))
        local_sum = torch.where(count > 0, local_mean, torch.zeros_like(local_mean)) * count
        return local_sum * (self.world / total.clamp(min=1))


def split_of(mesh, kernel: str = "zigzag") -> Split | None:
    """This rank's `Split` of `mesh`'s cp axis.

    Args:
      mesh: the run's DeviceMesh (`ParallelContext.mesh`), or None.
      kernel: the attention's kernel (`KERNELS`): "zigzag" (keys and values all-gathered, no mask),
        "stream" (fetched a chunk at a time, no mask) or "mask" (all-gathered, one masked attention).

    Returns:
      A `Split` over the cp axis's group, or None when there is no mesh, no cp axis or it has one rank.

    Example:
      >>> split = split_of(ctx.mesh)    # mesh cp=2: Split(group=mesh["cp"], world=2, rank=...)
    """
    if mesh is None or CP_AXIS not in (mesh.mesh_dim_names or ()) or mesh[CP_AXIS].size() == 1:
        return None
    if kernel not in KERNELS:
        raise ValueError(f"context attention kernel {kernel!r}: use one of {', '.join(map(repr, KERNELS))}")
    return Split(mesh[CP_AXIS], mesh[CP_AXIS].size(), mesh.get_local_rank(CP_AXIS), kernel)


def context_parallel(model: nn.Module, split: Split | None) -> nn.Module:
    """A context-parallel copy of `model`: its modules that declare `context` hold `split`.

    Args:
      model: a model whose position-dependent modules have a `context` attribute (None by default),
        e.g. `functrain.models.gpt.GPT` or `Llama` (a meta template, or a tensor-parallel copy).
      split: `split_of(mesh)`; None returns `model` itself.

    Returns:
      `model` when `split` is None, else a storage-free copy (same parameter names) whose forward
      takes this rank's tokens (B, T / N) and computes what the model gives at their positions.

    Raises:
      ValueError: `model` has no module with a `context` attribute (it cannot split sequences).

    Example:
      >>> cp_model = context_parallel(template, split_of(ctx.mesh))
    """
    if split is None:
        return model
    out = meta_copy(model)
    aware: list[Any] = [m for m in out.modules() if hasattr(m, "context")]
    if not aware:
        raise ValueError(
            f"context_parallel: no module of {type(model).__name__} has a `context` attribute, "
            "so its positions and attention cannot follow a split sequence"
        )
    for m in aware:
        m.context = split
    return out
