"""Benchmark: functrain's compiled step against `torch.compile(model)` with fused AdamW, per model type.

    python bench/hf.py [--type llama,gpt2,qwen2,gpt] [--size small] [--batch 8] [--seq 256] [--rounds 5]
                       [--compile-unit step|blocks] [--optimizer fused|compiled] [--host-memory keep|default] [--json]

For each `--type` (a transformers model type read by the hf family from a tiny directory,
`functrain.models.hf.tiny`, or `gpt`: functrain's own GPT family) one model at `--size`, the same
initial params and batches for every route:

* functrain: `make_train_step(<family>.make_loss_fn(template), chain(clip_by_global_norm, adamw(fused=True)))`:
  the loss's forward compiled with its backward, then clipping and torch's fused AdamW kernel, as the
  reference's optimizer (`--optimizer compiled`: functrain's AdamW compiled after the loss instead);
* torch.compile: `torch.compile(model)`, cross-entropy, backward, `clip_grad_norm_`,
  `torch.optim.AdamW(fused=True)` (the optimizer outside the graph, torch's precompiled kernel);
* eager: the same loop, the module not compiled.

`--compile-unit blocks` gives functrain the family's staged loss and `compile="blocks"`. Every
route's process keeps freed memory in the heap (`--host-memory keep`, `functrain.trainer.memory`:
the main job's default on CPU); without it each step's fresh buffers are fresh pages of the kernel,
which costs the one-graph step more than the others (docs/results.md).

Each compiled route runs in a process of its own with an empty inductor cache (cold: the first
step's seconds), then again in a second process on the cache the first one filled (warm: the first
step's seconds). functrain's processes set that cache up as its main job does
(`compiler.cache.setup`), so its step is saved whole and its warm start loads it
(`compiler.saved_steps`). The steady step is timed side by side: one more process builds all three routes
(each on its warm cache), warms each up with 3 steps, then times them in turn, `--steps` steps per
route per round for `--rounds` rounds; a route's figure is the median of its rounds, so a machine
that slows down for a while slows every route alike. Printed per type: the routes' rows, the three
ratios the targets are stated in, and the compile time of functrain's cold process by phase
(`torch._dynamo.utils.compile_times()`, seconds summed over graphs). With `--json`, one line per type:

    {"type": ..., "optimizer": "fused" | "compiled", "cold_vs_compile": <functrain cold / torch.compile cold>,
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
from functrain.compiler import cache as compile_cache  # noqa: E402
from functrain.trainer import memory  # noqa: E402

SIZES = {
    "tiny": dict(
        hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "small": dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4
    ),
}
LR, CLIP, VOCAB = 1e-3, 1.0, 256
ROUTES = ("functrain", "torch.compile", "eager")
PHASES = (
    "bytecode_tracing",
    "OutputGraph.call_user_compiler",
    "GraphLowering.run",
    "Scheduler.__init__",
    "Scheduler.codegen",
    "async_compile.wait",
)


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
            self.cfg = gpt.GPTConfig(
                vocab_size=VOCAB,
                block_size=max(256, seq),
                n_layer=s["num_hidden_layers"],
                n_head=s["num_attention_heads"],
                n_embd=s["hidden_size"],
                dropout=0.0,
            )
            with torch.device("meta"):
                self.template = gpt.GPT(self.cfg)
            self.params = gpt.init_params(self.template, rng.key(0), device=device)
            self.loss_fn = gpt.make_loss_fn(self.template)
            self.staged_loss_fn = lambda: gpt.make_loss_fn(self.template, staged=True)
        else:
            from functrain.models import hf
            from functrain.models.hf.tiny import write_tiny

            # one directory per model for every process: its path is in the config, so in the saved step's key
            where = os.path.join(tempfile.gettempdir(), f"functrain-bench-hf-{kind}-{size}-{seq}")
            self.cfg = hf.load_config(write_tiny(where, kind, max_position_embeddings=max(256, seq), **SIZES[size]))
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


def _functrain(model: _Model, unit: str, optimizer: str):
    """functrain's step on its own state: `run(batch)`."""
    compile_cache.setup(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "user")  # (as the main job)
    opt = optim.chain(optim.clip_by_global_norm(CLIP), optim.adamw(LR, weight_decay=0.0, fused=optimizer == "fused"))
    step = ft.make_train_step(model.loss_fn if unit == "step" else model.staged_loss_fn(), opt, compile=unit)
    box = {"state": ft.init_state(model.params, opt)}

    def run(batch):
        box["state"], m = step(box["state"], batch)
        float(m["loss"])

    return run


def _torch_loop(model: _Model, compiled: bool):
    """torch's loop (compiled module or eager) on its own module and optimizer: `run(batch)`."""
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

    return run


def _route(model: _Model, route: str, unit: str, optimizer: str):
    """The `run(batch)` of one route."""
    if route == "functrain":
        return _functrain(model, unit, optimizer)
    return _torch_loop(model, compiled=route == "torch.compile")


def _phases() -> dict[str, float]:
    """Seconds per compile phase of this process, summed over its graphs."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv")
    per = {n: sum(float(x) for x in str(v).split(",") if x.strip()) for n, v in zip(names, values)}
    return {p: round(per.get(p, 0.0), 2) for p in PHASES}


def _child_setup(args):
    """This child's device, model and batches (freed memory kept on CPU with `--host-memory keep`)."""
    device = torch.device(args.device)
    if args.host_memory == "keep" and device.type == "cpu":
        memory.keep_freed_memory()
    model = _Model(args.type, args.size, args.seq, device)
    vocab = VOCAB if args.type == "gpt" else model.cfg.vocab_size
    return device, model, _batches(3 + args.steps, args.batch, args.seq, vocab, device)


