"""One rank of the sharded-training scenarios (launched by test_parallel_dist.py).

Usage: python tests/_dist_parallel_worker.py <outdir> <suite>
Suites: eager2 (2 ranks), compiled2 and matrix2 (2 ranks), eager4 (4 ranks), single (1 process, no torchrun).
Every scenario compares the sharded run with the plain single-process run of the same global
batches, computed in the same process; its numbers (or its traceback) go to
<outdir>/<suite>_rank<r>.json, so one failing scenario does not hide the others: a scenario that
raises on some ranks prints its traceback at once, the ranks left waiting in its collectives fail
after COLLECTIVE_TIMEOUT_S, and all of them meet again in the next scenario's mesh.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import sys
import time
import traceback

import optree
import torch
import torch.distributed as dist

from functrain import apply, init_state, make_eval_step, make_train_step, optim, parallel, rng
from functrain.generation import Generator, Sampling
from functrain.models import gpt, inference
from functrain.parallel import tp as tp_lib

STEPS = 20


def tiny_gpt(bias: bool = False) -> gpt.GPT:
    """The tiny GPT of the tests. bias=False by default: attn.k.bias has an exactly-zero true
    gradient (softmax is shift invariant), so AdamW turns its round-off into full-size steps in
    any run, single-process included, and it cannot be compared to 1e-5."""
    cfg = gpt.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=bias)
    return gpt.GPT(cfg, key=rng.key(0))


def loss_fn_for(model):
    """Next-token cross-entropy of `model` on a batch (x, y)."""

    def loss_fn(params, batch, key):
        x, y = batch
        return gpt.cross_entropy(apply(model, params, x, dropout_key=key), y), {
            "tokens": torch.tensor(float(x.numel()))
        }

    return loss_fn


def global_batches(n: int, batch_size: int = 8, seed: int = 0):
    """`n` global batches (x, y) of random token ids, shape (batch_size, 16)."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 64, (batch_size, 16), generator=g), torch.randint(0, 64, (batch_size, 16), generator=g))
        for _ in range(n)
    ]


def adamw():
    """Clipping + AdamW with a warm-up/cosine schedule (the usual GPT optimizer)."""
    return optim.chain(
        optim.clip_by_global_norm(1.0), optim.adamw(optim.warmup_cosine(1e-2, 3, STEPS), weight_decay=0.1)
    )


SGD_LR, SGD_MOMENTUM = 0.05, 0.9


def sgd():
    """Clipping + SGD with momentum and a schedule: the trajectories' optimizer. Its update moves with
    the gradient, so sharded and single runs stay within rounding (tests/_tol.py); Adam would turn the
    rounding noise of near-zero gradients into full-size steps in either run."""
    return optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.sgd(optim.warmup_cosine(SGD_LR, 3, STEPS, end_value=SGD_LR / 10), momentum=SGD_MOMENTUM),
    )


def max_diff(a, b) -> float:
    """Largest absolute difference between two trees of plain tensors (same structure)."""
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    assert sa == sb, f"structure {sa} != {sb}"
    return max([(x.double() - y.double()).abs().max().item() for x, y in zip(la, lb) if x.numel()] + [0.0])


def run(step_fn, state, batches, ctx=None):
    """Runs the steps; returns (final state, [metrics dict of floats per step])."""
    hist = []
    for b in batches:
        if ctx is not None:
            b = parallel.split_batch(b, ctx.dp_rank, ctx.dp_world)
        state, m = step_fn(state, b)
        hist.append({k: float(v) for k, v in m.items()})
    return state, hist


def compare(
    ctx,
    *,
    bias=False,
    make_opt=sgd,
    steps=STEPS,
    accum=1,
    compile=False,
    donate=True,
    compile_options=None,
    rules=None,
    precision=None,
    batches=None,
    make_loss=None,
):
    """Sharded run vs the plain single-process run: max differences of metrics, params, opt state."""
    model = tiny_gpt(bias)
    make_loss = make_loss or loss_fn_for
    rules = parallel.default_rules(gpt.TP_RULES) if rules is None else rules
    batches = batches or global_batches(steps)
    opt = make_opt()
    ref_step = make_train_step(make_loss(model), opt, accum_steps=accum, compile=False, precision=precision)
    ref, ref_hist = run(ref_step, init_state(model, opt), batches)
    tp_model = parallel.tensor_parallel(model, ctx.mesh, rules)
    step = make_train_step(
        make_loss(tp_model),
        opt,
        accum_steps=accum,
        compile=compile,
        donate=donate,
        compile_options=compile_options,
        precision=precision,
    )
    state = parallel.shard_state(init_state(model, opt), ctx.mesh, rules)
    state, hist = run(step, state, batches, ctx)
    full = parallel.gather(state)
    return {
        "loss": max(abs(a["loss"] - b["loss"]) for a, b in zip(ref_hist, hist)),
        "grad_norm": max(
            abs(a["grad_norm"] - b["grad_norm"]) / max(abs(a["grad_norm"]), 1e-30)
            for a, b in zip(ref_hist, hist)
            if a["grad_norm"] == a["grad_norm"]
        ),  # relative
        "metric_keys_equal": sorted(ref_hist[0]) == sorted(hist[0]),
        "params": max_diff(full.params, ref.params),
        "opt_state": max_diff(full.opt_state, ref.opt_state),
        "step": int(full.step),
        "loss_first_last": [hist[0]["loss"], hist[-1]["loss"]],
        "skipped": [h.get("skipped") for h in hist],
        "ref_skipped": [h.get("skipped") for h in ref_hist],
        "param_dtypes": sorted({str(p.dtype) for p in full.params.values()}),
        "guard": [int(full.guard.skipped), int(full.guard.consecutive)],
        "placements": {k: [repr(p) for p in v.placements] for k, v in state.params.items()},
    }


