"""Benchmark: K tiny GPTs in one compiled population step vs K sequential compiled solo steps.

    python bench/population.py [--k 8] [--rounds 5] [--steps 5] [--json]

Model: `configs/gpt.py:tiny`'s (2 x 64, block 64, vocab 256, batch 16), clipped AdamW on a warm-up
cosine schedule; the K members have their own seeds and learning rates (hyper-parameters are
state, so one graph serves them all). Rounds alternate the two variants; printed: ms per population
step, ms for K solo steps, and the median over rounds of the paired throughput ratio (target >= 3
at K=8). With `--json` the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from functrain import init_state, make_train_step, optim, population, rng, tree
from functrain.models import gpt
from functrain.trainer import metrics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="steps per variant and round")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    cfg = gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64, bias=False)
    with torch.device("meta"):
        template = gpt.GPT(cfg)
    loss_fn = gpt.make_loss_fn(template)
    opt = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.adamw(optim.warmup_cosine(1e-2, 10, 150, end_value=1e-3), b2=0.95, weight_decay=0.1),
    )
    members = [
        optim.set_hyperparams(init_state(gpt.init_params(template, rng.key(k)), opt, seed=k), lr=1e-2 * 0.7**k)
        for k in range(args.k)
    ]
    x = torch.randint(0, cfg.vocab_size, (16, cfg.block_size + 1), generator=torch.Generator().manual_seed(0))
    batch = (x[:, :-1], x[:, 1:])

    t0 = time.perf_counter()
    pstep = population.make_population_step(loss_fn, opt)
    pop, _ = pstep(population.stack([tree.clone(m) for m in members]), batch)
    compile_pop = time.perf_counter() - t0
    t0 = time.perf_counter()
    solo = make_train_step(loss_fn, opt)
    members[0], _ = solo(members[0], batch)
    compile_solo = time.perf_counter() - t0
    print(f"compile: population {compile_pop:.1f}s, solo {compile_solo:.1f}s")

    ratios, pop_ms, solo_ms = [], [], []
    for r in range(args.rounds):
        order = ("pop", "solo") if r % 2 == 0 else ("solo", "pop")
        times = {}
        for which in order:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                if which == "pop":
                    pop, _ = pstep(pop, batch)
                else:
                    members = [solo(m, batch)[0] for m in members]
            times[which] = (time.perf_counter() - t0) / args.steps * 1e3
        pop_ms.append(times["pop"])
        solo_ms.append(times["solo"])
        ratios.append(times["solo"] / times["pop"])
        print(
            f"round {r}: population {times['pop']:.1f} ms/step, {args.k} solo steps {times['solo']:.1f} ms: "
            f"{ratios[-1]:.2f}x"
        )
    ratio = statistics.median(ratios)
    # The most any batching can give: K steps' FLOPs at the machine's dense matmul rate (the best
    # any kernel here reaches) vs the K solo steps as measured.
    peak = metrics.measure_peak_flops(torch.device("cpu"))
    floor_ms = args.k * gpt.flops_per_token(cfg) * x[:, :-1].numel() / peak * 1e3
    bound = statistics.median(solo_ms) / floor_ms
    print(
        f"compute floor: {args.k} steps' FLOPs at the {peak / 1e9:.0f} GFLOP/s matmul rate take {floor_ms:.1f} ms: "
        f"no step over K members can beat {bound:.2f}x here"
    )
    print(f"K={args.k}: population throughput / sequential solo steps: {ratio:.2f}x (target >= 3)")
    if args.json:
        print(
            json.dumps(
                {
                    "k": args.k,
                    "population_ms": statistics.median(pop_ms),
                    "solo_ms": statistics.median(solo_ms),
                    "ratio": ratio,
                    "flop_bound_ratio": bound,
                    "compile_s": {"population": compile_pop, "solo": compile_solo},
                }
            )
        )


if __name__ == "__main__":
    main()
