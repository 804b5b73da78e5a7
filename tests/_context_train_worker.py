"""One rank of the context-parallel training scenarios (launched by tests/test_context_train.py).

Usage: python tests/_context_train_worker.py <outdir> <suite>     suites: cp2 (2 ranks), cp4 (4 ranks)

Every scenario trains the tiny GPT or the tiny Llama (grouped-query attention) with the families'
own loss (`make_loss_fn`) on a mesh with a cp axis, and the same model on one process (in this
same process, no mesh) on the same global batches, and reports the largest differences of losses,
gradient norms, parameters and optimizer state. Results (or tracebacks) go to
<outdir>/<suite>_rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

# the sharded-training worker's 20-step clipped SGD, tree difference and step loop
from _dist_parallel_worker import STEPS, max_diff, run, sgd

from functrain import checkpoint as ckpt
from functrain import init_state, make_train_step, parallel, rng
from functrain.models import gpt, llama
from functrain.parallel.dispatch import layout_of

SEQ, BATCH, VOCAB = 16, 8, 64
COLLECTIVE_TIMEOUT_S = 300


def family(name: str):
    """(template, TP rules, make_loss_fn) of the tiny model `name` ("gpt" or "llama")."""
    if name == "gpt":
        cfg = gpt.GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, bias=False)
        return gpt.GPT(cfg, key=rng.key(0)), gpt.TP_RULES, gpt.make_loss_fn
    cfg = llama.LlamaConfig(
        vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64
    )
    with torch.device("meta"):
        template = llama.Llama(cfg)
    return template, llama.TP_RULES, llama.make_loss_fn


def init_params(template, name):
    """The model's initial params (a pure function of the key)."""
    if name == "gpt":
        return dict(template.named_parameters())
    return llama.init_params(template, rng.key(0))