# ---------------------------------------------------------------------------------------------
# scenarios: name -> (mesh config, fn(ctx) -> result dict)


def s_fsdp(ctx):
    return compare(ctx)


def s_tp(ctx):
    return compare(ctx)


def s_ddp(ctx):
    return compare(ctx)


def s_adamw_step(ctx):
    """One AdamW step from the same state: loss, grad norm and the sharded moments (linear and
    quadratic in the gradient) equal one process's. Params after it are lr * sign(g) where g ~ 0:
    not comparable in any two runs, so the test does not look at them."""
    return compare(ctx, make_opt=adamw, steps=1)


def s_bias(ctx):
    return compare(ctx, bias=True, steps=10)


def s_bf16(ctx):
    """bf16 compute (params cast before the gather), fp32 masters: matches bf16 on one process."""
    return compare(ctx, precision="bf16", steps=10)


def staged_loss_for(remat):
    """make_loss(model) for `compare`: the GPT loss as stages, so the sharded step gathers per block."""

    def make(model):
        return gpt.make_loss_fn(model, remat=remat, staged=True)

    return make


def _gathered_numels(ctx, step_fn, state, batch):
    """Elements of every all-gather one eager step issues (spmd's funcol calls, in order)."""
    from functrain.parallel import spmd

    seen, real = [], spmd.all_gather

    def spy(x, *args, **kwargs):
        seen.append(x.numel() * ctx.dp_world)
        return real(x, *args, **kwargs)

    spmd.all_gather = spy
    try:
        step_fn(state, parallel.split_batch(batch, ctx.dp_rank, ctx.dp_world))
    finally:
        spmd.all_gather = real
    return seen


def s_stages(ctx, remat="full", precision=None, steps=STEPS):
    """Per-block gathers (a staged loss): 20 steps equal one process; each gather is one stage's
    params (never the whole model), and with remat every block is gathered again for its backward."""
    out = compare(ctx, make_loss=staged_loss_for(remat), precision=precision, steps=steps)
    model = tiny_gpt()
    rules = parallel.default_rules(gpt.TP_RULES)
    opt = sgd()
    step = make_train_step(
        staged_loss_for(remat)(parallel.tensor_parallel(model, ctx.mesh, rules)), opt, compile=False, donate=False
    )
    state = parallel.shard_state(init_state(model, opt), ctx.mesh, rules)
    out["gathers"] = _gathered_numels(ctx, step, state, global_batches(1)[0])
    out["model_numel"] = sum(p.numel() for p in model.parameters())
    sizes = dict(model.named_parameters())
    st = gpt.stages(model)
    head = st.final.names + ("wte.weight",)
    out["stage_numels"] = [
        sum(sizes[n].numel() for n in names) for names in [st.embed.names, *(b.names for b in st.blocks), head]
    ]
    return out


def s_gathered_live(ctx, remat="full"):
    """A memory trace of one eager per-block step: the bytes of gathered parameters alive (their
    storages not yet freed, `StorageWeakRef`) right after each gather, with each stage's size."""
    from torch.multiprocessing.reductions import StorageWeakRef

    cfg = gpt.GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, dropout=0.0, bias=False)
    model = gpt.GPT(cfg, key=rng.key(0))
    rules = parallel.default_rules(gpt.TP_RULES)
    opt = sgd()
    step = make_train_step(
        staged_loss_for(remat)(parallel.tensor_parallel(model, ctx.mesh, rules)), opt, compile=False, donate=False
    )
    state = parallel.shard_state(init_state(model, opt), ctx.mesh, rules)
    lay = parallel.layout_of(state.params)
    live, trace, real = {}, [], type(lay).gather

    def spy(self, params, rows=()):
        out = real(self, params, rows)
        for ptr in [p for p, (ref, _) in live.items() if ref.expired()]:  # freed (before a reused address)
            del live[ptr]
        own = {p.to_local().untyped_storage().data_ptr() for p in params.values()}  # replicated: no copy
        for t in out.values():
            st = t.untyped_storage()
            if st.data_ptr() not in own:
                live.setdefault(st.data_ptr(), (StorageWeakRef(st), st.nbytes()))
        trace.append(sum(n for _, n in live.values()))
        return out

    type(lay).gather = spy
    try:
        step(state, parallel.split_batch(global_batches(1)[0], ctx.dp_rank, ctx.dp_world))
    finally:
        type(lay).gather = real
    sizes = {n: p.numel() * 4 for n, p in model.named_parameters()}
    st = gpt.stages(model)
    return {
        "trace": trace,
        "embed": sum(sizes[n] for n in st.embed.names),
        "block": max(sum(sizes[n] for n in b.names) for b in st.blocks),
        "head": sizes["wte.weight"] + sum(sizes[n] for n in st.final.names),
        "model": sum(sizes.values()),
    }


