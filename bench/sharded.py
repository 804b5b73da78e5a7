"""Sharded training benchmark: functrain's compiled FSDP step vs the eager FSDP2 loop, on N ranks.

Both train the same GPT from the same weights on the same batches, FSDP over all ranks:
  functrain   `parallel.shard_state` (DTensor params, Shard(0) on dp_shard) + `make_train_step`
              (compiled: gather, forward/backward, reduce-scatter, clipping, AdamW in one graph,
              donated buffers)
  fsdp2       `fully_shard` on every block and the root + `torch.optim.AdamW(foreach=True)` +
              `clip_grad_norm_`, the usual eager loop (loss.backward(); clip; opt.step(); zero_grad)
  (optional) functrain-eager: the same sharded step, not compiled.
Measurements are interleaved (each round runs every method for --steps steps, in turn) after a
warm-up (compilation included there, reported separately). Printed: median step time and steps/s of
each method, the ratio functrain / fsdp2, and peak memory: RSS growth during a round over the RSS
at its start (free heap returned to the OS with malloc_trim first; the kernel's high-water mark
reset through /proc/self/clear_refs), max over rounds. Step times are the max over ranks. Also
printed: each method's peak of live tensor bytes over one more step under the profiler (what glibc
keeps mapped after a free inflates the RSS, not this), and for the compiled step the gathered
params alive at once from a model of its graph's buffers (`compiler.gathered_in_flight`, logged by
the reshard pass while inductor compiles; so the step compiles here, in a fresh cache directory,
unless --warm-cache).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/sharded.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/sharded.py --eager   # + uncompiled
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/sharded.py --bucket-numel 1000000 --reorder
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/sharded.py --n-layer 6 --n-embd 512 \
        --n-head 8 --rounds 3 --steps 3 --whole --json     # the FSDP2 comparison; last line is JSON
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/sharded.py --compile-unit blocks
        # functrain compiled stage by stage, the update group by group (README "Compile unit")
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/sharded.py --n-layer 4 --n-embd 512 \
        --n-head 8 --remat none --profile 45      # + each method's 45 costliest ops of one step
    ... --reduce-scatter all_to_all              # functrain's gradients by all-to-all + sum (spmd)
    ... --reduce-scatter reduce_scatter,all_reduce   # routes interleaved in one run (functrain-all_reduce)

Measured: docs/results.md ("bench/sharded.py").
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import optree
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _mem import reset_peak, trim  # noqa: E402

from functrain import apply, init_state, make_train_step, optim, parallel, rng  # noqa: E402
from functrain.compiler import cache as compile_cache  # noqa: E402
from functrain.models import gpt  # noqa: E402
from functrain.parallel import spmd  # noqa: E402


def _rss_kib(field: str) -> int:
    """A memory field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    """Trims the heap, then resets the RSS high-water mark (VmHWM); False where unsupported."""
    trim()
    return reset_peak()


def _batches(cfg, n, batch_size, ctx):
    """This rank's rows of `n` global batches of random tokens."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size), generator=g)
        y = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size), generator=g)
        out.append(parallel.split_batch((x, y), ctx.dp_rank, ctx.dp_world))
    return out


class Functrain:
    """functrain's sharded step (compiled or eager): per-block gathers (a staged loss) by default,
    the whole model gathered before the forward with `whole=True` (the route before issue 12)."""

    def __init__(
        self,
        model,
        ctx,
        lr,
        clip,
        compile,
        compile_options=None,
        remat="full",
        whole=False,
        reduce_scatter="auto",
        layout_options=None,
    ):
        self.mesh, self.options = ctx.mesh, dict(reduce_scatter=reduce_scatter, **(layout_options or {}))
        opt = optim.chain(optim.clip_by_global_norm(clip), optim.adamw(lr, weight_decay=0.1))
        if whole:

            def loss_fn(params, batch, key):
                x, y = batch
                return gpt.cross_entropy(apply(model, params, x, dropout_key=key), y)
        else:
            loss_fn = gpt.make_loss_fn(model, remat=remat, staged=True)

        self.state = parallel.shard_state(init_state(model, opt), ctx.mesh)
        self.step_fn = make_train_step(loss_fn, opt, compile=compile, compile_options=compile_options)

    def state_bytes(self):
        """Bytes of this rank's params and optimizer state (local shards)."""
        return sum(
            x.to_local().nbytes if hasattr(x, "to_local") else x.nbytes
            for x in optree.tree_leaves((self.state.params, self.state.opt_state))
        )

    def step(self, batch):
        parallel.configure(self.mesh, **self.options)  # this method's layout (each set of options: its own graph)
        self.state, m = self.step_fn(self.state, batch)
        return m["loss"]


