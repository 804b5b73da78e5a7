"""Benchmark: functrain's compiled functional step vs the eager nn.Module + torch.optim loop.

    python bench/step.py [--sizes tiny,100m] [--steps N] [--rounds R] [--threads T] [--no-memory]
    python bench/step.py --sizes default,gpt2 --precision bf16 --json      # on a GPU

Sizes: `tiny` and `100m` below, or `default` and `gpt2`, read from configs/gpt.py (its default run
and its `gpt2` variant; a step here is one micro-batch: 12 x 1024 tokens for gpt2). `--precision
bf16`: functrain's `precision="bf16"` (bf16 compute on cast params, fp32 masters and moments)
against the eager loop under `torch.autocast(bf16)`. MFU = tokens/s x `gpt.flops_per_token` over
the large-matmul rate measured in the same process in that dtype, and over the published bf16
dense peak where the device is known (`functrain.trainer.metrics.peak_flops`).

Measured: docs/results.md ("bench/step.py").

For each GPT size it compares, on the same model, data and hyper-parameters:
  functrain  `make_train_step(loss_fn, chain(clip_by_global_norm, adamw(warmup_cosine)), donate=True)`,
             compiled with torch.compile (fullgraph, one graph)
  functrain_eager  the same step with `compile=False` and `adamw(..., fused=True)` (gradients by plain
             autograd, the update through torch's fused AdamW kernel in place): research code that
             composes steps eagerly (`--no-eager` skips it); printed as its step time over torch's
  functrain_graphs  the compiled step replayed as CUDA graphs (`--config.cuda_graphs`; on CUDA by
             default, `--cuda-graphs` elsewhere, where inductor records nothing and it runs as compiled)
  torch      eager `nn.Module` forward/backward + `clip_grad_norm_` + `torch.optim.AdamW(fused=True)`
             (foreach=True where fused is not supported on the device: the output says so) + LambdaLR

Speed: both variants live in one process; after each one's first step (compile for functrain,
warm-up for torch) and a warm-up step, the timed steps alternate between them in `--rounds` blocks
of `--steps / --rounds` steps, so load from other jobs on the machine hits both alike. Reported:
steps/s of each (from the median time per step over the rounds), the speed ratio (the median over
rounds of each round's own torch / functrain time: steadier than a ratio of totals on a shared
machine), and the first-step time.

Breakdown (`--no-breakdown` skips it): where a step's time goes, functrain next to torch, timed in
the same alternating rounds. functrain's halves are compiled on their own from the same code the
step runs (`value_and_grad` of the loss: forward + backward; `step.update_step`: clipping, AdamW,
the skip guard, the update norm, donation); torch's are its forward + backward and its clipping +
fused AdamW + schedule. "everything else" is the whole step minus the two parts (negative when
compiling the step whole fuses across the cut).

Memory ("peak growth per step"): how far memory rises above the resident training state during a
steady-state step (activations, gradients, temporaries). Each variant runs in its own child process:
build, warm up, then release what the warm-up left behind (gc, `malloc_trim`) and take the
baseline; then run the measured steps and report peak - baseline (and the absolute peak, `peak_mb`).
  CPU:  peak = the process's RSS high-water mark (VmHWM), reset to the current RSS at the baseline
        by writing 5 to /proc/self/clear_refs (Linux >= 4.0). Without that reset the high-water mark
        would include compilation and warm-up; the output says if it could not be reset.
  CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus memory_allocated.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from functrain import init_state, make_train_step, optim, rng, value_and_grad
from functrain import step as step_lib
from functrain.compiler import cuda_graphs
from functrain.models import gpt
from functrain.models.gpt import make_loss_fn
from functrain.step import precision as precision_lib
from functrain.trainer import memory, metrics

SIZES = {
    # The `tiny` variant of configs/gpt.py.
    "tiny": dict(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64, batch=16),
    # GPT-2-small widths (12 x 768) with a short context and small batch so it runs on a CPU;
    # the 16k vocabulary brings it to ~98M parameters.
    "100m": dict(vocab_size=16384, block_size=64, n_layer=12, n_head=12, n_embd=768, batch=4),
}
CONFIG_SIZES = ("default", "gpt2")  # read from configs/gpt.py: its default run and its `gpt2` variant


def _config_size(variant: str) -> dict:
    """The model and micro-batch of a configs/gpt.py variant (a step here is one micro-batch)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "gpt.py")
    spec = importlib.util.spec_from_file_location("_gpt_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config(variant)
    m = c.model
    return dict(
        vocab_size=m.vocab_size or 256,  # 0 = the data's: bytes for the default run
        block_size=m.block_size,
        n_layer=m.n_layer,
        n_head=m.n_head,
        n_embd=m.n_embd,
        batch=c.batch_size // c.accum_steps,
    )


LR, WARMUP, DECAY, MIN_LR, WD, BETAS, CLIP = 3e-4, 10, 10_000, 3e-5, 0.1, (0.9, 0.95), 1.0
N_BATCHES = 4  # a small pool of batches, cycled (data loading is not what is measured)
PRECISION = "fp32"  # --precision: functrain's `precision=`; torch autocasts its forward to the same dtype


def _cfg(size: str) -> tuple[gpt.GPTConfig, int]:
    s = dict(SIZES[size]) if size in SIZES else _config_size(size)
    batch = s.pop("batch")
    return gpt.GPTConfig(dropout=0.0, bias=False, **s), batch


def _batches(cfg, batch, device):
    g = torch.Generator().manual_seed(0)
    shape = (batch, cfg.block_size)
    out = []
    for _ in range(N_BATCHES):
        xy = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
        out.append((xy[:, :-1].contiguous().to(device), xy[:, 1:].contiguous().to(device)))
    assert out[0][0].shape == shape
    return out


def _schedule():
    return optim.warmup_cosine(LR, WARMUP, DECAY, end_value=MIN_LR)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Functrain:
    """The compiled functional step, donating its state."""

    name = "functrain"

    def __init__(self, cfg, device):
        with torch.device("meta"):
            template = gpt.GPT(cfg)
        opt = optim.chain(optim.clip_by_global_norm(CLIP), optim.adamw(_schedule(), *BETAS, 1e-8, WD))
        params = gpt.init_params(template, rng.key(0), device=device)
        self.state = init_state(params, opt, seed=0, copy=False)
        self.loss_fn, self.opt = make_loss_fn(template), opt
        self.step_fn = make_train_step(self.loss_fn, opt, donate=True, precision=PRECISION)
        self.note = f"compiled, donate=True, precision {PRECISION} (fp32 master params and moments)"

    def step(self, batch):
        self.state, m = self.step_fn(self.state, batch)
        return m["loss"]

    def parts(self):
        """(forward + backward, update): the step's two halves, compiled on their own."""
        loss_fn, prec = self.loss_fn, precision_lib.get(PRECISION)

        def vg_fn(p, b):
            loss, aux, grads = value_and_grad(loss_fn, *precision_lib.to_compute(prec, p, b), None)
            return loss.float(), aux, precision_lib.cast_floating(grads, torch.float32)

        vg = torch.compile(vg_fn, fullgraph=True, dynamic=False)
        update = step_lib.update_step(self.opt)
        cache = {}

        def fwdbwd(batch):
            loss, _, cache["grads"] = vg(self.state.params, batch)
            cache["loss"] = loss
            return loss

        def opt_update(batch):
            self.state, m = update(self.state, cache["grads"], {"loss": cache["loss"]})
            return m["update_norm"]

        return fwdbwd, opt_update

    def release(self):
        pass


class FunctrainEager(Functrain):
    """The same functional step run eagerly (`compile=False`), as research code composing steps runs it:
    gradients by plain autograd, the update through torch's fused AdamW kernel (`adamw(fused=True)`)."""

    name = "functrain_eager"

    def __init__(self, cfg, device):
        with torch.device("meta"):
            template = gpt.GPT(cfg)
        opt = optim.chain(optim.clip_by_global_norm(CLIP), optim.adamw(_schedule(), *BETAS, 1e-8, WD, fused=True))
        params = gpt.init_params(template, rng.key(0), device=device)
        self.state = init_state(params, opt, seed=0, copy=False)
        self.loss_fn, self.opt = make_loss_fn(template), opt
        self.step_fn = make_train_step(self.loss_fn, opt, compile=False, donate=True, precision=PRECISION)
        self.note = f"eager, donate=True, adamw(fused=True), precision {PRECISION}"

    def parts(self):
        """(forward + backward, update): the eager step's two halves."""
        loss_fn, prec = self.loss_fn, precision_lib.get(PRECISION)
        update = step_lib.update_step(self.opt, compile=False)
        cache = {}

        def fwdbwd(batch):
            loss, _, grads = value_and_grad(loss_fn, *precision_lib.to_compute(prec, self.state.params, batch), None)
            cache["grads"] = precision_lib.cast_floating(grads, torch.float32)
            cache["loss"] = loss = loss.float()
            return loss

        def opt_update(batch):
            self.state, m = update(self.state, cache["grads"], {"loss": cache["loss"]})
            return m["grad_norm"]

        return fwdbwd, opt_update


class TorchLoop:
    """The eager nn.Module loop with torch.optim.AdamW (fused where supported)."""

    name = "torch"

    def __init__(self, cfg, device):
        self.model = gpt.GPT(cfg, key=rng.key(0)).to(device)  # same init as functrain's
        params = list(self.model.parameters())
        kind = "fused"
        try:
            self.opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=1e-8, weight_decay=WD, fused=True)
            self._probe()
        except (RuntimeError, ValueError, TypeError) as exc:
            kind = f"foreach (fused not supported on {device.type}: {str(exc).splitlines()[0][:80]})"
            self.opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=1e-8, weight_decay=WD, foreach=True)
        sched = _schedule()
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda k: float(sched(torch.tensor(k))) / LR)
        dtype = precision_lib.get(PRECISION).compute_dtype
        self.autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
        self.note = f"eager, AdamW {kind}" + (f", autocast {dtype}" if dtype != torch.float32 else "")

    def _probe(self):
        """One zero-gradient fused step on throw-away copies, to see if the device supports it."""
        p = torch.nn.Parameter(torch.zeros(4, device=next(self.model.parameters()).device))
        p.grad = torch.zeros_like(p)
        torch.optim.AdamW([p], lr=LR, fused=True).step()

    def step(self, batch):
        loss = self._fwdbwd(batch)
        self._update(batch)
        return loss.detach()

    def _fwdbwd(self, batch):
        x, y = batch
        self.opt.zero_grad(set_to_none=True)
        with self.autocast:
            loss = gpt.cross_entropy(self.model(x), y)
        loss.backward()
        return loss.detach()

    def _update(self, batch):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.sched.step()
        return next(iter(self.model.parameters()))

    def parts(self):
        """(forward + backward, update) of the eager loop."""
        return self._fwdbwd, self._update

    def release(self):
        self.opt.zero_grad(set_to_none=True)  # grads are not part of the resident state