def s_init(ctx):
    """Sharded init: each rank draws only its blocks; gathered, they equal the single-process init."""
    cfg = gpt.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=True)
    with torch.device("meta"):
        template = gpt.GPT(cfg)
    rules = parallel.default_rules(gpt.TP_RULES)
    drawn = []

    def init(key, device, where):
        def spy(name, shape):
            offset, local = where(name, shape)
            drawn.append((name, list(shape), local))
            return offset, local

        return gpt.init_params(template, key, device=device, where=spy)

    sharded = parallel.init_sharded(init, rng.key(3), ctx.mesh, rules)
    whole = gpt.init_params(template, rng.key(3))
    full = parallel.gather(sharded)
    return {
        "equal": {n: bool(torch.equal(full[n], whole[n])) for n in whole},
        "placements": {n: [repr(p) for p in v.placements] for n, v in sharded.items()},
        "drawn_numel": sum(math.prod(local) for _, _, local in drawn),
        "model_numel": sum(v.numel() for v in whole.values()),
        "largest_fraction": max(
            math.prod(local) / math.prod(shape) for _, shape, local in drawn if math.prod(shape) >= 32 * 32
        ),
    }


def _hf_cached_sample(ctx) -> dict:
    """The hf family's Qwen2 through its KV cache on sharded params, a stage at a time (transformers' layers over
    the slot cache): the plain params' tokens, sampled, each gather at most one stage."""
    from functrain.models import hf
    from functrain.models.hf.tiny import write_tiny

    shape = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    directory = write_tiny(os.path.join(OUTDIR, f"qwen2_rank{dist.get_rank()}"), "qwen2", vocab_size=64, **shape)
    template = hf.build_template(hf.load_config(directory))
    full = hf.init_params(template, rng.key(3))
    sharded = parallel.shard_params(full.items(), ctx.mesh)
    st = hf.stages(template)
    gen = Generator(hf.cached_model(template, stages=st, head=hf.head_name(template)), block_size=16, compile=False)
    kw = dict(key=rng.key(5), sampling=Sampling(temperature=1.0, top_k=10), n=2)
    want = gen(full, [[1, 2, 3], [4, 5]], 12, **kw)
    with _gathers() as gathered:
        got = gen(sharded, [[1, 2, 3], [4, 5]], 12, **kw)
    native = {}
    if ctx.tp_world > 1:  # transformers' own plan: each rank its query heads and its one kv head
        own, tp_gathers, heads = _hf_on_heads(ctx, template, full, st, kw)
        native = {"hf_tp_tokens": own, "hf_tp_gathers": tp_gathers, "hf_tp_heads": heads}
        # a type without stages (gemma2's soft-capped logits): its whole forward over the tensor-parallel copy
        g_dir = write_tiny(os.path.join(OUTDIR, f"gemma2_rank{dist.get_rank()}"), "gemma2", vocab_size=64, **shape)
        g_template = hf.build_template(hf.load_config(g_dir))
        g_full = hf.init_params(g_template, rng.key(3))
        g_want = Generator(hf.cached_model(g_template), block_size=16, compile=False)(
            g_full, [[1, 2, 3], [4, 5]], 12, **kw
        )
        g_own, g_gathers, _ = _hf_on_heads(ctx, g_template, g_full, None, kw)
        native["hf_unstaged_tp_equal"] = g_own == [[c.tokens for c in r] for r in g_want]
        native["hf_unstaged_tp_gathers"] = g_gathers
    return {
        "hf_equal": [[c.tokens for c in r] for r in got] == [[c.tokens for c in r] for r in want],
        "hf_tokens": [[c.tokens for c in r] for r in got],
        "hf_gathers": gathered,
        "hf_stage_max": _stage_max(st, full),
        **native,
    }


def _hf_on_heads(ctx, template, full: dict, st, kw: dict):
    """(tokens, whole gathers, kv heads per rank) of the hf `template` decoding `full` sharded by its own tensor-
    parallel plan, on each rank's heads (`st`: its stages; None: its whole forward)."""
    from functrain.models import hf

    rules = parallel.default_rules(hf.tp_rules(template))
    tp_model = hf.with_buffers(parallel.tensor_parallel(template, ctx.mesh, rules), template)
    head = hf.head_name(template)
    on_heads = hf.cached_model(template, stages=st, head=head, tp_model=tp_model, tp_size=ctx.tp_world)
    with _gathers() as gathered:
        own = Generator(on_heads, block_size=16, compile=False)(
            parallel.shard_params(full.items(), ctx.mesh, rules), [[1, 2, 3], [4, 5]], 12, **kw
        )
    return [[c.tokens for c in r] for r in own], gathered, on_heads.sharded_kv_heads


@contextlib.contextmanager
def _gathers():
    """A list of the element counts of every `parallel.gather` call made inside the block."""
    gathered, real = [], parallel.gather

    def spy(tree):
        gathered.append(sum(t.numel() for t in tree.values()))
        return real(tree)

    parallel.gather = spy
    try:
        yield gathered
    finally:
        parallel.gather = real


def _stage_max(st, full) -> int:
    """The element count of the largest of `st`'s stages (embed, each block, final) in params `full`."""
    return max(
        sum(full[n].numel() for n in names) for names in [st.embed.names, *(b.names for b in st.blocks), st.final.names]
    )


