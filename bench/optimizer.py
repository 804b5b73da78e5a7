"""Benchmark: functrain's compiled optimizer update vs torch's fused AdamW, on the same parameters.

    python bench/optimizer.py [--size 100m] [--rounds 30] [--threads T] [--device cuda] [--json]

functrain: the optimizer half of the compiled train step, exactly as `make_train_step` runs it
(`step.update_step`): the global grad norm, clipping, AdamW with a warm-up/cosine schedule and a
weight-decay mask, the non-finite skip guard, the update/param norms for the log, and donation
(the new params and moments written into the old buffers), compiled as one graph.

torch: `torch.optim.AdamW(fused=True)` on the same params with the same gradients (`.grad` set
once; the update is timed alone), and the same step after `clip_grad_norm_` (what an eager loop
pays for clipping).

read_grads: one compiled pass reading every gradient (its squared norm). Clipping needs the global
norm before any parameter moves, so a clipped update reads the gradients once more than fused AdamW
does, however it is fused: (fused AdamW + that read) / fused AdamW is printed as the floor of the ratio.

The variants alternate in `--rounds` short rounds (the order reversed every other round) so machine
load hits all alike. Printed: the median ms per update of each and the median over rounds of the
paired ratio functrain / fused AdamW (target <= 1.2): a ratio taken within one round is steadier
than a ratio of totals on a shared machine. With `--json` the last line is one JSON object.
`--profile N` then prints the kernels of N functrain updates by device (CUDA) or CPU time.

Measured: docs/results.md ("bench/optimizer.py").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from functrain import init_state, optim, rng  # noqa: E402
from functrain import step as step_lib  # noqa: E402
from functrain.models import gpt  # noqa: E402
from functrain.trainer import memory

SIZES = {  # the GPTs of bench/step.py
    "tiny": dict(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64),
    "100m": dict(vocab_size=16384, block_size=64, n_layer=12, n_head=12, n_embd=768),
}
LR, WARMUP, DECAY, MIN_LR, WD, BETAS, EPS, CLIP = 3e-4, 10, 10_000, 3e-5, 0.1, (0.9, 0.95), 1e-8, 1.0


def _decay_mask(params):
    """Weight decay on matrices only (as the main job)."""
    return {k: v.ndim >= 2 for k, v in params.items()}


def _params_and_grads(size, device):
    """The GPT's params (its init) and one fixed set of gradients of realistic size, on `device`."""
    cfg = gpt.GPTConfig(dropout=0.0, bias=False, **SIZES[size])
    with torch.device("meta"):
        template = gpt.GPT(cfg)
    params = gpt.init_params(template, rng.key(0))
    g = torch.Generator().manual_seed(0)
    grads = {k: torch.randn(v.shape, generator=g) * 1e-3 for k, v in params.items()}
    return ({k: v.to(device) for k, v in params.items()}, {k: v.to(device) for k, v in grads.items()})


class Functrain:
    """The train step's compiled optimizer half (clip + AdamW + skip guard + norms + donation);
    `compile=False`: the same update run eagerly, as `make_train_step(compile=False)` runs it, through
    torch's fused AdamW kernel (`fused=True`: "functrain_eager") or as the chain of foreach transforms
    ("functrain_eager_chain")."""

    def __init__(self, params, grads, compile=True, fused=False):
        self.name = "functrain" if compile else "functrain_eager" if fused else "functrain_eager_chain"
        opt = optim.chain(
            optim.clip_by_global_norm(CLIP),
            optim.adamw(
                optim.warmup_cosine(LR, WARMUP, DECAY, end_value=MIN_LR), *BETAS, EPS, WD, mask=_decay_mask, fused=fused
            ),
        )
        self.state = init_state({k: v.clone() for k, v in params.items()}, opt)
        self.grads = grads
        opts = json.loads(os.environ.get("FT_OPTS", "{}"))
        self.update = step_lib.update_step(
            opt, donate=True, compile=compile, compile_options={"options": opts} if opts and compile else None
        )
        self.loss = torch.zeros((), device=next(iter(params.values())).device)

    def run(self):
        self.state, m = self.update(self.state, self.grads, {"loss": self.loss})
        return m["grad_norm"]


class ReadGrads:
    """One compiled read of every gradient (their squared norm): the pass clipping adds to any update."""

    name = "read_grads"

    def __init__(self, grads):
        self.grads = list(grads.values())
        self.fn = torch.compile(lambda gs: torch.stack([(g * g).sum() for g in gs]).sum(), fullgraph=True)

    def run(self):
        return self.fn(self.grads)