class FunctrainGraphs(Functrain):
    """The compiled step replayed as CUDA graphs (`--config.cuda_graphs`: inductor's cudagraph trees,
    the state's buffers static inputs, a step boundary marked before each step)."""

    name = "functrain_graphs"

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        self.step_fn = make_train_step(
            self.loss_fn, self.opt, donate=True, precision=PRECISION, compile_options=cuda_graphs.options()
        )
        self.state = cuda_graphs.prepare(self.state)
        self.note = f"compiled as CUDA graphs (reduce-overhead), donate=True, precision {PRECISION}"

    def step(self, batch):
        cuda_graphs.step_begin()
        return super().step(batch)


VARIANTS = {"functrain": Functrain, "torch": TorchLoop}


# ------------------------------------------------------------------------------------------------
# Speed: both variants in this process, interleaved.


def _kinds(eager, graphs=False):
    """The variants timed side by side."""
    return (Functrain, *([FunctrainGraphs] if graphs else []), *([FunctrainEager] if eager else []), TorchLoop)


def speed(size, steps, rounds, device, eager=True, graphs=False):
    cfg, batch = _cfg(size)
    data = _batches(cfg, batch, device)
    runners, first, first_loss = [], {}, {}
    for cls in _kinds(eager, graphs):
        r = cls(cfg, device)
        _sync(device)
        t = time.perf_counter()
        loss = r.step(data[0])
        first_loss[r.name] = float(loss)
        first[r.name] = time.perf_counter() - t
        r.step(data[1])  # warm-up
        _sync(device)
        runners.append(r)
    per_round_s = {r.name: [] for r in runners}  # seconds per step, one entry per round
    per_round = max(1, steps // rounds)
    k = 2
    for i in range(rounds):
        order = runners if i % 2 == 0 else runners[::-1]  # alternate who goes first
        for r in order:
            _sync(device)
            t = time.perf_counter()
            for _ in range(per_round):
                loss = r.step(data[k % N_BATCHES])
            float(loss)
            _sync(device)
            per_round_s[r.name].append((time.perf_counter() - t) / per_round)
        k += per_round
    f, t = per_round_s["functrain"], per_round_s["torch"]
    extra = {}
    if eager:  # the eager step's time over the eager torch loop's, per round (> 1: slower than torch)
        extra["eager_time_ratio"] = statistics.median(e / b for e, b in zip(per_round_s["functrain_eager"], t))
    if graphs:  # the torch loop's time over the CUDA-graph step's, per round (> 1: faster than torch)
        extra["graphs_ratio"] = statistics.median(b / g for g, b in zip(per_round_s["functrain_graphs"], t))
    return {
        **extra,
        "params": gpt.num_params(cfg),
        "notes": {r.name: r.note for r in runners},
        "first_s": first,
        "first_loss": first_loss,
        "steps_per_s": {n: 1.0 / statistics.median(v) for n, v in per_round_s.items()},
        # The speed ratio from each round's own pair (steadier than a ratio of totals under load).
        "ratio": statistics.median(b / a for a, b in zip(f, t)),
        "timed_steps": {n: per_round * rounds for n in per_round_s},
    }


def breakdown(size, rounds, device, eager=True):
    """Median ms of each part and of the whole step, per variant, in alternating rounds."""
    cfg, batch = _cfg(size)
    data = _batches(cfg, batch, device)
    out = {}
    runners = [cls(cfg, device) for cls in _kinds(eager)]
    plan = []
    for r in runners:
        fwdbwd, update = r.parts()
        for f in (fwdbwd, update, fwdbwd, update):  # compile / warm up both halves
            f(data[0])
        plan += [(r.name, "step", r.step), (r.name, "fwdbwd", fwdbwd), (r.name, "update", update)]
        r.step(data[0])
    times = {(n, k): [] for n, k, _ in plan}
    fns = {(n, k): f for n, k, f in plan}
    for i in range(rounds):
        for n, k, f in plan if i % 2 == 0 else plan[::-1]:
            if k == "update":  # an update needs this variant's fresh gradients first
                fns[(n, "fwdbwd")](data[i % N_BATCHES])
            _sync(device)
            t = time.perf_counter()
            v = f(data[i % N_BATCHES])
            float(v.detach().float().sum())
            _sync(device)
            times[(n, k)].append(1e3 * (time.perf_counter() - t))
    for (n, k), v in times.items():
        out.setdefault(n, {})[k] = statistics.median(v)
    for n in out:
        out[n]["other"] = out[n]["step"] - out[n]["fwdbwd"] - out[n]["update"]
    return out


# ------------------------------------------------------------------------------------------------
# Memory: one child process per variant.


def _rss_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _trim():
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap pages back, so RSS = live memory
    except (OSError, AttributeError):
        pass


def memory_child(variant, size, steps, device):
    """Runs in a child process; prints one JSON line."""
    cfg, batch = _cfg(size)
    data = _batches(cfg, batch, device)
    r = VARIANTS[variant](cfg, device)
    for i in range(2):  # compile / warm-up
        float(r.step(data[i]))
    r.release()
    _trim()
    _sync(device)
    out = {"variant": variant}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        for i in range(steps):
            float(r.step(data[i % N_BATCHES]))
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        out.update(
            method="cuda max_memory_allocated",
            base_mb=base / 2**20,
            growth_mb=(peak - base) / 2**20,
            peak_mb=peak / 2**20,
        )
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            method = "RSS high-water mark (VmHWM) reset at baseline"
        except OSError:
            method = "RSS high-water mark NOT reset: includes compile and warm-up"
        base = _rss_kb("VmRSS")
        for i in range(steps):
            float(r.step(data[i % N_BATCHES]))
        peak = _rss_kb("VmHWM")
        out.update(method=method, base_mb=base / 1024, growth_mb=(peak - base) / 1024, peak_mb=peak / 1024)
    print(json.dumps(out), flush=True)


def measure_memory(size, steps, device, threads=0, host_memory="keep"):
    res = {}
    for variant in VARIANTS:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--_memory-child",
            variant,
            "--sizes",
            size,
            "--steps",
            str(steps),
            "--device",
            str(device),
            "--threads",
            str(threads),
            "--host-memory",
            host_memory,
            "--precision",
            PRECISION,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"memory child {variant}/{size} failed:\n{proc.stderr[-3000:]}")
        res[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    return res


# ------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sizes",
        default="tiny,100m",
        help=f"comma-separated, from {sorted(SIZES)} or configs/gpt.py's {list(CONFIG_SIZES)}",
    )
    ap.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "bf16"),
        help="bf16: functrain's precision='bf16' (fp32 masters) vs torch's autocast to bf16",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant and size")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved blocks the timed steps are split in")
    ap.add_argument("--mem-steps", type=int, default=3, help="steady-state steps in each memory child")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory children")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the per-part breakdown")
    ap.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time the step replayed as CUDA graphs (functrain_graphs; default: on CUDA)",
    )
    ap.add_argument("--no-eager", action="store_true", help="skip the eager functrain column (functrain_eager)")
    ap.add_argument("--breakdown-rounds", type=int, default=6, help="alternating rounds of the breakdown")
    ap.add_argument("--_memory-child", dest="memory_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--host-memory",
        default="keep",
        choices=("keep", "default"),
        help="keep: freed memory stays in the process for both variants (functrain.trainer.memory), as "
        "the main program does; default: glibc's policy",
    )
    args = ap.parse_args()
    global PRECISION
    PRECISION = args.precision
    if args.host_memory == "keep":
        memory.keep_freed_memory()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for s in sizes:
        if s not in SIZES and s not in CONFIG_SIZES:
            ap.error(f"unknown size {s!r}; choose from {sorted(SIZES)} or {list(CONFIG_SIZES)}")
    if args.memory_child:
        memory_child(args.memory_child, sizes[0], args.steps, device)
        return

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    dtype = precision_lib.get(PRECISION).compute_dtype
    published = metrics.peak_flops(device)  # bf16 dense, from the vendor's data sheet (None on a CPU)
    matmul = metrics.measure_peak_flops(device, dtype)  # this process's large-matmul rate, in `dtype`
    print(
        f"torch {torch.__version__}, device {device} ({dev_name}), {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs; precision {PRECISION}; {args.steps} timed steps per variant in {args.rounds} "
        f"interleaved rounds; host memory {args.host_memory} (both variants)"
    )
    print(
        f"peak FLOP/s: measured {dtype} matmul {matmul / 1e12:.1f} TFLOP/s; published bf16 dense "
        + (f"{published / 1e12:.0f} TFLOP/s" if published else "unknown (CPU)"),
        flush=True,
    )
    rows = []
    for size in sizes:
        cfg, batch = _cfg(size)
        print(
            f"\n[{size}] GPT {gpt.num_params(cfg) / 1e6:.2f}M params (n_layer {cfg.n_layer}, "
            f"n_embd {cfg.n_embd}, vocab {cfg.vocab_size}, block {cfg.block_size}), batch {batch}",
            flush=True,
        )
        eager = not args.no_eager
        graphs = device.type == "cuda" if args.cuda_graphs is None else args.cuda_graphs
        sp = speed(size, args.steps, args.rounds, device, eager, graphs)
        for name, note in sp["notes"].items():
            print(f"  {name:15s} {note}; first-step loss {sp['first_loss'][name]:.6f}")
        mem = None if args.no_memory else measure_memory(size, args.mem_steps, device, args.threads, args.host_memory)
        if mem:
            print(
                f"  memory: {mem['functrain']['method']}; resident state "
                f"functrain {mem['functrain']['base_mb']:.0f} MB, torch {mem['torch']['base_mb']:.0f} MB; "
                f"peak functrain {mem['functrain']['peak_mb']:.0f} MB, torch {mem['torch']['peak_mb']:.0f} MB"
            )
        if not args.no_breakdown:
            bd = breakdown(size, args.breakdown_rounds, device, eager)
            f, t = bd["functrain"], bd["torch"]
            e = bd.get("functrain_eager")
            print(
                f"\n  [{size}] where a step's time goes (median ms over {args.breakdown_rounds} rounds)\n"
                "  | part | functrain ms | torch ms | time functrain / torch |"
                + (" functrain eager ms | time eager / torch |" if e else "")
                + "\n  |---|---|---|---|"
                + ("---|---|" if e else "")
            )
            for k, label in (
                ("fwdbwd", "forward + backward"),
                ("update", "optimizer update (clip, AdamW, ...)"),
                ("other", "everything else"),
                ("step", "whole step"),
            ):
                ratio = f"{f[k] / t[k]:.2f}x" if k != "other" and t[k] > 0 else "-"
                row = f"  | {label} | {f[k]:.1f} | {t[k]:.1f} | {ratio} |"
                if e:
                    row += f" {e[k]:.1f} | " + (f"{e[k] / t[k]:.2f}x |" if k != "other" and t[k] > 0 else "- |")
                print(row, flush=True)
            sp["breakdown_ms"] = bd
        tokens = batch * cfg.block_size
        fpt = gpt.flops_per_token(cfg)
        sp["tokens_per_s"] = {n: v * tokens for n, v in sp["steps_per_s"].items()}
        sp["mfu_matmul"] = {n: v * fpt / matmul for n, v in sp["tokens_per_s"].items()}
        if published:
            sp["mfu_published"] = {n: v * fpt / published for n, v in sp["tokens_per_s"].items()}
        rows.append((size, sp, mem))
        print(
            f"  [{size}] steps/s functrain {sp['steps_per_s']['functrain']:.3f} torch {sp['steps_per_s']['torch']:.3f} "
            f"(ratio {sp['ratio']:.2f}x); tokens/s {sp['tokens_per_s']['functrain']:,.0f} vs "
            f"{sp['tokens_per_s']['torch']:,.0f}; MFU of the measured matmul {sp['mfu_matmul']['functrain']:.1%} vs "
            f"{sp['mfu_matmul']['torch']:.1%}",
            flush=True,
        )
        if graphs:
            print(
                f"  [{size}] CUDA graphs: functrain_graphs {sp['steps_per_s']['functrain_graphs']:.3f} steps/s, "
                f"{sp['tokens_per_s']['functrain_graphs']:,.0f} tokens/s, MFU of the measured matmul "
                f"{sp['mfu_matmul']['functrain_graphs']:.1%}; the torch loop's time / its time: "
                f"{sp['graphs_ratio']:.2f}x",
                flush=True,
            )
        if eager:
            print(
                f"  [{size}] eager: functrain_eager {sp['steps_per_s']['functrain_eager']:.3f} steps/s; its step "
                f"time / the torch loop's: {sp['eager_time_ratio']:.2f}x",
                flush=True,
            )

    print(
        "\n| size | params | functrain steps/s | torch steps/s | ratio (functrain/torch) | "
        "first step functrain (compile) | first step torch | peak growth/step functrain | peak growth/step torch |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for size, sp, mem in rows:
        f, t = sp["steps_per_s"]["functrain"], sp["steps_per_s"]["torch"]
        mf = f"{mem['functrain']['growth_mb']:+.0f} MB" if mem else "-"
        mt = f"{mem['torch']['growth_mb']:+.0f} MB" if mem else "-"
        print(
            f"| {size} | {sp['params'] / 1e6:.2f}M | {f:.3f} | {t:.3f} | {sp['ratio']:.2f}x | "
            f"{sp['first_s']['functrain']:.1f} s | {sp['first_s']['torch']:.2f} s | {mf} | {mt} |"
        )
    print(
        f"\n| size | tokens/s functrain | tokens/s torch | MFU functrain | MFU torch | "
        f"(MFU against the measured {dtype} matmul; in brackets against the published bf16 peak) |\n"
        "|---|---|---|---|---|---|"
    )
    for size, sp, _ in rows:
        pub = sp.get("mfu_published")
        cell = {n: f"{sp['mfu_matmul'][n]:.1%}" + (f" ({pub[n]:.1%})" if pub else "") for n in sp["mfu_matmul"]}
        print(
            f"| {size} | {sp['tokens_per_s']['functrain']:,.0f} | {sp['tokens_per_s']['torch']:,.0f} | "
            f"{cell['functrain']} | {cell['torch']} | |"
        )
    if args.json:
        print(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "device": dev_name,
                    "precision": PRECISION,
                    "matmul_flops": matmul,
                    "published_flops": published,
                    "sizes": {size: dict(sp, memory=mem) for size, sp, mem in rows},
                }
            )
        )


if __name__ == "__main__":
    main()
