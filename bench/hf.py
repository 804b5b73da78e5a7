"""Benchmark: functrain's compiled step against `torch.compile(model)` with fused AdamW, per model type.

    python bench/hf.py [--type llama,gpt2,qwen2,gpt] [--size small] [--batch 8] [--seq 256] [--steps 20]
                       [--compile-unit step|blocks] [--host-memory keep|default] [--json]

For each `--type` (a transformers model type read by the hf family from a tiny directory,
`functrain.models.hf.tiny`, or `gpt`: functrain's own GPT family) one model at `--size`, the same
initial params and batches for every route:

* functrain: `make_train_step(<family>.make_loss_fn(template), chain(clip_by_global_norm, adamw))`:
  forward, backward, clipping, AdamW and the schedule compiled together;
* torch.compile: `torch.compile(model)`, cross-entropy, backward, `clip_grad_norm_`,
  `torch.optim.AdamW(fused=True)` (the optimizer outside the graph, torch's precompiled kernel);
* eager: the same loop, the module not compiled.

`--compile-unit blocks` gives functrain the family's staged loss and `compile="blocks"`. Every
route's process keeps freed memory in the heap (`--host-memory keep`, `functrain.trainer.memory`:
the main job's default on CPU); without it each step's fresh buffers are fresh pages of the kernel,
which costs the one-graph step more than the others (docs/results.md).

Each route runs in a process of its own with an empty inductor cache (cold: the first step's
seconds, then the median of the timed steps after 3 warm-up steps); the two compiled routes then
run again in a second process on the cache the first one filled (warm: the first step's seconds).
Printed per type: the routes' rows, the three ratios the targets are stated in, and the compile
time of functrain's cold process by phase (`torch._dynamo.utils.compile_times()`, seconds summed
over graphs). With `--json`, one line per type:

    {"type": ..., "cold_vs_compile": <functrain cold / torch.compile cold>,
     "warm_first_step_s": <functrain's first step, warm>, "step_vs_compile": <functrain tokens/s /
     torch.compile's>, ...}

On CUDA (`--device cuda`) the same lines belong in bench/gpu.sh's table. Measured: docs/results.md
("bench/hf.py").
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

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import functrain as ft  # noqa: E402
from functrain import optim, rng  # noqa: E402
from functrain.trainer import memory  # noqa: E402

SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4),
}
LR, CLIP, VOCAB = 1e-3, 1.0, 256
ROUTES = ("functrain", "torch.compile", "eager")
PHASES = ("bytecode_tracing", "OutputGraph.call_user_compiler", "GraphLowering.run", "Scheduler.__init__",
          "Scheduler.codegen", "async_compile.wait")


def _batches(n, batch, seq, vocab, device):
    g = torch.Generator().manual_seed(0)
    return [tuple(torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(2)) for _ in range(n)]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(step, data, device) -> list[float]:
    """Seconds of each step."""
    times = []
    for batch in data:
        t0 = time.perf_counter()
        step(batch)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


class _Model:
    """One model of `--type` at `--size`: functrain's template, loss and params, and torch's module."""

    def __init__(self, kind: str, size: str, seq: int, device: torch.device):
        self.kind, self.device = kind, device
        if kind == "gpt":
            from functrain.models import gpt
            s = SIZES[size]
            self.cfg = gpt.GPTConfig(vocab_size=VOCAB, block_size=max(256, seq), n_layer=s["num_hidden_layers"],
                                     n_head=s["num_attention_heads"], n_embd=s["hidden_size"], dropout=0.0)
            with torch.device("meta"):
                self.template = gpt.GPT(self.cfg)
            self.params = gpt.init_params(self.template, rng.key(0), device=device)
            self.loss_fn = gpt.make_loss_fn(self.template)
            self.staged_loss_fn = lambda: gpt.make_loss_fn(self.template, staged=True)
        else:
            from functrain.models import hf
            from functrain.models.hf.tiny import write_tiny
            with tempfile.TemporaryDirectory() as tmp:
                self.cfg = hf.load_config(write_tiny(tmp, kind, max_position_embeddings=max(256, seq), **SIZES[size]))
            self.template = hf.build_template(self.cfg, device=device)
            self.params = hf.init_params(self.template, rng.key(0), device=device)
            self.loss_fn = hf.make_loss_fn(self.template)
            self.staged_loss_fn = lambda: hf.make_loss_fn(self.template, staged=True)

    def module(self) -> torch.nn.Module:
        """torch's module with the same params."""
        if self.kind == "gpt":
            from functrain.models import gpt
            net = gpt.GPT(self.cfg).to(self.device)
        else:
            import transformers
            net = transformers.AutoModelForCausalLM.from_config(self.cfg, attn_implementation="sdpa").to(self.device)
        net.load_state_dict(self.params, strict=False)
        return net.train()

    def logits(self, net, x):
        """(B, T, V) logits of torch's module."""
        return net(x) if self.kind == "gpt" else net(input_ids=x).logits


def _functrain(model: _Model, data, unit: str) -> list[float]:
    opt = optim.chain(optim.clip_by_global_norm(CLIP), optim.adamw(LR, weight_decay=0.0))
    step = ft.make_train_step(model.loss_fn if unit == "step" else model.staged_loss_fn(), opt, compile=unit)
    box = {"state": ft.init_state(model.params, opt)}

    def run(batch):
        box["state"], m = step(box["state"], batch)
        float(m["loss"])

    return _timed(run, data, model.device)