class TorchFused:
    """torch.optim.AdamW(fused=True), optionally after clip_grad_norm_."""

    def __init__(self, params, grads, clip):
        self.name = "torch_clip_fused" if clip else "torch_fused"
        self.params = [torch.nn.Parameter(v.clone()) for v in params.values()]
        for p, g in zip(self.params, grads.values()):
            p.grad = g.clone()
        groups = [
            {"params": [p for p in self.params if p.ndim >= 2], "weight_decay": WD},
            {"params": [p for p in self.params if p.ndim < 2], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)
        self.clip = clip

    def run(self):
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        self.opt.step()
        return self.params[0]


def profile(runner, n, device):
    """Prints the kernels of `n` updates of `runner`, most expensive first (where the time goes)."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            out = runner.run()
        float(out.detach().float().sum())
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"\nprofile of {n} functrain updates (per-kernel totals; divide by {n} for one update):")
    print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=70))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="100m", choices=sorted(SIZES))
    ap.add_argument("--rounds", type=int, default=30, help="alternating rounds")
    ap.add_argument("--per-round", type=int, default=2, help="updates per variant and round")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (every timed region ends in a sync)")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also profile N functrain updates and print the top kernels by device (or CPU) time",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument(
        "--host-memory",
        default="keep",
        choices=("keep", "default"),
        help="keep: freed memory stays in the process for both variants (functrain.trainer.memory), as "
        "the main program does; default: glibc's policy",
    )
    args = ap.parse_args()
    if args.host_memory == "keep":
        memory.keep_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    params, grads = _params_and_grads(args.size, torch.device(args.device))
    n = sum(v.numel() for v in params.values())
    print(
        f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads; "
        f"{args.size}: {n / 1e6:.1f}M params "
        f"in {len(params)} tensors",
        flush=True,
    )
    runners = [
        Functrain(params, grads),
        TorchFused(params, grads, clip=False),
        TorchFused(params, grads, clip=True),
        ReadGrads(grads),
        Functrain(params, grads, compile=False, fused=True),
        Functrain(params, grads, compile=False),
    ]
    for r in runners:
        t = time.perf_counter()
        float(r.run().detach().float().sum())
        print(f"  {r.name}: first update (compile for functrain) {time.perf_counter() - t:.1f} s", flush=True)
        r.run()
    per_update = {r.name: [] for r in runners}  # ms, one entry per round
    for i in range(args.rounds):
        for r in runners if i % 2 == 0 else runners[::-1]:
            t = time.perf_counter()
            for _ in range(args.per_round):
                out = r.run()
            float(out.detach().float().sum())  # waits for the device
            per_update[r.name].append(1e3 * (time.perf_counter() - t) / args.per_round)
    ms = {k: statistics.median(v) for k, v in per_update.items()}

    def ratio(a, b):
        """Median over rounds of a's time / b's time in the same round."""
        return statistics.median(x / y for x, y in zip(per_update[a], per_update[b]))

    r_fused, r_clip = ratio("functrain", "torch_fused"), ratio("functrain", "torch_clip_fused")
    print(f"\n| update of {n / 1e6:.1f}M params ({args.rounds} rounds) | median ms |\n|---|---|")
    for k, v in ms.items():
        print(f"| {k} | {v:.1f} |")
    # Clipping needs the global gradient norm before any parameter moves: one more read of the gradients
    # than an unclipped update, whoever fuses what. The floor of the ratio is (fused AdamW + that read) /
    # fused AdamW, measured here in the same rounds.
    floor = statistics.median((f + g) / f for f, g in zip(per_update["torch_fused"], per_update["read_grads"]))
    print(
        f"\nfunctrain / torch fused AdamW: {r_fused:.2f}x (vs clip_grad_norm_ + fused AdamW: {r_clip:.2f}x); "
        f"floor for a clipped update (fused AdamW + one read of the gradients): {floor:.2f}x"
    )
    e_fused, e_clip = ratio("functrain_eager", "torch_fused"), ratio("functrain_eager", "torch_clip_fused")
    c_clip = ratio("functrain_eager_chain", "torch_clip_fused")
    print(
        f"functrain eager (adamw fused=True) / torch fused AdamW: {e_fused:.2f}x (vs clip_grad_norm_ + fused "
        f"AdamW, the same math: {e_clip:.2f}x); the eager chain of foreach transforms: {c_clip:.2f}x the latter"
    )
    if args.profile:
        profile(runners[0], args.profile, torch.device(args.device))
    if args.json:
        print(
            json.dumps(
                {
                    "size": args.size,
                    "device": args.device,
                    "params": n,
                    "median_ms": ms,
                    "ratio": r_fused,
                    "ratio_vs_clip_fused": r_clip,
                    "clipped_floor": floor,
                    "eager_ratio": e_fused,
                    "eager_ratio_vs_clip_fused": e_clip,
                    "eager_chain_ratio_vs_clip_fused": c_clip,
                }
            )
        )


if __name__ == "__main__":
    main()