def batches(n: int, ignored: bool = False):
    """`n` global batches (x, y) of random ids; `ignored`: some targets are -1, more of them early in
    the sequence, so every cp rank counts a different number of targets."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        if ignored:
            drop = torch.rand(BATCH, SEQ, generator=g) < torch.linspace(0.9, 0.0, SEQ)  # (B, T)
            y = torch.where(drop, torch.full_like(y, -1), y)
        out.append((x, y))
    return out


def setup_model(ctx, name, remat, staged, kernel="zigzag"):
    """(template, rules, single-process loss, the mesh's loss) for family `name`."""
    template, tp, make_loss = family(name)
    rules = parallel.default_rules(tp)
    split = parallel.context.split_of(ctx.mesh, kernel)
    model = parallel.tensor_parallel(parallel.context.context_parallel(template, split), ctx.mesh, rules)
    return template, rules, make_loss(template), make_loss(model, remat=remat, staged=staged)


def compare(
    ctx,
    name="gpt",
    *,
    remat="none",
    staged=True,
    steps=STEPS,
    precision=None,
    ignored=False,
    compile=False,
    kernel="zigzag",
):
    """The cp run vs one process: max differences of metrics, params and optimizer state."""
    template, rules, single_loss, cp_loss = setup_model(ctx, name, remat, staged, kernel)
    data = batches(steps, ignored)
    opt = sgd()
    params = init_params(template, name)
    ref, ref_hist = run(
        make_train_step(single_loss, opt, compile=False, precision=precision), init_state(params, opt), data
    )
    counters = None
    options = None
    if compile:
        import torch._dynamo
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        options = {"backend": "aot_eager"}
    step = make_train_step(cp_loss, opt, compile=compile, compile_options=options, precision=precision)
    state = parallel.shard_state(init_state(params, opt), ctx.mesh, rules)
    if compile:
        hist = []
        try:
            for i, b in enumerate(data):
                torch._dynamo.config.error_on_recompile = i > 0
                state, m = step(state, parallel.split_batch(b, ctx.dp_rank, ctx.dp_world))
                hist.append({k: float(v) for k, v in m.items()})
        finally:
            torch._dynamo.config.error_on_recompile = False
    else:
        state, hist = run(step, state, data, ctx)
    full = parallel.gather(state)
    out = {
        "loss": max(abs(a["loss"] - b["loss"]) for a, b in zip(ref_hist, hist)),
        "loss_scale": max(abs(a["loss"]) for a in ref_hist),
        "grad_norm": max(abs(a["grad_norm"] - b["grad_norm"]) / abs(a["grad_norm"]) for a, b in zip(ref_hist, hist)),
        "params": max_diff(full.params, ref.params),
        "opt_state": max_diff(full.opt_state, ref.opt_state),
        "step": int(full.step),
        "skipped": sum(h.get("skipped", 0.0) for h in hist),
        "placements": {k: [repr(p) for p in v.placements] for k, v in state.params.items()},
        "local_numel": sum(v.to_local().numel() for v in state.params.values()),
        "global_numel": sum(v.numel() for v in state.params.values()),
    }
    if counters is not None:
        out["unique_graphs"] = counters["stats"]["unique_graphs"]
    if name == "gpt" and staged:  # the rows of the position table the embedding stage computes with
        embed = cp_loss.embed
        local = layout_of(state.params).gather(embed.params(state.params), embed.rows)
        out["position_rows"] = {"local": local["wpe.weight"].shape[0], "global": state.params["wpe.weight"].shape[0]}
    return out


def s_checkpoint(ctx):
    """cp run saves at step 10; the checkpoint restores onto one process and onto an FSDP mesh
    (cp=1), equal to the saved state; FSDP trains 5 steps, saves, restores back onto the cp mesh, which
    trains the last 5 of 20 steps: the params equal one process's after 20."""
    template, rules, single_loss, cp_loss = setup_model(ctx, "gpt", "full", True)
    data = batches(STEPS)
    opt = sgd()
    params = init_params(template, "gpt")
    state, _ = run(
        make_train_step(cp_loss, opt, compile=False),
        parallel.shard_state(init_state(params, opt), ctx.mesh, rules),
        data[:10],
        ctx,
    )
    root = os.path.join(OUTDIR, f"ckpt_{dist.get_world_size()}")
    ckpt.save(os.path.join(root, "cp"), state)
    saved = parallel.gather(state)
    plain = ckpt.restore(os.path.join(root, "cp"), init_state(params, opt)).result()
    out = {"cp_to_plain": max_diff(plain, saved)}
    fsdp = parallel.setup({"dp_shard": -1}, timeout_s=COLLECTIVE_TIMEOUT_S)
    fsdp_template = parallel.shard_state(init_state(params, opt), fsdp.mesh, rules)
    onto_fsdp = ckpt.restore(os.path.join(root, "cp"), fsdp_template).result()
    out["cp_to_fsdp"] = max_diff(parallel.gather(onto_fsdp), saved)
    out["fsdp_placement"] = [repr(p) for p in onto_fsdp.params["wte.weight"].placements]
    fsdp_step = make_train_step(single_loss, opt, compile=False)
    onto_fsdp, _ = run(fsdp_step, onto_fsdp, data[10:15], fsdp)
    ckpt.save(os.path.join(root, "fsdp"), onto_fsdp)
    back = ckpt.restore(
        os.path.join(root, "fsdp"), parallel.shard_state(init_state(params, opt), ctx.mesh, rules)
    ).result()
    out["fsdp_to_cp"] = max_diff(parallel.gather(back), parallel.gather(onto_fsdp))
    out["cp_placement"] = [repr(p) for p in back.params["wte.weight"].placements]
    # and the cp run goes on from what it restored as one process would
    ref, _ = run(make_train_step(single_loss, opt, compile=False), init_state(params, opt), data)
    cont, _ = run(make_train_step(cp_loss, opt, compile=False), back, data[15:], ctx)
    out["resumed_step"] = int(cont.step)
    out["resumed_vs_single_params"] = max_diff(parallel.gather(cont).params, ref.params)
    return out


def s_bad_length(ctx):
    """A sequence the split cannot cut evenly: one line naming the length and the ranks."""
    template, _, _, cp_loss = setup_model(ctx, "gpt", "none", False)
    x = torch.zeros(2, 6, dtype=torch.long)  # 6 tokens on 2 ranks: 4 chunks of 1.5
    try:
        cp_loss(init_params(template, "gpt"), (x, x), None)
        return {"error_line": None}
    except ValueError as exc:
        return {"error_line": str(exc)}


SUITES = {
    "cp2": [
        ("gpt", {"dp_shard": 1, "cp": 2}, lambda ctx: compare(ctx, staged=False)),
        ("gpt_remat", {"dp_shard": 1, "cp": 2}, lambda ctx: compare(ctx, remat="full")),
        ("gpt_ignored", {"dp_shard": 1, "cp": 2}, lambda ctx: compare(ctx, ignored=True)),
        ("gpt_bf16", {"dp_shard": 1, "cp": 2}, lambda ctx: compare(ctx, precision="bf16", steps=10)),
        ("llama", {"dp_shard": 1, "cp": 2}, lambda ctx: compare(ctx, "llama")),
        (
            "llama_remat_bf16",
            {"dp_shard": 1, "cp": 2},
            lambda ctx: compare(ctx, "llama", remat="full", precision="bf16", steps=10),
        ),
        ("gpt_mask", {"dp_shard": 1, "cp": 2}, lambda ctx: compare(ctx, kernel="mask")),
        ("llama_stream", {"dp_shard": 1, "cp": 2}, lambda ctx: compare(ctx, "llama", remat="full", kernel="stream")),
        ("gpt_compiled", {"dp_shard": 1, "cp": 2}, lambda ctx: compare(ctx, remat="full", steps=4, compile=True)),
        # the two compile units, each with one kernel: the step with the gathered keys, the blocks
        # with the streamed ones (a collective per key chunk inside the block graph)
        (
            "gpt_blocks_stream",
            {"dp_shard": 1, "cp": 2},
            lambda ctx: compare(ctx, remat="full", steps=4, compile="blocks", kernel="stream"),
        ),
        ("checkpoint", {"dp_shard": 1, "cp": 2}, s_checkpoint),
        ("bad_length", {"dp_shard": 1, "cp": 2}, s_bad_length),
    ],
    "cp4": [
        ("gpt_cp4", {"dp_shard": 1, "cp": 4}, lambda ctx: compare(ctx)),
        ("llama_cp4", {"dp_shard": 1, "cp": 4}, lambda ctx: compare(ctx, "llama", remat="full")),
        ("gpt_cp4_stream", {"dp_shard": 1, "cp": 4}, lambda ctx: compare(ctx, kernel="stream")),
        ("gpt_fsdp_cp", {"dp_shard": 2, "cp": 2}, lambda ctx: compare(ctx)),
        ("gpt_hsdp_cp", {"dp_replicate": 2, "dp_shard": 1, "cp": 2}, lambda ctx: compare(ctx, remat="full")),
        ("gpt_cp_tp", {"dp_shard": 1, "cp": 2, "tp": 2}, lambda ctx: compare(ctx)),
        ("llama_cp_tp", {"dp_shard": 1, "cp": 2, "tp": 2}, lambda ctx: compare(ctx, "llama")),
    ],
}

OUTDIR = ""


def main(outdir: str, suite: str, only: list[str]) -> None:
    global OUTDIR
    OUTDIR = outdir
    results = {}
    t0 = time.monotonic()
    for name, mesh_cfg, fn in SUITES[suite]:
        if only and name not in only:
            continue
        print(f"scenario {name} at {time.monotonic() - t0:.1f} s", flush=True)
        try:
            ctx = parallel.setup(mesh_cfg, timeout_s=COLLECTIVE_TIMEOUT_S)
            results[name] = {"result": fn(ctx)}
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = {"error": traceback.format_exc()}
            print(f"scenario {name} raised:\n{results[name]['error']}", flush=True)
    print(f"suite {suite} done at {time.monotonic() - t0:.1f} s", flush=True)
    with open(os.path.join(outdir, f"{suite}_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f, indent=1)
    parallel.teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
