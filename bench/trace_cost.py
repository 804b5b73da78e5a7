"""Dynamo's trace time of a model call, side by side: what `functrain.apply` and einops layers save.

    python bench/trace_cost.py [--layers 12] [--repeats 3] [--json]

Each case is compiled with the "eager" backend (Dynamo's trace only: no AOTAutograd, no code
generation), after `torch._dynamo.reset()`, and timed over its first call; the cases alternate
`--repeats` times and the minimum is kept (2-core hosts vary 10-20% from run to run). Cases:

- `functional_call`: a `--layers`-deep GPT's forward through `torch.func.functional_call(model,
  params, (x,))`, whose weight tying walks every parameter and buffer of the module in traced Python;
- `apply`: the same through `functrain.apply` (the tied names a constant of the module);
- `rearrange`, `layer`: 4 x `--layers` attention head splits and merges as `einops.rearrange`
  calls (the pattern parsed in traced Python at every call) and as `einops.layers.torch.Rearrange`
  layers (parsed once when built), what the GPT's attention does per layer.

Printed: one row per case and the two ratios; with `--json`, one JSON object as the last line
(`trace_s` per case, `apply_ratio`, `layer_ratio`).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch._dynamo
from einops import rearrange
from einops.layers.torch import Rearrange

from functrain import apply, rng
from functrain.models import gpt


def _first_call_s(fn, *args) -> float:
    """Seconds of the first call of `torch.compile(fn, backend="eager")` after a Dynamo reset."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    t = time.perf_counter()
    compiled(*args)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    cfg = gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=args.layers, n_head=4, n_embd=64, dropout=0.0)
    model = gpt.GPT(cfg, key=rng.key(0))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    heads = torch.randn(2, cfg.block_size, cfg.n_embd)  # (B, T, C)
    split, merge = Rearrange("b t (h d) -> b h t d", d=16), Rearrange("b h t d -> b t (h d)")
    calls = 4 * args.layers  # the GPT's q, k, v splits and the merge, per layer (3 splits + 1 merge)

    def by_functions(y):
        for _ in range(calls // 2):
            y = rearrange(rearrange(y, "b t (h d) -> b h t d", d=16), "b h t d -> b t (h d)") + 1  # (B, T, C)
        return y

    def by_layers(y):
        for _ in range(calls // 2):
            y = merge(split(y)) + 1  # (B, T, C)
        return y

    cases = {
        "functional_call": lambda: _first_call_s(lambda p, i: torch.func.functional_call(model, p, (i,)), params, x),
        "apply": lambda: _first_call_s(lambda p, i: apply(model, p, i), params, x),
        "rearrange": lambda: _first_call_s(by_functions, heads),
        "layer": lambda: _first_call_s(by_layers, heads),
    }
    assert torch.equal(by_functions(heads), by_layers(heads))
    best = {name: float("inf") for name in cases}
    for _ in range(args.repeats):
        for name, run in cases.items():
            best[name] = min(best[name], run())
    for name, s in best.items():
        print(f"{name:>16}: {s:6.2f} s")
    apply_ratio = best["apply"] / best["functional_call"]
    layer_ratio = best["layer"] / best["rearrange"]
    print(f"apply / functional_call: {apply_ratio:.2f}; Rearrange layers / rearrange calls: {layer_ratio:.2f}")
    if args.json:
        print(
            json.dumps({"layers": args.layers, "trace_s": best, "apply_ratio": apply_ratio, "layer_ratio": layer_ratio})
        )


if __name__ == "__main__":
    main()
