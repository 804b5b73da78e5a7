"""One rank of the pipeline-parallel scenarios (launched by tests/test_pipeline.py).

Usage: python tests/_pipeline_worker.py <outdir> <suite> [scenario ...]   suites: pp2 (2 ranks), pp4 (4 ranks)

Every scenario trains the tiny GPT (tied embedding and head: the tied weight lives on the first and
the last rank) or the tiny Llama (untied) with the families' staged loss cut over the pipeline ranks,
and the same model on one process (in this same process) with `accum_steps` = the microbatches, on
the same batches; it reports the largest differences of losses, gradient norms, this rank's params
and its optimizer state. Results (or tracebacks) go to <outdir>/<suite>_rank<r>.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback

import optree
import torch
import torch.distributed as dist
from _dist_parallel_worker import STEPS, max_diff, run, sgd
from torch.profiler import ProfilerActivity, profile

from functrain import checkpoint as ckpt
from functrain import init_state, make_eval_step, make_train_step, parallel, rng
from functrain.models import gpt, llama
from functrain.parallel import pipeline
from functrain.parallel import pipeline_schedule as schedules

SEQ, BATCH, VOCAB = 16, 8, 64
COLLECTIVE_TIMEOUT_S = 300


def family(name: str, layers: int, with_rules: bool = False):
    """(template, params, make_loss_fn[, TP rules]) of the tiny model `name` ("gpt" or "llama") with `layers` blocks."""
    if name == "gpt":
        cfg = gpt.GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=layers, n_head=4, n_embd=32, bias=False)
        template = gpt.GPT(cfg, key=rng.key(0))
        out = template, dict(template.named_parameters()), gpt.make_loss_fn, gpt.TP_RULES
    else:
        cfg = llama.LlamaConfig(
            vocab_size=VOCAB, block_size=SEQ, n_layer=layers, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64
        )
        with torch.device("meta"):
            template = llama.Llama(cfg)
        out = template, llama.init_params(template, rng.key(0)), llama.make_loss_fn, llama.TP_RULES
    return out if with_rules else out[:3]


def batches(n: int, poison_at: int | None = None):
    """`n` batches (x, y) of random ids; `poison_at`: that batch's first target is -7 (a NaN loss)."""
    g = torch.Generator().manual_seed(0)
    out = [
        (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
        for _ in range(n)
    ]
    if poison_at is not None:
        out[poison_at][1][0, 0] = -7
    return out


def poisoned(make_loss):
    """`make_loss` whose head returns NaN when a target is -7."""

    def make(template, **kw):
        staged = make_loss(template, **kw)
        head = staged.head

        def head_fn(p, h, batch, key):
            x, y = batch
            loss = head.fn(p, h, (x, y.clamp(min=0)), key)
            loss = loss[0] if isinstance(loss, tuple) else loss
            return loss * torch.where((y == -7).any(), float("nan"), 1.0)

        from functrain.step.staged import Stage, staged_loss

        return staged_loss(staged.embed, staged.blocks, Stage(head.names, head_fn), policy=staged.policy)

    return make


def mine(tree, names):
    """The leaves of `tree` (params or optimizer state) that belong to `names` (or to no param)."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    every = set(ALL_NAMES)
    keep = [x for path, x in zip(paths, leaves) if not (set(map(str, path)) & every) or set(map(str, path)) & names]
    return keep


ALL_NAMES: list = []


def differences(ref, ref_hist, state, hist, pipe) -> dict:
    """This rank's pipelined run (`state`: plain tensors, `hist`) vs the one-process run (`ref`, `ref_hist`):
    the largest differences of metrics, this rank's params and optimizer state, and what ran where."""
    names = set(pipe.names)
    finite = [(a, b) for a, b in zip(ref_hist, hist) if a["loss"] == a["loss"]]  # (a poisoned step's NaN)
    return {
        "loss": max(abs(a["loss"] - b["loss"]) for a, b in finite),
        "loss_scale": max(abs(a["loss"]) for a, _ in finite),
        "grad_norm": max(
            abs(a["grad_norm"] - b["grad_norm"]) / abs(a["grad_norm"])
            for a, b in zip(ref_hist, hist)
            if a["grad_norm"] == a["grad_norm"]
        ),
        "params": max_diff(state.params, pipe.params(ref.params)),
        "opt_state": opt_diff(state, ref, names),
        "opt_leaves": [len(mine(state.opt_state, names)), len(mine(ref.opt_state, names))],
        "step": int(state.step),
        "skipped": [h.get("skipped") for h in hist],
        "ref_skipped": [h.get("skipped") for h in ref_hist],
        "metric_keys_equal": sorted(ref_hist[0]) == sorted(hist[0]),
        "lr": [h.get("lr") for h in hist][:3],
        "ref_lr": [h.get("lr") for h in ref_hist][:3],
        "names": sorted(names),
        "blocks": list(pipe.blocks),
    }


def opt_diff(state, ref, names, empty: float = 0.0) -> float:
    """Largest difference of the optimizer state of `names` (and of no param) between two states (`empty`
    when there is none)."""
    return max(
        (
            (x.double() - y.double()).abs().max().item()
            for x, y in zip(mine(state.opt_state, names), mine(ref.opt_state, names))
            if x.numel()
        ),
        default=empty,
    )


@contextlib.contextmanager
def counting_receives():
    """Counts point-to-point receives into the last [blocking, posted ahead] pair of the list it yields."""
    receives, recv, irecv = [], dist.recv, dist.irecv

    def counting(fn, k):
        def wrapped(*args, **kwargs):
            receives[-1][k] += 1
            return fn(*args, **kwargs)

        return wrapped

    dist.recv, dist.irecv = counting(recv, 0), counting(irecv, 1)
    try:
        yield receives
    finally:
        dist.recv, dist.irecv = recv, irecv


def compare(
    ctx_rank,
    world,
    name="gpt",
    *,
    micro=4,
    sched="1f1b",
    layers=2,
    remat="none",
    steps=STEPS,
    precision=None,
    compile=False,
    poison_at=None,
):
    """The pipeline run vs one process with accum_steps=micro: max differences of metrics, params, opt state."""
    template, params, make_loss = family(name, layers)
    if poison_at is not None:
        make_loss = poisoned(make_loss)
    ALL_NAMES[:] = list(params)
    data = batches(steps, poison_at)
    opt = sgd()
    ref_loss = make_loss(template, remat=remat, staged=True)
    ref, ref_hist = run(
        make_train_step(ref_loss, opt, accum_steps=micro, compile=False, precision=precision),
        init_state(params, opt),
        data,
    )
    pipe = pipeline.place(make_loss(template, remat=remat, staged=True), params)
    counters = None
    options = None
    if compile:
        import torch._dynamo
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        options = {"backend": "aot_eager"}
    step = pipeline.make_pipeline_step(
        pipe, opt, microbatches=micro, schedule=sched, precision=precision, compile=compile, compile_options=options
    )
    state = init_state(pipe.params(params), opt)
    hist = []
    try:
        with counting_receives() as receives:
            for i, b in enumerate(data):
                if compile:
                    torch._dynamo.config.error_on_recompile = i > 0
                receives.append([0, 0])
                if i == 0:  # the first step's actions, in the order they ran (the step's profiler ranges)
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        state, m = step(state, b)
                else:
                    state, m = step(state, b)
                hist.append({k: float(v) for k, v in m.items()})
    finally:
        if compile:
            torch._dynamo.config.error_on_recompile = False
    seen = actions_run(prof)
    live = peak = 0
    for kind in seen:
        live += {"F": 1, "B": -1}[kind[0]]
        peak = max(peak, live)
    out = differences(ref, ref_hist, state, hist, pipe)
    out.update(
        held=peak,
        expected_held=schedules.held(schedules.schedule(sched, world, micro, ctx_rank)),
        order=seen,
        receives=receives,
        expected_receives=micro * ((not pipe.first) + (not pipe.last)),
    )
    if counters is not None:
        out["unique_graphs"] = counters["stats"]["unique_graphs"]
    return out


def actions_run(prof) -> list:
    """The pipeline actions a profiled step ran ("F0", "B0", ...), in the order they started."""
    return [f"{kind}{micro}" for kind, micro, _ in pipeline.action_ranges(prof.events())]


MESH_STEPS = 10  # pipelines on a mesh: 4 and 8 ranks on the CI's 2 cores (pp=2 and pp=4 alone run STEPS)


def compare_mesh(
    ctx_rank, world, mesh_cfg, name="gpt", *, micro=4, layers=2, remat="none", steps=MESH_STEPS, precision=None
):
    """Pipeline stages on a mesh (FSDP / TP inside each stage) vs one process with accum_steps=micro."""
    ctx = parallel.setup(mesh_cfg, timeout_s=COLLECTIVE_TIMEOUT_S)
    template, params, make_loss, tp_rules = family(name, layers, with_rules=True)
    ALL_NAMES[:] = list(params)
    rules = parallel.default_rules(tp_rules)
    data = batches(steps)
    opt = sgd()
    ref, ref_hist = run(
        make_train_step(
            make_loss(template, remat=remat, staged=True), opt, accum_steps=micro, compile=False, precision=precision
        ),
        init_state(params, opt),
        data,
    )
    model = parallel.tensor_parallel(template, ctx.mesh, rules)
    pipe = pipeline.place(make_loss(model, remat=remat, staged=True), params, group=ctx.pp_group)
    step = pipeline.make_pipeline_step(pipe, opt, microbatches=micro, precision=precision)
    state = parallel.shard_state(init_state(pipe.params(params), opt), ctx.mesh, rules)
    state, hist = run(step, state, data, ctx)
    full = parallel.gather(state)
    out = differences(ref, ref_hist, full, hist, pipe)
    out.update(
        held=0,
        expected_held=0,
        pp=[ctx.pp_rank, ctx.pp_world],
        dp=[ctx.dp_rank, ctx.dp_world],
        tp=[ctx.tp_rank, ctx.tp_world],
        local_numel=sum(v.to_local().numel() for v in state.params.values()),
        stage_numel=sum(v.numel() for v in state.params.values()),
        model_numel=sum(v.numel() for v in params.values()),
    )
    return out


def s_checkpoint(ctx_rank, world, mesh_cfg=None):
    """Pipeline stages (each rank its own part of the tree) save at step 10; the checkpoint restores as
    one whole state (one process, or FSDP over every rank with `mesh_cfg`), which trains 5 steps and
    saves; that restores back onto the pipeline's partial trees, which train the last 5 of 20 steps:
    every step equals one process's run."""
    micro = 4
    template, params, make_loss, tp_rules = family("gpt", 2, with_rules=True)
    ALL_NAMES[:] = list(params)
    rules = parallel.default_rules(tp_rules)
    data = batches(STEPS)
    opt = sgd()
    single = make_train_step(make_loss(template, staged=True), opt, accum_steps=micro, compile=False)
    ref, _ = run(single, init_state(params, opt), data)
    ctx = parallel.setup(mesh_cfg or {"pp": world, "dp_shard": 1}, timeout_s=COLLECTIVE_TIMEOUT_S)
    model = parallel.tensor_parallel(template, ctx.mesh, rules)
    pipe = pipeline.place(make_loss(model, staged=True), params, group=ctx.pp_group)
    step = pipeline.make_pipeline_step(pipe, opt, microbatches=micro)

    def stage_template():
        return parallel.shard_state(init_state(pipe.params(params), opt), ctx.mesh, rules)

    state, _ = run(step, stage_template(), data[:10], ctx)
    root = os.path.join(OUTDIR, f"ckpt_{'mesh' if mesh_cfg else 'pp'}")
    ckpt.save(os.path.join(root, "pp"), state)
    saved = parallel.gather(state)
    names = set(pipe.names)
    out = {"restored_leaves": 0}
    # onto one whole state: plain tensors, or FSDP over every rank
    whole = init_state(params, opt)
    fsdp = None
    if mesh_cfg:
        fsdp = parallel.setup({"dp_shard": -1}, timeout_s=COLLECTIVE_TIMEOUT_S)
        whole = parallel.shard_state(whole, fsdp.mesh, rules)
    restored = ckpt.restore(os.path.join(root, "pp"), whole, strict=True).result()
    plain = parallel.gather(restored) if mesh_cfg else restored
    out["pp_to_whole_params"] = max_diff(pipe.params(plain.params), saved.params)
    out["pp_to_whole_opt"] = opt_diff(plain, saved, names, empty=-1.0)
    out["whole_step"] = int(plain.step)
    # (over 4 FSDP ranks a rank's 2 rows are one microbatch: the mean over the same 8 rows)
    whole_step = make_train_step(
        make_loss(template, staged=True), opt, accum_steps=1 if mesh_cfg else micro, compile=False
    )
    restored, _ = run(whole_step, restored, data[10:15], fsdp)
    ckpt.save(os.path.join(root, "whole"), restored)
    back = ckpt.restore(os.path.join(root, "whole"), stage_template()).result()
    expect = pipe.params((parallel.gather(restored) if mesh_cfg else restored).params)
    out["whole_to_pp_params"] = max_diff(parallel.gather(back).params, expect)
    state, _ = run(step, back, data[15:], ctx)
    full = parallel.gather(state)
    out["resumed_step"] = int(full.step)
    out["resumed_vs_single_params"] = max_diff(full.params, pipe.params(ref.params))
    out["resumed_vs_single_opt"] = opt_diff(full, ref, names, empty=-1.0)
    return out


def s_eval(ctx_rank, world):
    """The pipeline eval step's loss equals one process's, on every rank."""
    template, params, make_loss = family("gpt", 2)
    staged = make_loss(template, staged=True)
    b = batches(1)[0]
    opt = sgd()
    ref = make_eval_step(staged, compile=False)(init_state(params, opt), b)
    pipe = pipeline.place(staged, params)
    evaluate, state = pipeline.make_pipeline_eval_step(pipe, microbatches=2), init_state(pipe.params(params), opt)
    with counting_receives() as receives:
        for _ in range(2):
            receives.append([0, 0])
            got = evaluate(state, b)
    return {
        "eval_loss": abs(float(ref["loss"]) - float(got["loss"])),
        "keys": sorted(got),
        "receives": receives,
        "expected_receives": 0 if pipe.first else 2,
    }


def s_too_many_stages(ctx_rank, world):
    """More pipeline ranks than blocks: one line."""
    template, params, make_loss = family("gpt", 2)
    try:
        pipeline.place(make_loss(template, staged=True), params, rank=0, world=3)
        return {"error_line": None}
    except ValueError as exc:
        return {"error_line": str(exc)}


SUITES = {
    "pp2": [
        ("gpt_1f1b", lambda r, w: compare(r, w)),
        ("gpt_gpipe", lambda r, w: compare(r, w, sched="gpipe")),
        ("gpt_eager_1f1b", lambda r, w: compare(r, w, sched="eager-1f1b")),
        ("gpt_one_micro", lambda r, w: compare(r, w, micro=1)),
        ("gpt_eight_micro", lambda r, w: compare(r, w, micro=8, layers=3, steps=5)),
        ("gpt_remat", lambda r, w: compare(r, w, remat="full")),
        ("gpt_bf16", lambda r, w: compare(r, w, precision="bf16")),
        ("gpt_bf16_one_micro", lambda r, w: compare(r, w, micro=1, precision="bf16")),
        ("gpt_fp16", lambda r, w: compare(r, w, precision="fp16")),  # dynamic loss scaling
        ("llama", lambda r, w: compare(r, w, "llama", micro=2)),
        ("llama_bf16_remat", lambda r, w: compare(r, w, "llama", remat="full", precision="bf16")),
        ("gpt_nan_skip", lambda r, w: compare(r, w, steps=5, poison_at=2)),
        ("gpt_compiled", lambda r, w: compare(r, w, micro=2, steps=4, compile=True, remat="full")),
        ("eval", s_eval),
        ("checkpoint", s_checkpoint),
        ("too_many_stages", s_too_many_stages),
    ],
    "pp4": [
        ("checkpoint_mesh", lambda r, w: s_checkpoint(r, w, {"pp": 2, "dp_shard": 2})),
        ("gpt_pp_fsdp", lambda r, w: compare_mesh(r, w, {"pp": 2, "dp_shard": 2})),
        ("gpt_pp_tp", lambda r, w: compare_mesh(r, w, {"pp": 2, "dp_shard": 1, "tp": 2}, remat="full")),
        ("llama_pp_fsdp_bf16", lambda r, w: compare_mesh(r, w, {"pp": 2, "dp_shard": 2}, "llama", precision="bf16")),
        ("llama_pp_tp", lambda r, w: compare_mesh(r, w, {"pp": 2, "dp_shard": 1, "tp": 2}, "llama", micro=2)),
        ("gpt_1f1b", lambda r, w: compare(r, w, micro=8, layers=4)),
        ("gpt_gpipe", lambda r, w: compare(r, w, sched="gpipe", micro=4, layers=4)),
        ("gpt_eager_1f1b", lambda r, w: compare(r, w, sched="eager-1f1b", micro=8, layers=4)),
        ("llama", lambda r, w: compare(r, w, "llama", micro=4, layers=5)),
        ("gpt_one_micro", lambda r, w: compare(r, w, micro=1, layers=4)),
        ("llama_bf16", lambda r, w: compare(r, w, "llama", micro=2, layers=4, precision="bf16")),
        ("gpt_bf16_remat", lambda r, w: compare(r, w, micro=4, layers=4, precision="bf16", remat="full")),
    ],
    "pp8": [
        ("gpt_pp_fsdp_tp", lambda r, w: compare_mesh(r, w, {"pp": 2, "dp_shard": 2, "tp": 2}, remat="full")),
    ],
}


OUTDIR = ""


def main(outdir: str, suite: str, only: list[str]) -> None:
    global OUTDIR
    OUTDIR = outdir
    parallel.setup(None, timeout_s=COLLECTIVE_TIMEOUT_S)  # the default group (gloo, one worker thread)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    t0 = time.monotonic()
    for name, fn in SUITES[suite]:
        if only and name not in only:
            continue
        print(f"scenario {name} at {time.monotonic() - t0:.1f} s", flush=True)
        try:
            results[name] = {"result": fn(rank, world)}
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = {"error": traceback.format_exc()}
            print(f"scenario {name} raised:\n{results[name]['error']}", flush=True)
        dist.barrier()
    print(f"suite {suite} done at {time.monotonic() - t0:.1f} s", flush=True)
    with open(os.path.join(outdir, f"{suite}_rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    parallel.teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