class FSDP2:
    """The eager FSDP2 loop: fully_shard + torch.optim.AdamW(foreach=True)."""

    def __init__(self, model, ctx, lr, clip):
        from torch.distributed.fsdp import fully_shard

        self.model = model
        mesh = ctx.mesh["dp_shard"]
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, foreach=True)
        self.clip = clip

    def state_bytes(self):
        """Bytes of this rank's params and optimizer state (local shards)."""
        params = sum(p.to_local().nbytes for p in self.model.parameters())
        opt = sum(
            t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
            for st in self.opt.state.values()
            for t in st.values()
            if isinstance(t, torch.Tensor)
        )
        return params + opt

    def step(self, batch):
        x, y = batch
        loss = gpt.cross_entropy(self.model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def _live_growth_mib(m, batch, top=0) -> tuple[float, str]:
    """The most tensor bytes alive at once during one step beyond those alive before it, in MiB, and
    (with `top`) a table of the step's `top` ops by self CPU time.

    From the profiler's record of every allocation and free (torch's CPU allocator, any thread): the
    live bytes the step needs, whatever malloc keeps mapped afterwards (which the RSS shows).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        float(m.step(batch))
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top) if top else ""
    return peak / 2**20, table


class _Gathered(logging.Handler):
    """Keeps what functrain.compiler.regather logs for each compiled graph (its gathered-params model)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.models = []

    def emit(self, record):
        if hasattr(record, "gathered"):
            self.models.append((record.gathered, record.regathered))


def _block_numel(cfg) -> int:
    """One block's parameters (bias=True): attention 4 d^2 + 4 d, MLP 8 d^2 + 5 d, two layer norms 4 d."""
    return 12 * cfg.n_embd**2 + 13 * cfg.n_embd


def _expected_mib(cfg, local_batch: int, n: int, remat: str) -> dict:
    """functrain's per-rank training memory from first principles (fp32, AdamW), in MiB.

    state: (params + Adam m, v) / N; grads: the reduce-scattered shards / N plus the largest stage's
    full gradient before its reduce-scatter; gathered: two stages' params in flight (the one computing
    and the next); activations: a recomputed block holds its input (d per token), a kept block what
    its backward reads once `functrain.compiler.recompute` has moved the layer norms' and GELU's outputs into
    the backward: its input, q, k, v, the attention output, the residual after attention and the
    MLP's pre-activation (10 d per token, plus per-token statistics); plus one block's internals
    before the mark is reached or while a block is recomputed, and the head's logits and their
    gradient (2 V per token).
    """
    from functrain.config_checks import parse_policy, recomputed_blocks

    p = gpt.num_params(cfg)
    d, t, v, h = cfg.n_embd, cfg.block_size, cfg.vocab_size, cfg.n_head
    block = _block_numel(cfg)
    stage = max(block, v * d + t * d)
    tokens = local_batch * t
    internals = tokens * (10 * d + h + 4)
    held = sum(tokens * d if again else internals for again in recomputed_blocks(parse_policy(remat), cfg.n_layer))
    mib = 4 / 2**20
    out = {
        "state": 3 * p / n * mib,
        "grads": (p / n + stage) * mib,
        "gathered": 2 * stage * mib,
        "activations": (held + internals + 2 * tokens * v) * mib,
    }
    out["total"] = sum(out.values())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8, help="global batch size")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps per method (compile included)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per method per round")
    ap.add_argument("--eager", action="store_true", help="also time functrain's sharded step uncompiled")
    ap.add_argument(
        "--bucket-numel",
        type=int,
        default=None,
        help="functrain's largest collective bucket in elements (default: one bucket)",
    )
    ap.add_argument(
        "--reorder",
        action="store_true",
        help="inductor option reorder_for_compute_comm_overlap (try with --bucket-numel)",
    )
    ap.add_argument(
        "--remat",
        default="full",
        help="functrain's remat policy: 'full' regathers every block for its backward (reshard "
        "after forward), 'none' keeps blocks gathered until their backward",
    )
    ap.add_argument(
        "--whole",
        action="store_true",
        help="also time the whole-model gather route (functrain-whole, before per-block gathers)",
    )
    ap.add_argument(
        "--compile-unit",
        choices=("step", "blocks"),
        default="step",
        help="functrain's compile unit: one graph per step, or per stage kind with the "
        "update group by group (README 'Compile unit')",
    )
    ap.add_argument(
        "--reduce-scatter",
        default="auto",
        help="functrain's gradient route (parallel.configure's reduce_scatter: " + ", ".join(spmd.ROUTES) + "); a "
        "comma list times each route after the first as functrain-<route>, interleaved in one run",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="print each method's N costliest ops of one step (inductor kernels named)",
    )
    ap.add_argument(
        "--gloo-threads",
        type=int,
        default=1,
        help="worker threads per gloo group (parallel.setup; torch's 2 can corrupt the heap)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument(
        "--warm-cache",
        action="store_true",
        help="let functrain's step load from the user's compile cache (default: compile_cache 'off', a "
        "fresh directory: warm-up s is a cold compile and the gathered params are modelled)",
    )
    args = ap.parse_args()

    # sharded steps' cache keys are stable since compiler.mesh_key: a second run would hit
    compile_cache.setup("user" if args.warm_cache else "off")
    if args.profile:  # inductor's kernels appear in the profile by name
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    routes = args.reduce_scatter.split(",")
    for route in routes:
        if route not in spmd.ROUTES:
            ap.error(f"--reduce-scatter: unknown route {route!r}; use one of {', '.join(spmd.ROUTES)}")
    layout = {"bucket_numel": args.bucket_numel} if args.bucket_numel else None
    ctx = parallel.setup({"dp_replicate": 1, "dp_shard": -1, "tp": 1}, gloo_threads=args.gloo_threads)
    cfg = gpt.GPTConfig(
        vocab_size=args.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=0.0,
        bias=True,
    )
    lr, clip = 3e-4, 1.0
    batches = _batches(cfg, args.warmup + args.rounds * args.steps, args.batch_size, ctx)

    rss0 = _rss_kib("VmRSS")
    options = {"options": {"reorder_for_compute_comm_overlap": True}} if args.reorder else None
    unit = True if args.compile_unit == "step" else "blocks"
    methods = {
        "functrain": Functrain(
            gpt.GPT(cfg, key=rng.key(0)),
            ctx,
            lr,
            clip,
            compile=unit,
            compile_options=options,
            remat=args.remat,
            reduce_scatter=routes[0],
            layout_options=layout,
        )
    }
    for route in routes[1:]:
        methods[f"functrain-{route}"] = Functrain(
            gpt.GPT(cfg, key=rng.key(0)),
            ctx,
            lr,
            clip,
            compile=unit,
            compile_options=options,
            remat=args.remat,
            reduce_scatter=route,
            layout_options=layout,
        )
    if args.whole:
        methods["functrain-whole"] = Functrain(
            gpt.GPT(cfg, key=rng.key(0)),
            ctx,
            lr,
            clip,
            compile=True,
            compile_options=options,
            whole=True,
            reduce_scatter=routes[0],
            layout_options=layout,
        )
    if args.eager:
        methods["functrain-eager"] = Functrain(
            gpt.GPT(cfg, key=rng.key(0)),
            ctx,
            lr,
            clip,
            compile=False,
            remat=args.remat,
            reduce_scatter=routes[0],
            layout_options=layout,
        )
    methods["fsdp2"] = FSDP2(gpt.GPT(cfg, key=rng.key(0)), ctx, lr, clip)
    setup_mib = (_rss_kib("VmRSS") - rss0) / 1024

    gathered = _Gathered()  # the compile happens in the warm-up
    reshard_log = logging.getLogger("functrain.compiler.regather")
    reshard_log.addHandler(gathered)
    reshard_log.setLevel(logging.INFO)
    losses = {k: [] for k in methods}
    warm_s = {}
    for name, m in methods.items():
        t = time.perf_counter()
        for b in batches[: args.warmup]:
            losses[name].append(float(m.step(b)))
        warm_s[name] = time.perf_counter() - t

    times = {k: [] for k in methods}
    peak = {k: 0.0 for k in methods}
    hwm = {k: 0.0 for k in methods}
    can_peak = _reset_peak()
    for r in range(args.rounds):
        chunk = batches[args.warmup + r * args.steps : args.warmup + (r + 1) * args.steps]
        for name, m in methods.items():
            parallel.barrier()
            _reset_peak()
            before = _rss_kib("VmRSS")
            for b in chunk:
                t = time.perf_counter()
                losses[name].append(float(m.step(b)))  # float(): waits for the step
                times[name].append(time.perf_counter() - t)
            peak[name] = max(peak[name], (_rss_kib("VmHWM") - before) / 1024)
            hwm[name] = max(hwm[name], _rss_kib("VmHWM") / 1024)

    live = {}  # one more step per method under the profiler: live tensor bytes, not RSS
    for name, m in methods.items():
        parallel.barrier()
        live[name], table = _live_growth_mib(m, batches[-1], args.profile)
        if table and ctx.is_main_process:
            print(f"{name}: top {args.profile} ops of one step by self CPU time (rank 0, profiler on)\n{table}")

    # the slowest rank sets the pace: take each step time's max over ranks
    med = {}
    for name, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        med[name] = statistics.median(t.tolist())
    for name in losses:  # fsdp2 losses are per-rank (local batch): average them for the report
        t = torch.tensor(losses[name], dtype=torch.float64)
        dist.all_reduce(t)
        losses[name] = (t / ctx.world_size).tolist()
    # training memory per rank: its params + optimizer state + the step's peak growth; max over ranks
    train_mib = {}
    for name, m in methods.items():
        t = torch.tensor(
            [m.state_bytes() / 2**20 + peak[name], peak[name], hwm[name], m.state_bytes() / 2**20 + live[name]],
            dtype=torch.float64,
        )
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        train_mib[name] = t.tolist()
    expected = _expected_mib(cfg, args.batch_size // ctx.dp_world, ctx.dp_world, args.remat)
    if ctx.is_main_process:
        print(
            f"GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd} n_head={cfg.n_head} block={cfg.block_size} "
            f"vocab={cfg.vocab_size} params={gpt.num_params(cfg) / 1e6:.2f}M, global batch {args.batch_size}, "
            f"{ctx.world_size} ranks FSDP (dp_shard={ctx.dp_world}), torch {torch.__version__}, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, functrain remat={args.remat}"
        )
        print(
            f"state set-up RSS (all methods, rank 0): {setup_mib:.0f} MiB; "
            f"process RSS before any: {rss0 / 1024:.0f} MiB"
        )
        print(
            f"{'method':<16} {'warm-up s':>10} {'median s/step':>14} {'steps/s':>9} {'peak growth MiB':>16} "
            f"{'train peak MiB':>15} {'live peak MiB':>14} {'process HWM MiB':>16}  losses first/last"
        )
        for name in methods:
            total, growth, high, live_total = train_mib[name]
            pk = f"{growth:.1f}" if can_peak else "n/a"
            print(
                f"{name:<16} {warm_s[name]:>10.1f} {med[name]:>14.4f} {1 / med[name]:>9.2f} {pk:>16} "
                f"{total:>15.1f} {live_total:>14.1f} {high:>16.0f}  {losses[name][0]:.4f} / {losses[name][-1]:.4f}"
            )
        print(
            "(train peak = this rank's params + optimizer state + the step's peak RSS growth, max over ranks; "
            "live peak = the same with the step's peak of live tensor bytes (profiler) instead of RSS, "
            "which glibc's retained heap inflates; process HWM includes every method's state, all live in one "
            "process)"
        )
        print(
            "expected functrain train peak from first principles: "
            + ", ".join(f"{k} {v:.1f}" for k, v in expected.items())
            + " MiB"
        )
        block_mib = _block_numel(cfg) * 4 / 2**20
        if gathered.models:  # the step's graph: the one with the most all-gathers
            model, added = max(gathered.models, key=lambda g: g[0]["gathers"])
            alive_blocks = model["peak_bytes"] / 2**20 / block_mib
            print(
                f"gathered params alive at most (model of the compiled graph's buffers, rank 0): "
                f"{model['peak_bytes'] / 2**20:.1f} MiB = {alive_blocks:.2f} blocks' params "
                f"({model['alive_at_peak']} of {model['gathers']} all-gathers; {added} added by the reshard pass)"
            )
        else:
            alive_blocks = None
            print(
                "gathered params alive: not modelled (no graph compiled in this process: inductor's cache "
                "served it under --warm-cache, or the step is eager)"
            )
        speed = med["fsdp2"] / med["functrain"]
        peak_ratio = train_mib["functrain"][0] / train_mib["fsdp2"][0]
        print(
            f"steps/s ratio functrain / fsdp2: {speed:.3f}; train peak ratio functrain / fsdp2: {peak_ratio:.3f} "
            f"(RSS), {train_mib['functrain'][3] / train_mib['fsdp2'][3]:.3f} (live tensor bytes)"
        )
        for other in methods:
            if other not in ("functrain", "fsdp2"):
                print(
                    f"steps/s ratio {other} / fsdp2: {med['fsdp2'] / med[other]:.3f}; train peak ratio "
                    f"{other} / fsdp2: {train_mib[other][0] / train_mib['fsdp2'][0]:.3f}"
                )
        if args.json:
            import json

            print(
                json.dumps(
                    {
                        "speed_ratio": round(speed, 4),
                        "peak_ratio": round(peak_ratio, 4),
                        "growth_ratio": round(train_mib["functrain"][1] / max(train_mib["fsdp2"][1], 1e-9), 4),
                        "live_peak_ratio": round(train_mib["functrain"][3] / train_mib["fsdp2"][3], 4),
                        "functrain_live_peak_mib": train_mib["functrain"][3],
                        "fsdp2_live_peak_mib": train_mib["fsdp2"][3],
                        "gathered_blocks_alive": None if alive_blocks is None else round(alive_blocks, 3),
                        "functrain_s_per_step": med["functrain"],
                        "fsdp2_s_per_step": med["fsdp2"],
                        "functrain_train_peak_mib": train_mib["functrain"][0],
                        "fsdp2_train_peak_mib": train_mib["fsdp2"][0],
                        "expected_train_peak_mib": expected["total"],
                        "warmup_s": warm_s["functrain"],
                        "n_layer": cfg.n_layer,
                        "n_embd": cfg.n_embd,
                        "ranks": ctx.world_size,
                        "remat": args.remat,
                        "reduce_scatter": args.reduce_scatter,
                        "gloo_threads": args.gloo_threads,
                        "routes": {
                            r: {
                                "speed_ratio": round(med["fsdp2"] / med[f"functrain-{r}"], 4),
                                "live_peak_mib": train_mib[f"functrain-{r}"][3],
                            }
                            for r in routes[1:]
                        },
                    }
                )
            )
    parallel.teardown()


if __name__ == "__main__":
    main()
