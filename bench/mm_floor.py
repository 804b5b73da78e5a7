"""Benchmark: the matmul floor of a GPT train step, i.e. the best MFU any step built on torch's kernels can reach.

    python bench/mm_floor.py [--size default|tiny|100m|gpt2] [--reps 20] [--threads T] [--json]

A GPT train step's FLOPs are almost all matmuls (`gpt.flops_per_token`: 6 N + 12 L C T). This times,
alone and back to back, exactly the matmuls one step issues through aten (each linear's forward
`X W^T`, its input gradient `dY W` and its weight gradient `dY^T X`, the tied head included) and the
attention kernels (`scaled_dot_product_attention` forward + backward), at the step's shapes, in the
same process as the 2048 x 2048 float32 matmul the MFU figures divide by. Printed: each shape's
GFLOP/s, the total, and `floor_mfu`: the step's model FLOPs over (matmul + attention time) against
the 2048^2 rate. No step (compiled or eager) that calls these kernels can beat it, whatever it fuses:
everything else (norms, GELU, the optimizer) only adds time. Use it to tell a step that wastes time
from a target the kernels cannot reach on this machine.

Two floors: `hot`, every kernel run again on the same inputs (they stay in cache), and `cold`,
each run on the next of a pool of input copies larger than the last-level cache, as inside a
step, where a kernel's inputs were written by other kernels since (activations, weights, the
optimizer's state in between). A step's kernels see something between the two.

Measured: docs/results.md ("bench/mm_floor.py").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from functrain.models import gpt  # noqa: E402
from functrain.trainer import metrics

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import step as step_bench  # noqa: E402  (the sizes of bench/step.py)

POOL_BYTES = 256 << 20  # the cold floor's input copies: above any last-level cache of a CPU like this one


def _timed(fn, reps: int, pool: list) -> tuple[float, float]:
    """(hot, cold): median seconds of `fn(*pool[0])` run right after itself, and of `fn` on the next of
    `pool[1:]` (inputs last touched a pool ago), the two alternating so machine load hits both alike."""
    fn(*pool[0]), fn(*pool[-1])
    hot, cold = [], []
    for i in range(reps):
        for times, args in ((hot, pool[0]), (cold, pool[1 + i % (len(pool) - 1)])):
            if times is hot:
                fn(*args)  # what ran before this one touched other inputs: bring pool[0] back
            t = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - t)
    return statistics.median(hot), statistics.median(cold)


def _pool(make) -> list:
    """make()'s tensors and enough copies of them to fill about `POOL_BYTES` (at least 2 in all)."""
    first = make()
    size = sum(t.numel() * t.element_size() for t in first)
    return [first] + [tuple(t.clone() for t in first) for _ in range(max(1, POOL_BYTES // size))]


def _linears(cfg: gpt.GPTConfig) -> list[tuple[str, int, int, int]]:
    """(names, in, out, how many per step) of the model's linear layers, grouped by shape (lm_head included)."""
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    shapes: dict = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            key = (mod.in_features, mod.out_features)
            kind = name.split(".", 2)[-1]  # "h.0.attn.q" -> "attn.q"; "lm_head" stays
            shapes.setdefault(key, [set(), 0])
            shapes[key][0].add(kind)
            shapes[key][1] += 1
    return [("/".join(sorted(kinds)), k, n, count) for (k, n), (kinds, count) in shapes.items()]


def matmul_rows(cfg: gpt.GPTConfig, tokens: int, reps: int) -> list[dict]:
    """Each linear's three training matmuls at the step's shapes, timed: [{name, flops, hot, cold}]."""
    rows = []
    for name, k, n, count in _linears(cfg):
        pool = _pool(lambda k=k, n=n: (torch.randn(tokens, k), torch.randn(n, k) * 0.02, torch.randn(tokens, n)))
        for part, fn in (
            ("forward X W^T", lambda x, w, dy: F.linear(x, w)),
            ("grad input dY W", lambda x, w, dy: dy @ w),
            ("grad weight dY^T X", lambda x, w, dy: dy.t() @ x),
        ):
            hot, cold = _timed(fn, reps, pool)
            rows.append(
                {
                    "name": f"{name}: {part} ({tokens}x{k}x{n}) x{count}",
                    "flops": 2.0 * tokens * k * n * count,
                    "hot": hot * count,
                    "cold": cold * count,
                }
            )
    return rows


def attention_row(cfg: gpt.GPTConfig, batch: int, reps: int) -> dict:
    """Causal `scaled_dot_product_attention` forward + backward of every layer, timed."""
    shape = (batch, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)  # (B, H, T, D)
    pool = _pool(lambda: tuple(torch.randn(shape) for _ in range(4)))  # q, k, v, grad of the output

    def fwd_bwd(q, k, v, g):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), g)

    flops = 12.0 * cfg.n_layer * cfg.n_embd * cfg.block_size * batch * cfg.block_size  # 12 L C T per token
    hot, cold = _timed(fwd_bwd, reps, pool)
    return {
        "name": f"attention fwd+bwd {tuple(shape)} x{cfg.n_layer}",
        "flops": flops,
        "hot": hot * cfg.n_layer,
        "cold": cold * cfg.n_layer,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="default", help="a size of bench/step.py (tiny, 100m) or configs/gpt.py variant")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg, batch = step_bench._cfg(args.size)
    tokens = batch * cfg.block_size
    cpu = torch.device("cpu")
    peak_before = metrics.measure_peak_flops(cpu)  # the denominator of the run's and bench/step.py's MFU
    rows = matmul_rows(cfg, tokens, args.reps) + [attention_row(cfg, batch, args.reps)]
    peak_after = metrics.measure_peak_flops(cpu)
    rate = max(peak_before, peak_after)  # the machine's rate; a lower one was load from elsewhere
    step_flops = gpt.flops_per_token(cfg) * tokens
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.size}: {tokens} tokens per step, "
        f"{step_flops / 1e9:.2f} GFLOP of model FLOPs; 2048^2 float32 matmul {peak_before / 1e9:.1f} GFLOP/s "
        f"before, {peak_after / 1e9:.1f} after\n"
    )
    print(
        "| kernel (M x K x N) x per step | hot ms per step | cold ms | hot GFLOP/s | cold GFLOP/s |\n"
        "|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['name']} | {1e3 * r['hot']:.2f} | {1e3 * r['cold']:.2f} | {r['flops'] / r['hot'] / 1e9:.1f} | "
            f"{r['flops'] / r['cold'] / 1e9:.1f} |"
        )
    out = {"size": args.size, "tokens": tokens, "peak_gflops": rate / 1e9, "model_gflop": step_flops / 1e9}
    for mode in ("hot", "cold"):
        seconds = sum(r[mode] for r in rows)
        out[f"{mode}_kernel_ms"], out[f"{mode}_floor_mfu"] = 1e3 * seconds, step_flops / seconds / rate
    print(
        f"\nmatmuls + attention alone, per step: {out['hot_kernel_ms']:.1f} ms hot, {out['cold_kernel_ms']:.1f} ms "
        f"cold; floor_mfu {out['hot_floor_mfu']:.1%} hot, {out['cold_floor_mfu']:.1%} cold (against "
        f"{rate / 1e9:.1f} GFLOP/s; no step on these kernels reaches a higher MFU)"
    )
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
