"""Peak memory of the LM-head loss: plain cross-entropy over full logits vs `chunked_cross_entropy`.

Each measurement runs in a fresh child process: it builds hidden (N, C), the tied head weight (V, C)
and targets, runs forward + backward once with `torch.func.grad_and_value` over (hidden, weight)
(the functrain train step's route; this call also compiles with --compile), resets the kernel's RSS
high-water mark (`/proc/self/clear_refs`), runs it again and reports peak RSS (`VmHWM`) minus the RSS
before that call: the extra memory the loss and its backward need, gradients included (N*C + V*C
floats). Where the mark cannot be reset it measures the first call against `ru_maxrss` instead.
tracemalloc does not see torch's allocations; the kernel's RSS accounting does.

    python bench/memory.py                          # N=8192 tokens, C=768, V=50304, float32
    python bench/memory.py --n 8192 --chunks 512,1024,4096 --compile

Columns: mode, chunk size, extra peak MiB, its ratio to plain, seconds for the forward+backward,
and the loss (the same for all modes up to float32 rounding).

Measured: docs/results.md ("bench/memory.py").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _mem import reset_peak, status_mib  # noqa: E402


def _peak_mib() -> float:
    """This process's peak resident set size so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mib() -> float:
    """Current resident set size, MiB."""
    return status_mib("VmRSS")


def _hwm_mib() -> float:
    """Peak resident set size since start or the last `reset_peak`, MiB."""
    return status_mib("VmHWM")


def child(args) -> dict:
    """One measurement in this process; returns the result row."""
    import torch
    import torch.nn.functional as F

    from functrain.losses import chunked_cross_entropy

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.n, args.c, generator=g).to(dtype)  # (N, C)
    weight = (torch.randn(args.v, args.c, generator=g) * 0.02).to(dtype)  # (V, C)
    targets = torch.randint(0, args.v, (args.n,), generator=g)  # (N,)

    if args.chunk == 0:

        def loss_fn(h, w):
            """Plain: full (N, V) logits."""
            return F.cross_entropy((h @ w.t()).float(), targets)
    else:

        def loss_fn(h, w):
            """Chunked: no (N, V) array."""
            return chunked_cross_entropy(h, w, targets, chunk_size=args.chunk)

    fn = torch.func.grad_and_value(loss_fn, argnums=(0, 1))
    if args.compile:
        fn = torch.compile(fn, fullgraph=True)
    warm = reset_peak()  # only where the kernel lets us reset the high-water mark
    if warm:  # first call outside the window (compiles; first-touch of lazily built state)
        fn(hidden, weight)
        reset_peak()
    base = _peak_mib() if not warm else _rss_mib()
    t = time.perf_counter()
    (gh, gw), loss = fn(hidden, weight)
    dt = time.perf_counter() - t
    peak = _hwm_mib() if warm else _peak_mib()
    return {
        "mode": "plain" if args.chunk == 0 else "chunked",
        "chunk": args.chunk,
        "base_mib": base,
        "warm": warm,
        "extra_mib": peak - base,
        "seconds": dt,
        "loss": float(loss),
        "grad_norm": float(gh.float().norm() + gw.float().norm()),
    }


def main() -> None:
    """Runs plain and each chunk size in child processes and prints a table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8192, help="tokens (B*T)")
    p.add_argument("--c", type=int, default=768, help="model width")
    p.add_argument("--v", type=int, default=50304, help="vocabulary size")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--chunks", default="1024,2048,4096", help="comma-separated chunk sizes (0 = plain)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the grad_and_value")
    p.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)  # child mode
    args = p.parse_args()

    if args.chunk is not None:
        print(json.dumps(child(args)))
        return

    rows = []
    for chunk in [0] + [int(c) for c in args.chunks.split(",") if c]:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--n",
            str(args.n),
            "--c",
            str(args.c),
            "--v",
            str(args.v),
            "--dtype",
            args.dtype,
            "--threads",
            str(args.threads),
            "--chunk",
            str(chunk),
        ]
        if args.compile:
            cmd.append("--compile")
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))

    logits_mib = args.n * args.v * 4 / 2**20
    print(
        f"N={args.n} C={args.c} V={args.v} {args.dtype} compile={args.compile} "
        f"(window: {'second call, high-water mark reset' if rows[0]['warm'] else 'first call, ru_maxrss'}); "
        f"one float32 (N, V) logits array = {logits_mib:,.0f} MiB"
    )
    print(f"{'mode':8s} {'chunk':>6s} {'extra peak MiB':>15s} {'vs plain':>9s} {'seconds':>8s} {'loss':>10s}")
    plain = rows[0]["extra_mib"]
    for r in rows:
        print(
            f"{r['mode']:8s} {r['chunk']:6d} {r['extra_mib']:15,.0f} {r['extra_mib'] / plain:9.2f} "
            f"{r['seconds']:8.2f} {r['loss']:10.6f}"
        )


if __name__ == "__main__":
    main()
