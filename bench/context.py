"""Context parallelism: the longest sequence a rank can train under a memory cap, cp = 1, 2, 4.

One launch of 4 ranks runs three meshes in turn: cp=1 (dp_shard=4: each rank trains whole
sequences), cp=2 (dp_shard=2 x cp=2) and cp=4 (each sequence split over all four ranks). Parameters
are FSDP-sharded over 4 ranks in every mesh, so they cost the same; what changes is the activations
each rank holds for its tokens. For each mesh the sequence length doubles until a step's peak memory
on some rank passes the cap, then bisects down to `--granule` tokens. The GPT trains with the loop's
defaults on a mesh (staged loss, every block recomputed), one sequence per data-parallel rank, eager;
`--family llama` trains the Llama instead (rotary positions, grouped-query attention).

Memory is the growth of the resident set during one step (after a warm-up step) over the resident
set before it, the max over ranks (bench/_mem.py: the kernel's high-water mark, free heap handed back
first); on CUDA, `torch.cuda.max_memory_allocated` over the allocated bytes before the step.
Printed: per mesh the longest sequence, its peak, step time and tokens/s (global, all ranks), and the
ratios of the longest sequences against cp=1; with --json a last line of JSON.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 bench/context.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 bench/context.py --family llama --json
    ... --kernel stream        # the cp attention's keys and values fetched a chunk at a time
    ... --seq 8192             # one length, no search: step time and peak of each mesh
    ... --exact-heap           # CPU: the resident set follows live memory (slower; docs/results.md)

Measured: docs/results.md ("bench/context.py").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mem import exact, reset_peak, status_mib, trim  # noqa: E402

from functrain import init_state, make_train_step, optim, parallel, rng  # noqa: E402
from functrain.models import gpt, llama  # noqa: E402


def _args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cap-mib", type=float, default=160.0, help="per-rank memory cap of one step (MiB)")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--family", default="gpt", choices=["gpt", "llama"])
    p.add_argument("--n-kv-head", type=int, default=2, help="llama: key/value heads")
    p.add_argument("--granule", type=int, default=256, help="the search's resolution in tokens")
    p.add_argument("--first-seq", type=int, default=1024, help="first sequence length tried")
    p.add_argument("--max-seq", type=int, default=1 << 17, help="stop doubling here")
    p.add_argument("--cps", default="1,2,4")
    p.add_argument("--kernel", default="zigzag", help="the cp attention: zigzag (no mask) or mask")
    p.add_argument("--seq", type=int, default=0, help="measure at this length only (no search)")
    p.add_argument(
        "--exact-heap",
        action="store_true",
        help="CPU: blocks of 64 KiB or more mapped and handed back one by one, so the resident set "
        "follows live memory (exact in bench/_mem.py)",
    )
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def _peak_mib(device) -> tuple[float, callable]:
    """Starts a peak-memory reading; returns a function giving the growth in MiB since."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return lambda: (torch.cuda.max_memory_allocated() - base) / 2**20
    trim()
    base = status_mib("VmRSS")
    reset_peak()
    return lambda: status_mib("VmHWM") - base


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def measure(ctx, args, seq: int) -> dict:
    """One step's peak memory (max over ranks), step time and tokens/s at sequence length `seq`."""
    if args.family == "gpt":
        fam = gpt
        cfg = gpt.GPTConfig(
            vocab_size=256, block_size=seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, bias=False
        )
        with torch.device("meta"):
            template = gpt.GPT(cfg)
    else:  # rotary positions (no position table), grouped-query attention
        fam = llama
        cfg = llama.LlamaConfig(
            vocab_size=256,
            block_size=seq,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_kv_head=args.n_kv_head,
            n_embd=args.n_embd,
        )
        with torch.device("meta"):
            template = llama.Llama(cfg)
    rules = parallel.default_rules(fam.TP_RULES)
    model = parallel.context.context_parallel(template, parallel.context.split_of(ctx.mesh, args.kernel))
    loss_fn = fam.make_loss_fn(model, remat="full", staged=True)
    opt = optim.adamw(1e-3)
    params = parallel.init_sharded(
        lambda key, device, where=None: fam.init_params(template, key, device=device, where=where),
        rng.key(0),
        ctx.mesh,
        rules,
    )
    state = parallel.shard_state(init_state(params, opt), ctx.mesh, rules)
    step = make_train_step(loss_fn, opt, compile=False)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (ctx.dp_world, seq + 1), generator=g)
    x, y = parallel.split_batch((batch[:, :-1], batch[:, 1:]), ctx.dp_rank, ctx.dp_world, ctx.device)
    state, _ = step(state, (x, y))  # warm-up
    read = _peak_mib(ctx.device)
    t0 = time.perf_counter()
    state, m = step(state, (x, y))
    float(m["loss"])
    elapsed = time.perf_counter() - t0
    peak = _max_over_ranks(read())
    elapsed = _max_over_ranks(elapsed)
    return {
        "seq": seq,
        "peak_mib": round(peak, 1),
        "step_s": round(elapsed, 3),
        "tokens_per_s": round(ctx.dp_world * seq / elapsed, 1),
    }


def longest(ctx, args, cp: int) -> dict:
    """The longest sequence (a multiple of the granule and of 2 cp) whose step fits the cap."""
    unit = max(args.granule, 2 * cp)
    fits, seq, best = None, args.first_seq, None
    while seq <= args.max_seq:  # double until it does not fit
        r = measure(ctx, args, seq)
        if r["peak_mib"] > args.cap_mib:
            break
        fits, best, seq = seq, r, seq * 2
    if fits is None:
        return {"cp": cp, "seq": 0, "note": f"{args.first_seq} tokens already exceed the cap"}
    lo, hi = fits, min(seq, args.max_seq + unit)  # lo fits, hi does not (or is past the search)
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        r = measure(ctx, args, mid)
        if r["peak_mib"] <= args.cap_mib:
            lo, best = mid, r
        else:
            hi = mid
    return {"cp": cp, **best}


def main():
    args = _args()
    if args.exact_heap:
        exact()
    rows = []
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for cp in [int(c) for c in args.cps.split(",")]:
        ctx = parallel.setup({"dp_replicate": 1, "dp_shard": world // cp, "cp": cp, "tp": 1})
        row = {"cp": cp, **measure(ctx, args, args.seq)} if args.seq else longest(ctx, args, cp)
        rows.append(row)
        if ctx.is_main_process:
            print(
                f"cp={cp}: {'sequence' if args.seq else 'longest sequence'} {row['seq']} tokens, "
                f"peak {row.get('peak_mib')} MiB/rank, "
                f"{row.get('step_s')} s/step, {row.get('tokens_per_s')} tokens/s",
                flush=True,
            )
    base = rows[0]["seq"] or 1
    out = {
        "cap_mib": args.cap_mib,
        "world": world,
        "family": args.family,
        "n_layer": args.n_layer,
        "n_embd": args.n_embd,
        "rows": rows,
        "ratios": {f"cp{r['cp']}": round(r["seq"] / base, 3) for r in rows},
    }
    if parallel.is_main_process():
        print("longest sequence vs cp=1: " + ", ".join(f"{k} {v:.2f}x" for k, v in out["ratios"].items()))
        if args.json:
            print(json.dumps(out))
    parallel.teardown()


if __name__ == "__main__":
    main()
