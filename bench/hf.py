"""Benchmark: a transformers causal LM trained by functrain's compiled step vs the same model trained by a
plain eager loop with fused AdamW, and by the module under `torch.compile` with fused AdamW.

    python bench/hf.py [--type qwen2] [--size small] [--batch 8] [--seq 256] [--steps 20] [--json]

One model (a tiny-directory config of `--type`, `functrain.models.hf.tiny`, at `--size`), the same
initial params and batches for all three:

* functrain: `make_train_step(hf.make_loss_fn(template), chain(clip_by_global_norm, adamw))`: forward,
  backward, clipping, AdamW and the schedule compiled together in one graph;
* eager: `model(input_ids=x).logits`, cross-entropy, backward, `clip_grad_norm_`,
  `torch.optim.AdamW(fused=True)`;
* torch.compile: the same loop with the module compiled (`torch.compile(model)`), the optimizer
  fused but outside the graph.

Printed per route: cold compile (the first step's seconds), steady tokens/s (the median of the
timed steps after 3 warm-up steps), and functrain's ratios to the other two (target: >= 1.0 against
torch.compile, > 1.0 against eager); with `--json` a last line of JSON. On CUDA (`--device cuda`) the
same rows belong in bench/gpu.sh's table. Measured: docs/results.md ("bench/hf.py").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import functrain as ft  # noqa: E402
from functrain import optim, rng  # noqa: E402
from functrain.models import hf  # noqa: E402
from functrain.models.hf.tiny import write_tiny  # noqa: E402

SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4),
}
LR, CLIP = 1e-3, 1.0


def _batches(n, batch, seq, vocab, device):
    g = torch.Generator().manual_seed(0)
    return [tuple(torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(2)) for _ in range(n)]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(step, data, device) -> tuple[float, list[float]]:
    """(seconds of the first step, seconds of each later step)."""
    times = []
    for batch in data:
        t0 = time.perf_counter()
        step(batch)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times[0], times[1:]


def _functrain(template, params, data, device):
    opt = optim.chain(optim.clip_by_global_norm(CLIP), optim.adamw(LR, weight_decay=0.0))
    step = ft.make_train_step(hf.make_loss_fn(template), opt)
    box = {"state": ft.init_state(params, opt)}

    def run(batch):
        box["state"], m = step(box["state"], batch)
        float(m["loss"])

    return _timed(run, data, device)


def _torch_loop(config, params, data, device, compiled: bool):
    import transformers

    net = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    net.load_state_dict(params, strict=False)
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0, fused=True)
    forward = torch.compile(net) if compiled else net

    def run(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward(input_ids=x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        loss.item()

    return _timed(run, data, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="qwen2", help="a transformers model type")
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20, help="timed steps after 3 warm-up steps")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        config = hf.load_config(write_tiny(tmp, args.type, max_position_embeddings=max(256, args.seq),
                                           **SIZES[args.size]))
    template = hf.build_template(config, device=device)
    params = hf.init_params(template, rng.key(0), device=device)
    data = _batches(4 + args.steps, args.batch, args.seq, config.vocab_size, device)
    tokens = args.batch * args.seq
    rows = {}
    for name, run in (("functrain", lambda: _functrain(template, params, data, device)),
                      ("eager", lambda: _torch_loop(config, params, data, device, compiled=False)),
                      ("torch.compile", lambda: _torch_loop(config, params, data, device, compiled=True))):
        torch._dynamo.reset()
        first, rest = run()
        rows[name] = {"cold_s": first, "tokens_per_s": tokens / statistics.median(rest[3:])}
    n_params = sum(p.numel() for p in params.values())
    print(f"{type(template).__name__} {n_params / 1e6:.2f}M params, {args.batch} x {args.seq} tokens, {args.device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, row in rows.items():
        print(f"  {name:14s} cold {row['cold_s']:6.1f} s   {row['tokens_per_s']:10,.0f} tokens/s")
    ours = rows["functrain"]["tokens_per_s"]
    ratios = {f"vs_{k.replace('.', '_')}": ours / rows[k]["tokens_per_s"] for k in ("eager", "torch.compile")}
    print(f"functrain tokens/s: {ratios['vs_eager']:.2f}x eager + fused AdamW, {ratios['vs_torch_compile']:.2f}x "
          f"torch.compile + fused AdamW; cold compile {rows['functrain']['cold_s'] / rows['torch.compile']['cold_s']:.2f}x "
          "torch.compile's")
    if args.json:
        print(json.dumps({"type": args.type, "size": args.size, "params": n_params, "device": args.device,
                          "torch": torch.__version__, **{k: v for k, v in rows.items()}, **ratios}))


if __name__ == "__main__":
    main()