def s_sample(ctx):
    """The end-of-run sample and HF export over sharded params: the tokens and the file's bytes equal
    the full params' ones, and each gather holds one stage (sampling) or one tensor (export)."""
    from functrain.interop.hf import save_hf_directory

    model = tiny_gpt(bias=True)
    full = {n: p.detach() for n, p in model.named_parameters()}
    sharded = parallel.shard_params(full.items(), ctx.mesh, parallel.default_rules(gpt.TP_RULES))
    prompt, kw = torch.tensor([[1, 2, 3]]), dict(temperature=1.0, top_k=10, key=rng.key(5))
    want = gpt.generate(model, full, prompt, 12, **kw)
    with _gathers() as gathered:
        got = gpt.generate(model, sharded, prompt, 12, stages=gpt.stages(model), head="wte.weight", **kw)
    # through the KV cache, a stage gathered at a time: sample 0 of prompt 0 draws as the recompute path's row 0
    cached = inference.cached_model(model, gpt.stages(model), "wte.weight")
    gen = Generator(cached, block_size=15, batch_size=2, compile=False)
    with _gathers() as cached_gathers:
        [[done]] = gen(sharded, [[1, 2, 3]], 12, key=rng.key(5), sampling=Sampling(temperature=1.0, top_k=10))
    native = {}
    if ctx.tp_world > 1:  # the tensor-parallel plan: each rank's heads and its own kv cache, gathered over dp only
        tp_model = parallel.tensor_parallel(model, ctx.mesh, parallel.default_rules(gpt.TP_RULES))
        on_heads = inference.cached_model(model, gpt.stages(model), "wte.weight", gpt.stages(tp_model), ctx.tp_world)
        with _gathers() as tp_gathers:
            [[own]] = Generator(on_heads, block_size=15, batch_size=2, compile=False)(
                sharded, [[1, 2, 3]], 12, key=rng.key(5), sampling=Sampling(temperature=1.0, top_k=10)
            )
        native = {"tp_tokens": [[1, 2, 3, *own.tokens]], "tp_gathers": tp_gathers}
        native["tp_heads"] = on_heads.sharded_kv_heads
    try:
        gpt.generate(model, sharded, prompt, 1, **kw)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    seen, real_full = [], torch.distributed.tensor.DTensor.full_tensor

    def spy_full(self, *args, **kwargs):
        seen.append(self.numel())
        return real_full(self, *args, **kwargs)

    out = os.path.join(OUTDIR, f"sample_{'_'.join(map(str, ctx.mesh.shape))}_{ctx.tp_world}")
    torch.distributed.tensor.DTensor.full_tensor = spy_full
    try:
        save_hf_directory(os.path.join(out, "sharded"), sharded, {"model_type": "test"})
    finally:
        torch.distributed.tensor.DTensor.full_tensor = real_full
    save_hf_directory(os.path.join(out, "full"), full, {"model_type": "test"})
    same_bytes = None
    if dist.get_rank() == 0:
        import safetensors.torch

        a, b = (open(os.path.join(out, d, "model.safetensors"), "rb").read() for d in ("sharded", "full"))
        back = safetensors.torch.load_file(os.path.join(out, "sharded", "model.safetensors"))  # the package reads it
        same_bytes = a == b and back.keys() == full.keys() and all(torch.equal(back[n], full[n]) for n in full)
    st = gpt.stages(model)
    return {
        "equal": bool(torch.equal(got, want)),
        "tokens": got.tolist(),
        "gathers": gathered,
        "cached_tokens": [[1, 2, 3, *done.tokens]],
        "cached_gathers": cached_gathers,
        "refused": refused,
        "stage_max": _stage_max(st, full),
        "model_numel": sum(t.numel() for t in full.values()),
        "export_gathers": seen,
        "largest_tensor": max(t.numel() for t in full.values()),
        "same_bytes": same_bytes,
        **native,
        **_hf_cached_sample(ctx),
    }


def poisoned_loss_fn_for(model):
    """The usual loss, made NaN when a target is -7 (marks a poisoned sample)."""
    inner = loss_fn_for(model)

    def loss_fn(params, batch, key):
        x, y = batch
        loss, aux = inner(params, (x, y.clamp(min=0)), key)
        return loss * torch.where((y == -7).any(), float("nan"), 1.0), aux

    return loss_fn


def s_nan_skip(ctx):
    """A NaN in ONE dp rank's half of batch 2: every rank skips that update, as one process does."""
    batches = global_batches(5)
    batches[2][1][0, 0] = -7  # row 0: dp rank 0's half only
    return compare(ctx, steps=5, batches=batches, make_loss=poisoned_loss_fn_for)


def s_accum(ctx):
    return compare(ctx, accum=2, donate=False, steps=5)


