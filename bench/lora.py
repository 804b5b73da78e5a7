"""Benchmark: LoRA vs a full fine-tune of the same GPT, and a population of 4 adapter sets vs 4 solo LoRA runs.

    python bench/lora.py [--layers 4] [--width 256] [--steps 10] [--device cpu] [--json]

Each variant runs in a process of its own (so its peak memory is its own): the compiled step of
`configs/gpt.py`'s GPT (vocab 256, block 128, batch 8, AdamW) trained in full, with rank-8 adapters on
every linear layer (the base frozen), and 4 adapter sets over one base in one vmapped step. Printed:
per variant the median step time, the peak memory (the state's bytes, trained, frozen and optimizer
moments, plus the step's own peak above them: on CPU the resident high-water mark over the timed
steps above what the process held before them; on CUDA torch's peak allocated), the optimizer state's
bytes and one checkpoint's bytes on disk; then the ratios LoRA / full and population / 4 solo runs
(time: one population step against 4 solo steps; memory: the population's peak against 4 solo runs').
With `--json` the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _mem  # noqa: E402

VARIANTS = ("full", "lora", "population")


def _measure(variant: str, args) -> dict:
    """One variant's numbers, in this process."""
    from functrain import checkpoint, init_state, make_train_step, optim, population, rng, tree
    from functrain.models import gpt
    from functrain.nn import lora
    from functrain.trainer import frozen as frozen_lib

    device = torch.device(args.device)
    cfg = gpt.GPTConfig(vocab_size=256, block_size=128, n_layer=args.layers, n_head=4, n_embd=args.width, bias=False)
    with torch.device("meta"):
        base_template = gpt.GPT(cfg)
    opt = optim.adamw(1e-4)
    base = gpt.init_params(base_template, rng.key(0), device=device)
    if variant == "full":
        loss_fn, state = gpt.make_loss_fn(base_template), init_state(base, opt, seed=0)
        step = make_train_step(loss_fn, opt)
    else:
        model = lora.wrap(base_template, lora.LoraSpec(rank=8, alpha=16, targets="all-linear"))
        loss_fn = gpt.make_loss_fn(model)
        members = [
            init_state(lora.init_adapters(model, rng.key(k), device=device), opt, seed=k, frozen=base)
            for k in range(4 if variant == "population" else 1)
        ]
        if variant == "population":
            state, step = population.stack(members), population.make_population_step(loss_fn, opt)
        else:
            state, step = members[0], make_train_step(loss_fn, opt)
    x = torch.randint(0, 256, (8, cfg.block_size + 1), generator=torch.Generator().manual_seed(0)).to(device)
    batch = (x[:, :-1], x[:, 1:])
    nbytes = lambda t: sum(x.numel() * x.element_size() for x in tree.leaves(t))  # noqa: E731
    opt_bytes, state_bytes = nbytes(state.opt_state), nbytes(state)  # (the state: trained, frozen, moments)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint.save(str(Path(tmp) / "1"), frozen_lib.saved(state))
        ckpt_bytes = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
    state, _ = step(state, batch)  # compile
    _mem.trim()
    before = _mem.status_mib("VmRSS")
    _mem.reset_peak()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        float(m["loss"].sum())  # (waits for the step)
        times.append(time.perf_counter() - t0)
    peak = (
        (torch.cuda.max_memory_allocated() - state_bytes) / 2**20
        if device.type == "cuda"
        else _mem.status_mib("VmHWM") - before
    )
    return {
        "step_ms": statistics.median(times) * 1e3,
        "peak_mib": state_bytes / 2**20 + peak,
        "opt_bytes": opt_bytes,
        "ckpt_bytes": ckpt_bytes,
        "trained": sum(t.numel() for t in tree.leaves(state.params)),
        "frozen": sum(t.numel() for t in tree.leaves(state.frozen)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # (a child process's one variant)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(_measure(args.variant, args)))
        return
    results = {}
    for variant in VARIANTS:
        cmd = [
            sys.executable,
            __file__,
            f"--variant={variant}",
            f"--layers={args.layers}",
            f"--width={args.width}",
            f"--steps={args.steps}",
            f"--device={args.device}",
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        r = results[variant]
        print(
            f"{variant:>10}: {r['step_ms']:8.1f} ms/step, peak {r['peak_mib']:7.1f} MiB, optimizer state "
            f"{r['opt_bytes'] / 2**20:7.2f} MiB, checkpoint {r['ckpt_bytes'] / 2**20:7.2f} MiB "
            f"({r['trained']:,} trained, {r['frozen']:,} frozen)"
        )
    full, one, pop = results["full"], results["lora"], results["population"]
    ratios = {
        "step_time": one["step_ms"] / full["step_ms"],
        "peak_memory": one["peak_mib"] / full["peak_mib"],
        "optimizer_bytes": one["opt_bytes"] / full["opt_bytes"],
        "checkpoint_bytes": one["ckpt_bytes"] / full["ckpt_bytes"],
        "population_time_vs_4_solo": pop["step_ms"] / (4 * one["step_ms"]),
        "population_memory_vs_4_solo": pop["peak_mib"] / (4 * one["peak_mib"]),
    }
    print(
        "LoRA / full fine-tune: step time {step_time:.2f}x, peak memory {peak_memory:.2f}x, optimizer state "
        "{optimizer_bytes:.3f}x, checkpoint {checkpoint_bytes:.3f}x".format(**ratios)
    )
    print(
        "population of 4 / 4 solo LoRA runs: time {population_time_vs_4_solo:.2f}x, peak memory "
        "{population_memory_vs_4_solo:.2f}x".format(**ratios)
    )
    if args.json:
        print(json.dumps({"device": args.device, "results": results, "ratios": ratios}))


if __name__ == "__main__":
    main()