def _torch_loop(model: _Model, data, compiled: bool) -> list[float]:
    net = model.module()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0, fused=True)
    forward = torch.compile(net) if compiled else net

    def run(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model.logits(forward, x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        loss.item()

    return _timed(run, data, model.device)


def _phases() -> dict[str, float]:
    """Seconds per compile phase of this process, summed over its graphs."""
    from torch._dynamo.utils import compile_times
    names, values = compile_times(repr="csv")
    per = {n: sum(float(x) for x in str(v).split(",") if x.strip()) for n, v in zip(names, values)}
    return {p: round(per.get(p, 0.0), 2) for p in PHASES}


def _child(args) -> None:
    """One route in this process: prints one JSON line (first step, steady tokens/s, compile phases)."""
    device = torch.device(args.device)
    if args.host_memory == "keep" and device.type == "cpu":
        memory.keep_freed_memory()
    model = _Model(args.type, args.size, args.seq, device)
    n = args.steps + 4 if args.cache == "cold" or args.route == "eager" else 2
    data = _batches(n, args.batch, args.seq, VOCAB if args.type == "gpt" else model.cfg.vocab_size, device)
    if args.route == "functrain":
        times = _functrain(model, data, args.compile_unit)
    else:
        times = _torch_loop(model, data, compiled=args.route == "torch.compile")
    steady = statistics.median(times[4:]) if len(times) > 4 else None
    print(json.dumps({"first_s": times[0], "tokens_per_s": steady and args.batch * args.seq / steady,
                      "params": sum(p.numel() for p in model.params.values()), "phases": _phases()}))


def _spawn(args, kind: str, route: str, cache: str, cache_dir: str | None) -> dict:
    """Runs one route in a child process and returns its JSON line."""
    env = dict(os.environ)
    if cache_dir:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    cmd = [sys.executable, os.path.abspath(__file__), "--child", route, "--cache", cache, "--type", kind,
           "--size", args.size, "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
           "--device", args.device, "--compile-unit", args.compile_unit, "--host-memory", args.host_memory]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        sys.exit(f"bench/hf.py: {kind} {route} ({cache}) failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def _one_type(args, kind: str) -> dict:
    """All routes of one type; returns the figures."""
    rows = {}
    with tempfile.TemporaryDirectory() as ours, tempfile.TemporaryDirectory() as theirs:
        for route, cache_dir in (("functrain", ours), ("torch.compile", theirs), ("eager", None)):
            rows[route] = _spawn(args, kind, route, "cold", cache_dir)
            if cache_dir:
                warm = _spawn(args, kind, route, "warm", cache_dir)
                rows[route].update(warm_first_s=warm["first_s"], warm_phases=warm["phases"])
    ours_row, theirs_row = rows["functrain"], rows["torch.compile"]
    print(f"{kind}: {ours_row['params'] / 1e6:.2f}M params, {args.batch} x {args.seq} tokens, {args.device}, "
          f"torch {torch.__version__}, {os.environ.get('OMP_NUM_THREADS', torch.get_num_threads())} threads")
    for route, row in rows.items():
        warm = f"   warm {row['warm_first_s']:5.1f} s" if "warm_first_s" in row else ""
        print(f"  {route:14s} cold {row['first_s']:6.1f} s{warm}   {row['tokens_per_s']:10,.0f} tokens/s")
    figures = {"type": kind, "compile_unit": args.compile_unit,
               "cold_vs_compile": round(ours_row["first_s"] / theirs_row["first_s"], 3),
               "warm_first_step_s": round(ours_row["warm_first_s"], 2),
               "step_vs_compile": round(ours_row["tokens_per_s"] / theirs_row["tokens_per_s"], 3)}
    print(f"  cold compile {figures['cold_vs_compile']:.2f}x torch.compile's (target <= 1.0); warm first step "
          f"{figures['warm_first_step_s']:.1f} s (target <= 5); step {figures['step_vs_compile']:.2f}x "
          f"torch.compile's (target >= 1.05), {ours_row['tokens_per_s'] / rows['eager']['tokens_per_s']:.2f}x eager's")
    for route in ("functrain", "torch.compile"):
        for cache, key in (("cold", "phases"), ("warm", "warm_phases")):
            print(f"  {route} {cache}, compile phases (s): " +
                  ", ".join(f"{k} {v:.1f}" for k, v in rows[route][key].items()))
    return {**figures, "size": args.size, "params": ours_row["params"], "device": args.device,
            "torch": torch.__version__, "vs_eager": round(ours_row["tokens_per_s"] / rows["eager"]["tokens_per_s"], 3),
            **{route: row for route, row in rows.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="qwen2", help="comma-separated: transformers model types, or gpt")
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20, help="timed steps after 3 warm-up steps")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile-unit", default="step", choices=("step", "blocks"), help="functrain's compile unit")
    ap.add_argument("--host-memory", default="keep", choices=("keep", "default"),
                    help="keep: every route's process keeps freed memory (the main job's default on CPU)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", choices=ROUTES, dest="route", help=argparse.SUPPRESS)
    ap.add_argument("--cache", choices=("cold", "warm"), default="cold", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.route:
        return _child(args)
    results = [_one_type(args, kind) for kind in args.type.split(",")]
    if args.json:
        for r in results:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
