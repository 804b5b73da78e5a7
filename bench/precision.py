"""Step time, memory and loss of the compiled train step at fp32, bf16 and fp16 (loss-scaled).

Each precision runs in a fresh child process: it builds a GPT, compiles
`make_train_step(..., precision=p)` (AdamW, clipping, fp32 master params and moments), runs
`--warmup` steps, then times `--steps` steps on fixed random-token batches; it reports seconds per
step, the peak RSS growth of one step after warm-up (CPU; `torch.cuda.max_memory_allocated` on CUDA)
and the loss after the run. Ratios are against fp32 measured in the same invocation.

    python bench/precision.py                               # n_layer 4, n_embd 256, B 16 x T 256
    python bench/precision.py --device cuda --n-layer 12 --n-embd 768 --batch 16
    python bench/precision.py --precisions fp32,fp32:noskip     # what the non-finite skip costs

Measured: docs/results.md ("bench/precision.py").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _mem import reset_peak, status_mib, trim  # noqa: E402


def _child(args) -> dict:
    """One precision's measurement (runs in its own process)."""
    import torch

    from functrain import init_state, make_train_step, optim, rng
    from functrain.functional import apply
    from functrain.models import gpt

    device = torch.device(args.device)
    cfg = gpt.GPTConfig(
        vocab_size=256,
        block_size=args.block,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=0.0,
        bias=False,
    )
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    params = gpt.init_params(model, rng.key(0), device=device)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3, weight_decay=0.1))

    def loss_fn(p, batch, key):
        x, y = batch
        return gpt.cross_entropy(apply(model, p, x), y), {}

    prec, _, flag = args.precision.partition(":")  # "fp32:noskip" = without the non-finite guard
    step = make_train_step(loss_fn, opt, precision=prec, compile=not args.eager, skip_nonfinite=flag != "noskip")
    state = init_state(params, opt, copy=False)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        x = torch.randint(0, 256, (args.batch, args.block), generator=g)
        batches.append((x.to(device), ((x * 7 + 3) % 256).to(device)))

    t0 = time.perf_counter()
    for i in range(args.warmup):
        state, m = step(state, batches[i % 4])
    float(m["loss"])
    first = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:  # hand freed heap back to the OS first, so the step's own allocations show in RSS
        trim()
        base = status_mib("VmRSS")
        reset_peak()
    state, m = step(state, batches[0])
    float(m["loss"])
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else status_mib("VmHWM") - base
    t0 = time.perf_counter()
    for i in range(args.steps):
        state, m = step(state, batches[i % 4])
    loss = float(m["loss"])
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    return {
        "precision": args.precision,
        "s_per_step": dt,
        "warmup_s": first,
        "peak_mib": peak,
        "loss": loss,
        "skipped": int(state.guard.skipped),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--precisions",
        default="fp32,bf16,fp16",
        help="comma-separated; a ':noskip' suffix builds the step without the non-finite skip",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--eager", action="store_true", help="no torch.compile")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args)))
        return
    rows = []
    for p in args.precisions.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--precision",
            p,
            "--device",
            args.device,
            "--n-layer",
            str(args.n_layer),
            "--n-head",
            str(args.n_head),
            "--n-embd",
            str(args.n_embd),
            "--block",
            str(args.block),
            "--batch",
            str(args.batch),
            "--warmup",
            str(args.warmup),
            "--steps",
            str(args.steps),
        ] + (["--eager"] if args.eager else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    ref = rows[0]
    print(
        f"{'precision':<12} {'s/step':>8} {'vs ' + ref['precision']:>8} {'peak MiB':>9} {'vs':>6} "
        f"{'loss':>7} {'skipped':>7} {'compile+warmup s':>16}"
    )
    for r in rows:
        print(
            f"{r['precision']:<12} {r['s_per_step']:>8.3f} {r['s_per_step'] / ref['s_per_step']:>7.2f}x "
            f"{r['peak_mib']:>9.0f} {r['peak_mib'] / max(ref['peak_mib'], 1e-9):>5.2f}x {r['loss']:>7.5f} "
            f"{r['skipped']:>7d} {r['warmup_s']:>16.1f}"
        )


if __name__ == "__main__":
    main()
