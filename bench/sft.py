"""Benchmark: packed vs padded rows of the embedded fine-tuning set, side by side in one run.

    python bench/sft.py [--steps 40] [--batch 16] [--block 256] [--compile 1] [--json]

The examples are `configs/sft.py`'s (`stdlib:messages`, the byte tokenizer, the tiny Qwen2 of
`functrain.models.hf.tiny`); each layout trains the same fresh model with the token-weighted step
(`count_targets`) for `--steps` timed steps after one compiling step. Printed per layout: steps per
epoch, the rows' fill (real tokens and target tokens over all tokens), the step time, and target
(supervised) tokens per second; then the packed / padded ratios of steps per epoch and of target
tokens per second (anchor: 1.4-2x in Hugging Face's packing measurements).

With `--json` the last line is one JSON object. Measured: docs/results.md ("bench/sft.py").
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
from ml_collections import ConfigDict

from functrain import init_state, make_train_step, optim, rng
from functrain.data import ByteTokenizer, chat_template_of, sft_data
from functrain.models import hf, lm
from functrain.models.hf.tiny import write_tiny


def _measure(packing: bool, args, cache: str, model_dir: str) -> dict:
    """One layout's steps per epoch, fill, step time and target tokens per second."""
    cfg = ConfigDict({"path": "stdlib:messages", "packing": packing, "val_fraction": 0.02})
    data = sft_data(
        cfg,
        cache_dir=cache,
        tokenizer=ByteTokenizer(),
        template=chat_template_of(None),
        batch_size=args.batch,
        block_size=args.block,
        seed=0,
        eval_batches=1,
        log=lambda line: None,
    )
    template = hf.build_template(hf.load_config(model_dir))
    opt = optim.adamw(1e-3)
    state = init_state(hf.init_params(template, rng.key(0)), opt)
    step = make_train_step(hf.make_loss_fn(template), opt, count_targets=lm.count_targets(), compile=bool(args.compile))
    state, m = step(state, data.train_batch(0))  # compiles
    float(m["loss"])
    targets, t0 = 0.0, time.perf_counter()
    for s in range(1, args.steps + 1):
        state, m = step(state, data.train_batch(s))
        targets += float(m["targets"])
    dt = time.perf_counter() - t0
    fill_targets, fill_tokens = data.efficiency()
    return {
        "steps_per_epoch": data.steps_per_epoch,
        "fill_tokens": fill_tokens,
        "fill_targets": fill_targets,
        "step_s": dt / args.steps,
        "targets_per_s": targets / dt,
        "loss": float(m["loss"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny(f"{tmp}/qwen2", "qwen2"))
        rows = {name: _measure(name == "packed", args, f"{tmp}/data", model_dir) for name in ("padded", "packed")}
    print(f"{'layout':8} {'steps/epoch':>11} {'tokens':>7} {'targets':>8} {'step s':>8} {'targets/s':>10}")
    for name, r in rows.items():
        print(
            f"{name:8} {r['steps_per_epoch']:11.1f} {100 * r['fill_tokens']:6.0f}% {100 * r['fill_targets']:7.0f}% "
            f"{r['step_s']:8.4f} {r['targets_per_s']:10,.0f}"
        )
    ratio = {
        "steps_per_epoch": rows["padded"]["steps_per_epoch"] / rows["packed"]["steps_per_epoch"],
        "targets_per_s": rows["packed"]["targets_per_s"] / rows["padded"]["targets_per_s"],
    }
    print(
        f"packed / padded: {ratio['steps_per_epoch']:.2f}x fewer steps per epoch, "
        f"{ratio['targets_per_s']:.2f}x target tokens per second"
    )
    if args.json:
        print(json.dumps({"rows": rows, "ratio": ratio, "args": vars(args), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
