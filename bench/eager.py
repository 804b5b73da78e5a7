"""Benchmark: functrain's eager step (`compile=False`) against a plain PyTorch eager loop, side by side in one run.

    python bench/eager.py [--models qwen2,gpt] [--shapes 4x32,8x64,16x128] [--steps 8] [--rounds 5] [--json]

Models: `qwen2`, a 6.2M-param Qwen2 (8 layers of width 256, 512 ids) through the hf family's loss; `gpt`,
functrain's GPT of `configs/gpt.py`'s default run (6 layers of width 384, 256 ids). For each model and
batch shape (rows x tokens) it times, on the same weights and batches:
  functrain  `make_train_step(loss_fn, from_config(optim), compile=False, skip_nonfinite=True,
             count_targets=...)`: the trainer's optimizer (clipping, AdamW with its schedule and decay
             mask; `adamw()` takes torch's fused kernel in eager steps), dropout keyed, donation
  torch      the module's forward, cross-entropy, backward, `clip_grad_norm_`, `torch.optim.AdamW` with the
             same decay groups and LambdaLR (its default implementation on this device: `--torch-fused`
             asks for fused=True)
Both run their first steps before the timed ones, then alternate in `--rounds` blocks of `--steps` steps
(load on the machine hits both alike). Printed per case: each one's median step time and the ratio
functrain / torch (goal <= 1.1). With `--json`, one JSON object per case:
{"case", "functrain_ms", "torch_ms", "ratio"}.

Measured: docs/results.md ("bench/eager.py").
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F

from functrain import init_state, make_train_step, rng
from functrain.models import lm
from functrain.trainer import defaults, memory
from functrain.trainer import optimizer as trainer_optimizer

STEPS = 1000  # the schedule's length (warm-up 100 of it: the rate changes from step to step on both sides)


def _qwen2():
    """(real module, functrain template, loss_fn, vocab) of the 6.2M-param Qwen2."""
    import transformers

    from functrain.models import hf

    config = transformers.Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    real = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    template = hf.build_template(config)
    return real, template, hf.make_loss_fn(template), 512, lambda m, x: m(input_ids=x).logits


def _gpt():
    """(real module, the same module as template, loss_fn, vocab) of configs/gpt.py's default model."""
    from functrain.models import gpt

    cfg = gpt.GPTConfig(vocab_size=256, block_size=256, n_layer=6, n_head=6, n_embd=384, dropout=0.0, bias=False)
    real = gpt.GPT(cfg, key=rng.key(0))
    return real, real, gpt.make_loss_fn(real), 256, lambda m, x: m(x)


def _decay(name: str, p: torch.Tensor) -> bool:
    return p.ndim >= 2 and "norm" not in name and "ln" not in name


def _case(model: str, rows: int, tokens: int, args) -> dict:
    """One model and batch shape: the two loops' median step times."""
    real, template, loss_fn, vocab, logits_of = (_qwen2 if model == "qwen2" else _gpt)()
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, vocab, (rows, tokens + 1), generator=g) for _ in range(8)]

    mod = copy.deepcopy(real).train()
    named = list(mod.named_parameters())
    c = defaults.trainer_config().optim
    groups = [
        {"params": [p for n, p in named if _decay(n, p)], "weight_decay": c.weight_decay},
        {"params": [p for n, p in named if not _decay(n, p)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=c.lr, betas=(c.b1, c.b2), eps=c.eps, fused=True if args.torch_fused else None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / (c.warmup_steps + 1)))

    def torch_step(ids):
        loss = F.cross_entropy(logits_of(mod, ids[:, :-1]).reshape(-1, vocab), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mod.parameters(), c.clip)
        opt.step()
        sched.step()
        return loss

    params = {n: p.detach().clone() for n, p in real.named_parameters()}
    optimizer = trainer_optimizer.from_config(c, STEPS)
    state = init_state(params, optimizer)
    step = make_train_step(loss_fn, optimizer, compile=False, skip_nonfinite=True, count_targets=lm.count_targets())
    box = [state]

    def functrain_step(ids):
        box[0], m = step(box[0], (ids[:, :-1], ids[:, 1:]))
        return m["loss"]

    runs = {"functrain": functrain_step, "torch": torch_step}
    for fn in runs.values():
        for i in range(2):
            float(fn(data[i]))
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(args.rounds):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            for i in range(args.steps):
                float(fn(data[(r * args.steps + i) % len(data)]))
            times[name].append((time.perf_counter() - t0) / args.steps)
    f, t = statistics.median(times["functrain"]), statistics.median(times["torch"])
    return {"case": f"{model} {rows}x{tokens}", "functrain_ms": 1000 * f, "torch_ms": 1000 * t, "ratio": f / t}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen2,gpt")
    p.add_argument("--shapes", default="4x32,8x64,16x128")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--torch-fused", action="store_true", help="torch.optim.AdamW(fused=True) for the reference")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    memory.keep_freed_memory()  # as the trainer does on the CPU (both loops benefit)
    print(f"{'case':18} {'functrain ms':>13} {'torch ms':>9} {'ratio':>6}")
    for model in args.models.split(","):
        for shape in args.shapes.split(","):
            rows, tokens = (int(x) for x in shape.split("x"))
            r = _case(model, rows, tokens, args)
            print(f"{r['case']:18} {r['functrain_ms']:13.1f} {r['torch_ms']:9.1f} {r['ratio']:6.3f}")
            if args.json:
                print(json.dumps({**r, "torch_fused": args.torch_fused, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
