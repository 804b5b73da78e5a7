"""One rank of the context-parallel attention tests (launched by tests/test_context.py).

    python tests/_context_worker.py <outdir>

Every rank makes the same full q, k, v and output weights, computes full causal attention and its
gradients as the reference, then the context-parallel attention of its zig-zag part (eager, and
under torch.compile(fullgraph=True) through torch.func.grad_and_value, as the train step runs), and
checks `position_rows` from a part of a table against the whole table, and writes {scenario: "ok"
or the mismatch} to <outdir>/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F

from functrain.parallel import context

EPS32 = torch.finfo(torch.float32).eps


def _full(b, h, hkv, t, d, seed=0):
    """The full sequence's q (B, H, T, D), k and v (B, Hkv, T, D) and the output weights (B, H, T, D)."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, h, t, d, generator=g),
        torch.randn(b, hkv, t, d, generator=g),
        torch.randn(b, hkv, t, d, generator=g),
        torch.randn(b, h, t, d, generator=g),
    )


def _reference(q, k, v, w):
    """Full causal attention, and the gradients of sum(out * w) for q, k, v."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _check(name, got, want, t):
    # Each output and gradient is a softmax-weighted sum over at most T keys (and, for k and v, over
    # the queries of every rank): a few float32 roundings per term, the terms O(1).
    tol = 8 * t * EPS32
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def scenario(h, hkv, compiled, group, world, rank, kernel="mask"):
    b, t, d = 2, 8 * world, 8
    q, k, v, w = _full(b, h, hkv, t, d)
    ref_out, ref_dq, ref_dk, ref_dv = _reference(q, k, v, w)
    pos = context.positions(t, world, rank)
    ql, kl, vl, wl = (context.shard_sequence(x, world, rank, dim=2) for x in (q, k, v, w))

    def loss(ql, kl, vl):
        if kernel == "mask":
            out = context.attention(ql, kl, vl, pos, group, world)  # (B, H, T / world, D)
        else:
            out = context.zigzag_attention(ql, kl, vl, group, world, rank, stream=kernel == "stream")
        return (out * wl).sum(), out

    if compiled:
        grad_fn = torch.func.grad_and_value(loss, argnums=(0, 1, 2), has_aux=True)
        if compiled == "compiled":
            grad_fn = torch.compile(grad_fn, backend="aot_eager", fullgraph=True)
        (dq, dk, dv), (_, out) = grad_fn(ql, kl, vl)
    else:
        ql, kl, vl = (x.clone().requires_grad_() for x in (ql, kl, vl))
        total, out = loss(ql, kl, vl)
        total.backward()
        dq, dk, dv = ql.grad, kl.grad, vl.grad
    _check("out", out.detach(), ref_out[:, :, pos], t)
    _check("dq", dq, ref_dq[:, :, pos], t)
    _check("dk", dk, ref_dk[:, :, pos], t)
    _check("dv", dv, ref_dv[:, :, pos], t)


def rows_scenario(rows, compiled, group, world, rank):
    """`position_rows` from this rank's Shard(0) part of a table equals the whole table's rows at its
    positions, and its gradient is the whole table's gradient on the part's rows: both exactly (copies,
    and each row read by one rank)."""
    t, c = 4 * world, -(-rows // world)
    g = torch.Generator().manual_seed(1)
    table, w = torch.randn(rows, 3, generator=g), torch.randn(t, 3, generator=g)  # w: (T, C) output weights
    pos = context.positions(t, world, rank)
    full = table.clone().requires_grad_()
    (full[:t] * w).sum().backward()  # the reference: every position's row, weighted
    part = table[rank * c : (rank + 1) * c]  # (<= c, 3): torch.chunk's block, as a Shard(0) DTensor holds it

    def loss(part):
        out = context.position_rows(part, rows, t, group, world, rank)  # (T / world, 3)
        return (out * w[pos]).sum(), out

    grad_fn = torch.func.grad_and_value(loss, has_aux=True)
    if compiled:
        grad_fn = torch.compile(grad_fn, backend="aot_eager", fullgraph=True)
    grad, (_, out) = grad_fn(part)
    assert part.shape[0] < rows, part.shape  # the part, not the whole table
    assert torch.equal(out, table[pos]), (out, table[pos])
    assert torch.equal(grad, full.grad[rank * c : (rank + 1) * c]), (grad, full.grad)


def _run(fn, *args) -> str:
    """ "ok", or the scenario's failure (reported per scenario; the test names it)."""
    try:
        fn(*args)
        return "ok"
    except Exception:
        return traceback.format_exc()[-3000:]


def main():
    out = sys.argv[1]
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    group = torch.distributed.group.WORLD
    results = {}
    for name, h, hkv, compiled, kernel in (
        ("mha", 4, 4, False, "mask"),
        ("gqa", 4, 2, False, "mask"),
        ("gqa_func", 4, 2, "func", "mask"),
        ("gqa_compiled", 4, 2, "compiled", "mask"),
        ("zigzag_mha", 4, 4, False, "zigzag"),
        ("zigzag_gqa_func", 4, 2, "func", "zigzag"),
        ("zigzag_gqa_compiled", 4, 2, "compiled", "zigzag"),
        ("stream_mha", 4, 4, False, "stream"),
        ("stream_gqa_func", 4, 2, "func", "stream"),
        ("stream_gqa_compiled", 4, 2, "compiled", "stream"),
    ):
        results[name] = _run(scenario, h, hkv, compiled, group, world, rank, kernel)
    for name, rows, compiled in (("rows", 4 * world, False), ("rows_uneven_compiled", 4 * world + 3, True)):
        results[name] = _run(rows_scenario, rows, compiled, group, world, rank)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
