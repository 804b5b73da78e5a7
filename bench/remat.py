"""Benchmark: activation checkpointing (`gpt.make_loss_fn(..., remat=...)`) in the functrain train step.

    python bench/remat.py                  # compiled step (torch.compile, one graph)
    python bench/remat.py --eager          # the same step uncompiled
    python bench/remat.py --policies none,full,2,4 --n-layer 12 --batch 4

For each remat policy ("none": plain `torch.func.grad_and_value`; "full": every block recomputed in
backward; N: every N-th block) it runs the whole train step (forward, backward, clipping, AdamW,
donated state) of one GPT whose activations dominate its memory (byte vocabulary, so the LM head is
small), each policy in a fresh child process so high-water marks do not mix:
build, 2 warm-up steps (the first compiles), then release what the warm-up left behind (gc,
`malloc_trim`) and take the baseline, run `--steps` timed steps and report
  peak growth  how far memory rises above the resident state during those steps (activations,
               gradients, optimizer temporaries).
               CPU: RSS high-water mark (VmHWM) after resetting it to the current RSS by writing 5 to
               /proc/self/clear_refs (Linux >= 4.0; the output says when it could not be reset).
               CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus allocated.
  s/step       mean wall time of the timed steps; cpu s/step: the process's CPU time per step (all
               threads), steadier than wall time on a machine shared with other jobs.
  loss         the last step's loss: the same for every policy (remat changes memory and time only).
Ratios are against "none" in the same mode.

Measured: docs/results.md ("bench/remat.py").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from _mem import reset_peak, status_mib, trim  # noqa: E402

from functrain import init_state, make_train_step, optim, rng  # noqa: E402
from functrain.models import gpt  # noqa: E402

N_BATCHES = 4  # a small pool of batches, cycled


def _cfg(args) -> gpt.GPTConfig:
    """The benchmarked GPT."""
    return gpt.GPTConfig(
        vocab_size=args.vocab,
        block_size=args.block,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=0.0,
        bias=False,
    )


def _batches(cfg: gpt.GPTConfig, batch: int, device) -> list:
    """`N_BATCHES` random (x, y) batches of shape (batch, block_size)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(N_BATCHES):
        xy = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
        out.append((xy[:, :-1].contiguous().to(device), xy[:, 1:].contiguous().to(device)))
    return out


def _sync(device) -> None:
    """Waits for the device (CUDA); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _policy(text: str):
    """A policy from the command line: "none", "full" or an int."""
    return int(text) if text.strip().isdigit() else text.strip()


def child(args) -> dict:
    """One policy in this process: warm up, then measure `args.steps` steps; returns the row."""
    device = torch.device(args.device)
    cfg = _cfg(args)
    data = _batches(cfg, args.batch, device)
    with torch.device("meta"):
        template = gpt.GPT(cfg)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(3e-4, weight_decay=0.1))
    state = init_state(gpt.init_params(template, rng.key(0), device=device), opt, seed=0, copy=False)
    loss_fn = gpt.make_loss_fn(template, chunk_size=args.chunk, remat=_policy(args.policy))
    step = make_train_step(loss_fn, opt, compile=not args.eager, donate=True)

    t = time.perf_counter()
    state, m = step(state, data[0])  # compiles
    float(m["loss"])
    first_s = time.perf_counter() - t
    state, m = step(state, data[1])
    float(m["loss"])
    trim()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) / 2**20
        method = "cuda max_memory_allocated"
    else:
        if reset_peak():  # VmHWM := current RSS
            method = "RSS high-water mark (VmHWM), reset at the baseline"
        else:
            method = "RSS high-water mark NOT reset: includes compile and warm-up"
        base = status_mib("VmRSS")
    t, cpu = time.perf_counter(), time.process_time()
    for i in range(args.steps):
        state, m = step(state, data[(2 + i) % N_BATCHES])
        loss = float(m["loss"])
    _sync(device)
    seconds = (time.perf_counter() - t) / args.steps
    cpu_seconds = (time.process_time() - cpu) / args.steps
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak = status_mib("VmHWM")
    return {
        "policy": args.policy,
        "method": method,
        "base_mb": base,
        "growth_mb": peak - base,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "first_s": first_s,
        "loss": loss,
    }


def main() -> None:
    """Runs each policy in a child process and prints the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="none,full,2", help="comma-separated: none, full, N (every N-th block)")
    p.add_argument("--eager", action="store_true", help="run the step uncompiled (default: torch.compile)")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block", type=int, default=256, help="sequence length (block_size)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--chunk", type=int, default=0, help="loss chunk size (0: plain cross-entropy)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per policy")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--policy", default=None, help=argparse.SUPPRESS)  # child mode
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.policy is not None:
        print(json.dumps(child(args)), flush=True)
        return

    policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    cfg = _cfg(args)
    mode = "eager" if args.eager else "compiled"
    print(
        f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads; {mode} step; "
        f"GPT n_layer {cfg.n_layer}, n_embd {cfg.n_embd}, n_head {cfg.n_head}, block {cfg.block_size}, "
        f"batch {args.batch}, vocab {cfg.vocab_size}, {gpt.num_params(cfg) / 1e6:.1f}M params; "
        f"{args.steps} timed steps",
        flush=True,
    )
    rows = []
    for policy in policies:
        cmd = [sys.executable, os.path.abspath(__file__), "--policy", policy]
        for name in ("n_layer", "n_embd", "n_head", "block", "batch", "vocab", "chunk", "steps", "threads", "device"):
            cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        if args.eager:
            cmd.append("--eager")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"child for policy {policy} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(
            f"  done {policy}: {r['growth_mb']:.0f} MB, {r['seconds']:.2f} s/step (first step {r['first_s']:.1f} s)",
            flush=True,
        )

    print(f"memory: {rows[0]['method']}; resident state {rows[0]['base_mb']:.0f} MB")
    ref = next((r for r in rows if r["policy"] == "none"), rows[0])
    print(
        f"{'policy':8s} {'peak growth MB':>15s} {'vs none':>8s} {'s/step':>8s} {'vs none':>8s} "
        f"{'cpu s/step':>11s} {'vs none':>8s} {'loss':>10s}"
    )
    for r in rows:
        print(
            f"{r['policy']:8s} {r['growth_mb']:15,.0f} {r['growth_mb'] / ref['growth_mb']:8.2f} "
            f"{r['seconds']:8.2f} {r['seconds'] / ref['seconds']:8.2f} "
            f"{r['cpu_seconds']:11.2f} {r['cpu_seconds'] / ref['cpu_seconds']:8.2f} {r['loss']:10.6f}"
        )


if __name__ == "__main__":
    main()