def _child_first(args) -> None:
    """One route, cold or warm, in this process: prints one JSON line (first step's seconds, compile phases)."""
    device, model, data = _child_setup(args)
    (first_s,) = _timed(_route(model, args.route, args.compile_unit, args.optimizer), data[:1], device)
    print(
        json.dumps({"first_s": first_s, "params": sum(p.numel() for p in model.params.values()), "phases": _phases()})
    )


def _child_steady(args) -> None:
    """All routes in this process, timed in turn round by round: prints one JSON line of tokens/s per route."""
    device, model, data = _child_setup(args)
    runs = {}
    for route in ROUTES:
        if route in args.caches:  # each compiled route on the cache its warm process read
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.caches[route]
        runs[route] = _route(model, route, args.compile_unit, args.optimizer)
        _timed(runs[route], data[:3], device)
    per_round = {route: [] for route in ROUTES}
    for _ in range(args.rounds):
        for route, run in runs.items():
            per_round[route].append(sum(_timed(run, data[3:], device)) / args.steps)
    print(json.dumps({route: args.batch * args.seq / statistics.median(t) for route, t in per_round.items()}))


def _spawn(args, kind: str, route: str, cache: str, caches: dict[str, str]) -> dict:
    """Runs one route (or, with route "steady", all of them) in a child process and returns its JSON line."""
    env = dict(os.environ)
    if route in caches:
        env["TORCHINDUCTOR_CACHE_DIR"] = caches[route]
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        route,
        "--type",
        kind,
        "--size",
        args.size,
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--rounds",
        str(args.rounds),
        "--device",
        args.device,
        "--compile-unit",
        args.compile_unit,
        "--optimizer",
        args.optimizer,
        "--host-memory",
        args.host_memory,
        "--caches",
        json.dumps(caches),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        sys.exit(f"bench/hf.py: {kind} {route} ({cache}) failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def _one_type(args, kind: str) -> dict:
    """All routes of one type; returns the figures."""
    rows = {}
    with tempfile.TemporaryDirectory() as ours, tempfile.TemporaryDirectory() as theirs:
        caches = {"functrain": ours, "torch.compile": theirs}
        for route in caches:
            rows[route] = _spawn(args, kind, route, "cold", caches)
            warm = _spawn(args, kind, route, "warm", caches)
            rows[route].update(warm_first_s=warm["first_s"], warm_phases=warm["phases"])
        rows["eager"] = {}
        for route, tokens_per_s in _spawn(args, kind, "steady", "warm", caches).items():
            rows[route]["tokens_per_s"] = tokens_per_s
    ours_row, theirs_row = rows["functrain"], rows["torch.compile"]
    print(
        f"{kind}: {ours_row['params'] / 1e6:.2f}M params, {args.batch} x {args.seq} tokens, {args.device}, "
        f"torch {torch.__version__}, {os.environ.get('OMP_NUM_THREADS', torch.get_num_threads())} threads, "
        f"functrain's AdamW {args.optimizer}"
    )
    for route, row in rows.items():
        warm = f"   warm {row['warm_first_s']:5.1f} s" if "warm_first_s" in row else " " * 16
        cold = f"cold {row['first_s']:6.1f} s" if "first_s" in row else " " * 13
        print(f"  {route:14s} {cold}{warm}   {row['tokens_per_s']:10,.0f} tokens/s")
    figures = {
        "type": kind,
        "compile_unit": args.compile_unit,
        "optimizer": args.optimizer,
        "cold_vs_compile": round(ours_row["first_s"] / theirs_row["first_s"], 3),
        "warm_first_step_s": round(ours_row["warm_first_s"], 2),
        "step_vs_compile": round(ours_row["tokens_per_s"] / theirs_row["tokens_per_s"], 3),
    }
    print(
        f"  cold compile {figures['cold_vs_compile']:.2f}x torch.compile's (target <= 1.0); warm first step "
        f"{figures['warm_first_step_s']:.1f} s (target <= 5); step {figures['step_vs_compile']:.2f}x "
        f"torch.compile's (target >= 1.05), {ours_row['tokens_per_s'] / rows['eager']['tokens_per_s']:.2f}x eager's"
    )
    for route in ("functrain", "torch.compile"):
        for cache, key in (("cold", "phases"), ("warm", "warm_phases")):
            print(
                f"  {route} {cache}, compile phases (s): "
                + ", ".join(f"{k} {v:.1f}" for k, v in rows[route][key].items())
            )
    return {
        **figures,
        "size": args.size,
        "params": ours_row["params"],
        "device": args.device,
        "torch": torch.__version__,
        "vs_eager": round(ours_row["tokens_per_s"] / rows["eager"]["tokens_per_s"], 3),
        **{route: row for route, row in rows.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="qwen2", help="comma-separated: transformers model types, or gpt")
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per route per round (after 3 warm-up steps)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the steady timing; each route's median counts")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile-unit", default="step", choices=("step", "blocks"), help="functrain's compile unit")
    ap.add_argument(
        "--optimizer",
        default="fused",
        choices=("fused", "compiled"),
        help="functrain's AdamW: torch's fused kernel after the compiled loss (as the reference's) or compiled",
    )
    ap.add_argument(
        "--host-memory",
        default="keep",
        choices=("keep", "default"),
        help="keep: every route's process keeps freed memory (the main job's default on CPU)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", choices=ROUTES + ("steady",), dest="route", help=argparse.SUPPRESS)
    ap.add_argument("--caches", type=json.loads, default={}, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.route == "steady":
        return _child_steady(args)
    if args.route:
        return _child_first(args)
    results = [_one_type(args, kind) for kind in args.type.split(",")]
    if args.json:
        for r in results:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