def s_tp_is_local(ctx):
    """TP computes on local shards: half of q's rows, half the heads, all-reduces of (B, T, C)."""
    model = tiny_gpt()
    rules = parallel.default_rules(gpt.TP_RULES)
    tp_model = parallel.tensor_parallel(model, ctx.mesh, rules)
    opt = adamw()
    state = parallel.shard_state(init_state(model, opt), ctx.mesh, rules)
    local = parallel.layout_of(state.params).gather(state.params)
    heads = []
    hook = tp_model.blocks[0].attn.q.register_forward_hook(lambda m, i, o: heads.append(o.shape[-1] // 8))
    shapes = []
    orig = tp_lib._all_reduce
    tp_lib._all_reduce = lambda x, g: (shapes.append(list(x.shape)), orig(x, g))[1]
    try:
        step = make_train_step(loss_fn_for(tp_model), opt, compile=False)
        x, y = parallel.split_batch(global_batches(1)[0], ctx.dp_rank, ctx.dp_world)
        step(state, (x, y))
    finally:
        tp_lib._all_reduce = orig
        hook.remove()
    return {
        "q_local": list(local["blocks.0.attn.q.weight"].shape),
        "proj_local": list(local["blocks.0.attn.proj.weight"].shape),
        "fc_local": list(local["blocks.0.mlp.fc.weight"].shape),
        "wte_local": list(local["wte.weight"].shape),
        "local_heads": heads[0],
        "all_reduce_shapes": shapes,
    }


def s_uneven(ctx):
    """A 7-row parameter: shard -> gather round trip, and 5 steps equal to the plain run."""
    g = torch.Generator().manual_seed(1)
    params = {
        "w": torch.randn(7, 3, generator=g),
        "b": torch.randn(7, generator=g),
        "v": torch.randn(5, 7, generator=g),
    }

    def loss_fn(p, batch, key):
        x, y = batch
        h = torch.tanh(x @ p["w"].T + p["b"])  # (B, 7)
        return ((h @ p["v"].T - y) ** 2).mean()

    opt = sgd()
    ref0 = init_state(params, opt)
    sharded = parallel.shard_state(ref0, ctx.mesh)
    local_rows = [sharded.params["w"].to_local().shape[0], sharded.params["b"].to_local().shape[0]]
    roundtrip = max_diff(parallel.gather(sharded), ref0)
    xs = [(torch.randn(8, 3, generator=g), torch.randn(8, 5, generator=g)) for _ in range(5)]
    ref, ref_hist = run(make_train_step(loss_fn, opt, compile=False), ref0, xs)
    st, hist = run(make_train_step(loss_fn, opt, compile=False), sharded, xs, ctx)
    return {
        "local_rows": local_rows,
        "roundtrip": roundtrip,
        "trace_is_dtensor": type(st.opt_state[1][1].trace["w"]).__name__,
        "loss": max(abs(a["loss"] - b["loss"]) for a, b in zip(ref_hist, hist)),
        "params": max_diff(parallel.gather(st.params), ref.params),
    }


def s_reduce_routes(ctx):
    """Gradients reduce-scattered by every route of `parallel.configure(mesh, reduce_scatter=)` (the backend's
    reduce-scatter,
    all-to-all + a local sum, an all-reduce with this rank's row copied out, "auto"), against the
    mean of every rank's gradients computed here."""
    from functrain.parallel import spmd

    g = torch.Generator().manual_seed(2)
    shapes = {"w": (7, 5), "m": (64, 33), "b": (9,)}  # uneven rows: 7 and 9 over 2 or 4 ranks
    params = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    sharded = parallel.shard_params(params, ctx.mesh)
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = [{k: torch.randn(s, generator=g) for k, s in shapes.items()} for _ in range(world)]
    lay = parallel.layout_of(sharded)
    dp_of = [None] * world  # every rank's dp index: tp peers share one, and the same gradients
    dist.all_gather_object(dp_of, lay.dp_rank)
    grads = per_rank[dp_of[rank]]
    want = {k: sum(per_rank[dp_of[r]][k] for r in range(world)) / world for k in shapes}
    out = {}
    try:
        for route in spmd.ROUTES:
            parallel.configure(ctx.mesh, reduce_scatter=route)
            assert parallel.layout_of(sharded).reduce_scatter == route
            red = parallel.layout_of(sharded).reduce_grads(grads, sharded)
            out[route] = {k: v.full_tensor() for k, v in red.items()}
    finally:
        parallel.configure(ctx.mesh)
    return {
        "dp_world": lay.dp_world,
        "to_mean": {r: max_diff(o, want) for r, o in out.items()},
        "vs_rs": {r: max_diff(o, out["reduce_scatter"]) for r, o in out.items()},
        "gloo": sorted(lay._gloo.values()),
    }


def s_eval_and_keys(ctx):
    """The sharded eval step equals the plain one; dropout keys differ across dp ranks only."""
    model = tiny_gpt()
    rules = parallel.default_rules(gpt.TP_RULES)
    opt = adamw()
    plain = init_state(model, opt)
    state = parallel.shard_state(init_state(model, opt), ctx.mesh, rules)
    b = global_batches(1)[0]
    ref = make_eval_step(loss_fn_for(model), compile=False)(plain, b)
    got = make_eval_step(loss_fn_for(parallel.tensor_parallel(model, ctx.mesh, rules)), compile=False)(
        state, parallel.split_batch(b, ctx.dp_rank, ctx.dp_world)
    )
    key = parallel.layout_of(state.params).fold_in_dp(rng.fold_in(plain.rng, 3))
    keys = [None] * ctx.world_size
    dist.all_gather_object(keys, key.tolist())
    return {
        "eval_loss": abs(float(ref["loss"]) - float(got["loss"])),
        "keys": keys,
        "dp_ranks": [ctx.dp_rank],
        "tp_rank": ctx.tp_rank,
    }


class _PassLog(logging.Handler):
    """Sums what functrain.compiler.recompute and functrain.compiler.regather log for each graph they rewrite."""

    LOGGERS = ("functrain.compiler.recompute", "functrain.compiler.regather")

    def __init__(self):
        super().__init__(logging.INFO)
        self.counts = {"recomputed": 0, "regathered": 0}
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
            logging.getLogger(name).setLevel(logging.INFO)

    def emit(self, record):
        for k in self.counts:
            self.counts[k] += getattr(record, k, 0)

    def close(self):
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)
        super().close()


def s_compiled(
    ctx, backend, make_loss=loss_fn_for, compile=True, precision=None, accum=1, steps=6, vs_sharded_eager=True
):
    """Compiled sharded step: one graph (compile="blocks": one per stage kind), no recompile over
    `steps` steps, equal to 1 process (eager, same precision and accumulation) and, when asked, to
    the eager sharded step."""
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    passes = _PassLog()  # what functrain's post-grad passes did to the step's graph (inductor only)
    model = tiny_gpt()
    rules = parallel.default_rules(gpt.TP_RULES)
    tp_model = parallel.tensor_parallel(model, ctx.mesh, rules)
    opt = sgd()
    batches = global_batches(steps)
    kw = dict(precision=precision, accum_steps=accum)
    ref, ref_hist = run(make_train_step(make_loss(model), opt, compile=False, **kw), init_state(model, opt), batches)
    eager, eager_hist = ref, ref_hist
    if vs_sharded_eager:
        eager, eager_hist = run(
            make_train_step(make_loss(tp_model), opt, compile=False, **kw),
            parallel.shard_state(init_state(model, opt), ctx.mesh, rules),
            batches,
            ctx,
        )
        eager = parallel.gather(eager)
    step = make_train_step(make_loss(tp_model), opt, compile=compile, compile_options={"backend": backend}, **kw)
    state = parallel.shard_state(init_state(model, opt), ctx.mesh, rules)
    hist = []
    # The pass log counts what the post-grad passes did while inductor compiled; a compile-cache hit
    # runs no pass (sharded steps hit since compiler.mesh_key), so this step always compiles (kernels
    # still come from inductor's code cache: force_disable_caches would compile those again too).
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        try:
            for i, b in enumerate(batches):
                torch._dynamo.config.error_on_recompile = i > 0
                state, m = step(state, parallel.split_batch(b, ctx.dp_rank, ctx.dp_world))
                hist.append({k: float(v) for k, v in m.items()})
        finally:
            torch._dynamo.config.error_on_recompile = False
            passes.close()
    full, full_eager = parallel.gather(state), eager
    return {
        "unique_graphs": counters["stats"]["unique_graphs"],
        "recomputed": passes.counts["recomputed"],
        "regathered": passes.counts["regathered"],
        "metric_types": sorted({type(v).__name__ for v in m.values()}),
        "param_dtypes": sorted({str(p.dtype) for p in full.params.values()}),
        "skipped": sum(h.get("skipped", 0.0) for h in hist),
        "vs_eager_loss": max(abs(a["loss"] - b["loss"]) for a, b in zip(eager_hist, hist)),
        "vs_eager_params": max_diff(full.params, full_eager.params),
        "vs_single_loss": max(abs(a["loss"] - b["loss"]) for a, b in zip(ref_hist, hist)),
        "vs_single_params": max_diff(full.params, ref.params),
        "vs_single_opt_state": max_diff(full.opt_state, ref.opt_state),
    }


def s_single(_ctx):
    """One process without torchrun: plain path by default; a 1-device mesh when asked."""
    plain_ctx = parallel.setup({"dp_shard": -1})
    out = {"plain_mesh": plain_ctx.mesh is None, "plain_pg": dist.is_initialized()}
    model = tiny_gpt()
    opt = adamw()
    s0 = init_state(model, opt)
    out["plain_identity"] = parallel.shard_state(s0, plain_ctx.mesh) is s0
    ctx = parallel.setup({"dp_shard": -1}, mesh_on_single_process=True)
    out["mesh_shape"] = dict(ctx.shape)
    out["pg_world"] = dist.get_world_size()
    out["group_threads"] = _group_threads(ctx.mesh)
    from functrain.checkpoint import _dist as ckpt_dist
    from functrain.parallel import gloo

    out["ckpt_group_threads"] = gloo.threads_of(ckpt_dist.new_group())  # the writer's barrier group
    out.update(compare(ctx, steps=5))
    # A second mesh of the same shape: equal to the first by DeviceMesh's rules (shape and axis
    # names), yet its own object with its own groups; its params' layout must be its own.
    mesh2 = parallel.setup({"dp_shard": -1}, mesh_on_single_process=True).mesh
    named = dict(tiny_gpt().named_parameters())
    p1, p2 = parallel.shard_params(named, ctx.mesh), parallel.shard_params(named, mesh2)
    m1, m2 = (next(iter(p.values())).device_mesh for p in (p1, p2))
    out["meshes_equal_not_same"] = m1 == m2 and m1 is not m2
    out["layout_per_mesh_object"] = [parallel.layout_of(p1).mesh is m1, parallel.layout_of(p2).mesh is m2]
    # scan accumulation is a one-process route: on sharded params it is one clear error
    scan = make_train_step(loss_fn_for(tiny_gpt()), sgd(), accum_steps=2, accum_impl="scan", compile=False)
    try:
        scan(parallel.shard_state(init_state(tiny_gpt(), sgd()), ctx.mesh), global_batches(1)[0])
        out["scan_sharded"] = "ran"
    except ValueError as exc:
        out["scan_sharded"] = str(exc)
    parallel.teardown()
    out["pg_after_teardown"] = dist.is_initialized()
    return out


# A suite named "<suite>_exhaustive" (tests marked `exhaustive`) runs the full matrices, and inductor where
# the suite runs aot_eager for speed.
EXHAUSTIVE = "_exhaustive"
MESHES = {"fsdp": {"dp_shard": 2}, "tp": {"dp_shard": 1, "tp": 2}}
UNITS = {"step": (True, loss_fn_for), "blocks": ("blocks", staged_loss_for("full"))}


# With compiled2's fp32 cells without accumulation, these 5 sharded cells hold every value pair of
# (unit, precision, accumulation, mesh) of the full product (tests/test_parallel_dist.py checks it);
# 5 is the fewest that can: bf16 and fp16 each need both units, and fp32 an accumulated cell.
# The full product is tests/test_route_matrix.py's on one process; `pytest -m exhaustive` runs it
# sharded too (20 cells: ~13 min of CI beside another worker).
PAIRWISE = [
    ("step", "bf16", 1, "fsdp"),
    ("step", "fp16", 2, "tp"),
    ("step", "fp32", 2, "fsdp"),
    ("blocks", "bf16", 2, "tp"),
    ("blocks", "fp16", 1, "fsdp"),
]


def matrix_cells(full: bool = False):
    """(name, unit, precision, accum, mesh) of the sharded routes beyond fp32 without accumulation
    (those are the compiled2 scenarios): `PAIRWISE`, or every one when `full`. The matrix2 suite runs
    each against the single-process eager step (Dynamo + AOTAutograd; 3 steps)."""
    cells = (
        [
            (u, p, a, m)
            for u in UNITS
            for p in ("fp32", "bf16", "fp16")
            for a in (1, 2)
            for m in MESHES
            if (p, a) != ("fp32", 1)
        ]
        if full
        else PAIRWISE
    )
    return [(f"matrix_{u}_{p}_accum{a}_{m}", u, p, a, m) for u, p, a, m in cells]


MESHES_2D = {"fsdp_tp": {"dp_shard": 2, "tp": 2}, "hsdp": {"dp_replicate": 2, "dp_shard": 2}}


def two_dim_cells(full: bool = False):
    """(unit, mesh) of the eager4 suite's compiled scenarios: each unit and each 2-D mesh once (~50 s
    of 4 ranks a capture on 2 cores), or every pair when `full`."""
    if full:
        return [(u, m) for u in UNITS for m in MESHES_2D]
    return [("step", "hsdp"), ("blocks", "fsdp_tp")]


def _route_matrix(full: bool):
    """The matrix2 scenarios of `matrix_cells`."""
    out = []
    for name, unit, prec, accum, mesh in matrix_cells(full):
        compile, make_loss = UNITS[unit]
        out.append(
            (
                name,
                MESHES[mesh],
                functools.partial(
                    s_compiled,
                    backend="aot_eager",
                    make_loss=make_loss,
                    compile=compile,
                    precision=prec,
                    accum=accum,
                    steps=3,
                    vs_sharded_eager=False,
                ),
            )
        )
    return out


def suites(full: bool) -> dict:
    """The scenarios of every suite (`full`: the exhaustive variants)."""
    slow_backend = "inductor" if full else "aot_eager"
    return {
        "eager2": [
            ("fsdp", {"dp_shard": 2}, s_fsdp),
            ("tp", {"dp_shard": 1, "tp": 2}, s_tp),
            ("ddp", {"dp_replicate": 2, "dp_shard": 1}, s_ddp),
            ("adamw_fsdp", {"dp_shard": 2}, s_adamw_step),
            ("adamw_tp", {"dp_shard": 1, "tp": 2}, s_adamw_step),
            # traced by dynamo (the "eager" backend: no inductor cost): AdamW's 0-d hyper-parameter
            # tensors in foreach ops on DTensors once failed there ("could not guard on zuf0")
            (
                "adamw_traced_fsdp",
                {"dp_shard": 2},
                lambda ctx: compare(
                    ctx,
                    make_opt=adamw,
                    steps=1,
                    compile=True,
                    compile_options={"backend": "eager"},
                    make_loss=staged_loss_for("full"),
                ),
            ),
            ("fsdp_bias", {"dp_shard": 2}, s_bias),
            ("tp_bias", {"dp_shard": 1, "tp": 2}, s_bias),
            ("tp_is_local", {"dp_shard": 1, "tp": 2}, s_tp_is_local),
            ("accum_fsdp", {"dp_shard": 2}, s_accum),
            ("uneven", {"dp_shard": 2}, s_uneven),
            ("reduce_fsdp", {"dp_shard": 2}, s_reduce_routes),
            ("eval_keys_fsdp", {"dp_shard": 2}, s_eval_and_keys),
            ("eval_keys_tp", {"dp_shard": 1, "tp": 2}, s_eval_and_keys),
            ("bf16_fsdp", {"dp_shard": 2}, s_bf16),
            ("bf16_tp", {"dp_shard": 1, "tp": 2}, s_bf16),
            ("nan_fsdp", {"dp_shard": 2}, s_nan_skip),
            ("nan_tp", {"dp_shard": 1, "tp": 2}, s_nan_skip),
            ("init_fsdp", {"dp_shard": 2}, s_init),
            ("init_tp", {"dp_shard": 1, "tp": 2}, s_init),
            ("stages_fsdp", {"dp_shard": 2}, s_stages),
            ("stages_kept_fsdp", {"dp_shard": 2}, lambda ctx: s_stages(ctx, remat="none")),
            ("stages_tp", {"dp_shard": 1, "tp": 2}, s_stages),
            ("stages_bf16_fsdp", {"dp_shard": 2}, lambda ctx: s_stages(ctx, precision="bf16", steps=10)),
            ("sample_fsdp", {"dp_shard": 2}, s_sample),
            ("live_fsdp", {"dp_shard": 2}, s_gathered_live),
            ("live_kept_fsdp", {"dp_shard": 2}, lambda ctx: s_gathered_live(ctx, remat="none")),
            ("sample_tp", {"dp_shard": 1, "tp": 2}, s_sample),
        ],
        "compiled2": [
            # the whole-model gather and the staged one-graph step: inductor in the exhaustive suite
            # (each a cold inductor compile on both ranks: ~100 s of CI on 2 cores); the collectives they
            # trace are the same under aot_eager, and inductor lowers those in compiled_kept_fsdp
            ("compiled_fsdp", {"dp_shard": 2}, lambda ctx: s_compiled(ctx, slow_backend)),
            ("compiled_tp", {"dp_shard": 1, "tp": 2}, lambda ctx: s_compiled(ctx, "aot_eager")),
            (
                "compiled_stages_fsdp",
                {"dp_shard": 2},
                lambda ctx: s_compiled(ctx, slow_backend, make_loss=staged_loss_for("full")),
            ),
            # kept blocks under inductor: the post-grad passes (functrain.compiler.recompute's cheap activations
            # recomputed after the forward, compiler.regather's second gathers) rewrite this step's graph;
            # the one inductor compile of a sharded step in CI
            (
                "compiled_kept_fsdp",
                {"dp_shard": 2},
                lambda ctx: s_compiled(ctx, "inductor", make_loss=staged_loss_for("none")),
            ),
            (
                "blocks_fsdp",
                {"dp_shard": 2},
                lambda ctx: s_compiled(ctx, "aot_eager", make_loss=staged_loss_for("full"), compile="blocks"),
            ),
            (
                "blocks_kept_fsdp",
                {"dp_shard": 2},
                lambda ctx: s_compiled(ctx, "aot_eager", make_loss=staged_loss_for("none"), compile="blocks"),
            ),
            (
                "blocks_tp",
                {"dp_shard": 1, "tp": 2},
                lambda ctx: s_compiled(ctx, "aot_eager", make_loss=staged_loss_for("full"), compile="blocks"),
            ),
        ],
        "matrix2": _route_matrix(full),  # (a launch of its own: ~3.5 min of CI beside another worker, 20 cells ~13)
        "eager4": [
            ("fsdp_tp", {"dp_shard": 2, "tp": 2}, s_fsdp),
            ("reduce_fsdp4", {"dp_shard": 4}, s_reduce_routes),
            ("reduce_hsdp", {"dp_replicate": 2, "dp_shard": 2}, s_reduce_routes),
            ("reduce_fsdp_tp", {"dp_shard": 2, "tp": 2}, s_reduce_routes),
            ("hsdp", {"dp_replicate": 2, "dp_shard": 2}, s_fsdp),
            ("stages_fsdp_tp", {"dp_shard": 2, "tp": 2}, s_stages),
            ("init_fsdp_tp", {"dp_shard": 2, "tp": 2}, s_init),
            ("init_hsdp", {"dp_replicate": 2, "dp_shard": 2}, s_init),
            ("stages_hsdp", {"dp_replicate": 2, "dp_shard": 2}, s_stages),
            ("sample_fsdp_tp", {"dp_shard": 2, "tp": 2}, s_sample),
            # the compiled units on the 2-D meshes (Dynamo + AOTAutograd, against one process)
            *[
                (
                    f"compiled_{unit}_{mesh}",
                    MESHES_2D[mesh],
                    functools.partial(
                        s_compiled,
                        backend="aot_eager",
                        make_loss=UNITS[unit][1],
                        compile=UNITS[unit][0],
                        steps=3,
                        vs_sharded_eager=False,
                    ),
                )
                for unit, mesh in two_dim_cells(full)
            ],
        ],
        "single": [("single", None, s_single)],
    }


OUTDIR = ""  # the suite's output directory (shared by the ranks), set by main
# Every collective's timeout (torch's default is 30 minutes): a scenario that fails on some ranks
# fails on the others after this long (gloo's timeout error) instead of hanging the whole suite,
# and the ranks meet again in the next scenario's mesh. Far above any wait here (a cold compile).
COLLECTIVE_TIMEOUT_S = 300


def _group_threads(mesh) -> dict:
    """{axis: gloo worker threads} of every group of the mesh, and of the default group ("world")."""
    from functrain.parallel import gloo

    out = {name: gloo.threads_of(mesh.get_group(i)) for i, name in enumerate(mesh.mesh_dim_names)}
    return {**out, "world": gloo.threads_of(dist.group.WORLD)}


def _group_timeouts(mesh) -> dict:
    """{axis: collective timeout in seconds} of the mesh's groups of more than one rank."""
    groups = {name: mesh.get_group(i) for i, name in enumerate(mesh.mesh_dim_names)}
    return {
        name: g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for name, g in groups.items()
        if g.size() > 1
    }


def main(outdir: str, suite: str, only: list[str]) -> None:
    global OUTDIR
    OUTDIR = outdir
    results = {}
    t0 = time.monotonic()
    for name, mesh_cfg, fn in suites(suite.endswith(EXHAUSTIVE))[suite.removesuffix(EXHAUSTIVE)]:
        if only and name not in only:
            continue
        # a rank that dies names where in its failure's output tail; the time says where a suite's
        # minutes go
        print(f"scenario {name} at {time.monotonic() - t0:.1f} s", flush=True)
        try:
            ctx = parallel.setup(mesh_cfg, timeout_s=COLLECTIVE_TIMEOUT_S) if mesh_cfg is not None else None
            results[name] = {"result": fn(ctx)}
            if ctx is not None and ctx.mesh is not None:
                results[name]["group_timeouts"] = _group_timeouts(ctx.mesh)
                results[name]["group_threads"] = _group_threads(ctx.mesh)
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = {"error": traceback.format_exc()}
            # now, not only in the results file: a rank left waiting for this one shows it too
            print(f"scenario {name} raised:\n{results[name]['error']}", flush=True)
    print(f"suite {suite} done at {time.monotonic() - t0:.1f} s", flush=True)
    r = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(outdir, f"{suite}_rank{r}.json"), "w") as f:
        json.dump(results, f, indent=1)
    parallel.teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
