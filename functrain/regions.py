"""`compile="regions"`: the one-graph train step with the block compiled once.

In the one-graph step (`compile="step"`) every block is inlined, so Dynamo traces, AOTAutograd
differentiates and inductor lowers and builds kernels for each block again: cold compile time grows
with depth (bench/compile_depth.py). Here the whole step is still ONE graph, but the blocks are calls
of one `torch.compiler.nested_compile_region` (`Stage.shared`, the computation every block runs on
its own params and index): AOTAutograd makes one forward and one backward subgraph of it, and
inductor compiles each subgraph once and calls it per block. The same goes for the optimizer's
per-block work (`functrain.update_groups` with `region` as its piece: a block group's squared grad
norm and its update). The gradients come from `torch.autograd.grad` traced into the graph
(`torch._dynamo.config.trace_autograd_ops`): `torch.func` transforms have no rule for the region's
higher-order op (invoke_subgraph), and AOTAutograd does.

What is not flat yet: Dynamo reuses a region's trace for a later call only when the call has no
side effects, and the GPT and Llama block stages run their nn.Module through
`torch.func.functional_call`, whose tensor swap on nested submodules is one. So Dynamo still traces
every block call (then finds the same body); the update regions are reused (their inputs are passed
as detached views: Dynamo guards the step's own input tensors by identity). Measured (2-core AMD
EPYC, width-64 GPT, aot_eager, 6 layers): running the block through `torch._dynamo.nonstrict_trace`
hides the swap and Dynamo then reuses the block's trace, but the first step went from 30.9 to only
29.9 s, so it is not used; the walks of the optimizer state around each update region cost Dynamo
more (optree's polyfill and a user object per spec: ~2/3 of its time), and plain-Python walks
(`update_groups._Split`, `functrain.tree`) took the first step to 24.1 s (in that script; another
timed the same 6-layer step at 45-50 s on this host a day later, whichever walks it ran: compare
within one script only).

Donation: a region cannot write into its inputs, so each block's new params and moments are
copied back into the state's buffers after its update region returns. As `torch._foreach_copy_`
these copies were inductor's largest depth-growing cost: lowered as one pointwise node per tensor
(params and both AdamW moments: 36 per GPT block), all depending on the region's output, so the
fusion search compared them pairwise (`Scheduler.__init__` 10.5 -> 30.5 s from 2 to 6 layers, two
runs side by side).
`write_into` makes a block group's copies (params and moments) one opaque op
(`functrain::copy_into`, a `torch._foreach_copy_` inductor does not lower); inductor's reinplace
pass then writes it straight into the step's input buffers (tests/test_compile_regions.py checks
the generated code), and the fusion search no longer grows (3.9 -> 7.4 s). Measured (2-core AMD EPYC, width 64, caches
off, `OMP_NUM_THREADS=1 python bench/compile_depth.py --compile regions --layers 2,12
[--no-donate]`, one after the other): 72.4 / 120.1 s at 2 / 12 layers (ratio 1.66; an op per
donated node then, one per group now: 58.9 / 108.3 s, 1.84, half an hour later) against 79.1 /
158.4 s (2.00) with the old copies and 51.7 / 101.7 s (1.97) with `donate=False`; steady
step 49 / 51 / 52 ms at 12 layers, and the same losses bit for bit (old vs new copies, one process,
6 layers). What still grows, per added layer (2 vs 6 layers, `compilation_time_metrics`): Dynamo's
trace ~2.5 s, inductor's lowering and wrapper codegen of the outer graph ~3 s. Most of Dynamo's part
is the tree walks around each block group's update region (its state split, detached, donated):
`functrain.tree`'s walks are stack loops that take a param dict whole since, and Dynamo steps through
393k bytecodes at 6 layers instead of 534k; `bench/compile_depth.py --compile regions --layers 2,12`,
three pairs run one after the other against the recursive walks: 108.9-122.9 s at 12 layers against
129.5-134.4 s, 58.0-64.8 s at 2 against 61.7-71.0 (ratio 1.83-2.10 against 1.82-2.15; ~12% and
~8% faster). This host's timings moved by up to 40% within the hour: compare pairs only.

Two torch 2.13 bugs sit on this route, and this module works around both (`tracing()`,
`INDUCTOR_OPTIONS`; tests/test_compile_regions.py fails without either):

1. Dynamo: a block call served from the region's reuse cache gets fake outputs that are autograd
   leaves (`stamp_out_subgraph` makes them with `torch.empty_strided(..., requires_grad=True)`), so
   the traced `autograd.grad` no longer reaches the earlier blocks: from the third block on,
   "The differentiated Tensor at index 0 appears to not have been used in the graph". While a step
   of this kind traces, `tracing()` links those fake outputs to the call's inputs that require grad
   with a zero-valued sum (the idea of pytorch#178777, not in 2.13's build). It changes only the fake
   tensors Dynamo reasons with, not the graph.
2. Inductor: the block's forward subgraph returns its input as a saved tensor for the backward (an
   output aliasing an operand), and the outer graph's memory planner does not see the alias: it
   frees the input buffer after the call and reuses it, e.g. for the loss's cotangent, so the last
   block's backward reads a clobbered input. The gradients come out wrong (measured: off by 50-100%
   of their size for everything before the last block's MLP; exact under aot_eager) whenever the
   step has another use for a buffer of that shape, as soon as the loss is an output. Compiled with
   `allow_buffer_reuse=False` the buffers are freed by reference count instead of recycled by the
   planner, and the gradients equal the inlined step's.

Scope: one process (plain tensors), activations kept (remat "none"), any precision, accumulation by
`accum_impl="unroll"`. Sharded params, recomputed blocks and the scan accumulation raise one error
naming the alternative (`compile="step"` or `"blocks"`).

Example:
    >>> loss_fn = gpt.make_loss_fn(template, staged=True)            # stages with a shared block
    >>> step = make_train_step(loss_fn, optim.adamw(3e-4), compile="regions")
    >>> state, metrics = step(state, batch)                          # one graph, block compiled once
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable

import torch

from functrain import tree as tree_lib

__all__ = ["INDUCTOR_OPTIONS", "region", "region_loss", "tracing", "write_into"]

# The inductor settings a step with block regions compiles with (bug 2 of the module docstring): set
# by `tracing()` for the calls of the step, so they hold whatever `torch.compile` options or mode the
# caller passes.
INDUCTOR_OPTIONS = {"allow_buffer_reuse": False}

Params = dict[str, torch.Tensor]


def region_loss(loss_fn: Callable) -> Callable:
    """`loss_fn` (a staged loss) whose gradients run its blocks as calls of one compiled region.

    Args:
      loss_fn: a `functrain.remat.staged_loss` (e.g. `gpt.make_loss_fn(template, staged=True)`)
        whose blocks all carry the same `Stage.shared` function, with policy "none".

    Returns:
      A loss function with the same call (the plain composition, for eval) and a `value_and_grad
      (params, batch, key, *, loss_scale=None) -> (loss, aux, grads)` that `functrain.step` traces
      into the one step graph: leaves that require grad, the embedding, each block a call of the
      region, the head, and `torch.autograd.grad` of `loss * loss_scale`. Its
      `value_and_grad_sharded` raises (one process only).

    Raises:
      ValueError: `loss_fn` has no stages, its blocks share no computation, or it recomputes
        blocks.

    Example:
      >>> fast = region_loss(gpt.make_loss_fn(template, staged=True))
      >>> loss, aux, grads = fast.value_and_grad(params, batch, key)   # eager: same numbers
    """
    stages = getattr(loss_fn, "stages", None)
    if stages is None:
        raise ValueError(
            "compile='regions' runs the blocks of a staged loss as one compiled region, and this loss has no "
            "stages: build it with functrain.remat.staged_loss (e.g. gpt.make_loss_fn(template, staged=True)), "
            "or use compile=True"
        )
    embed, blocks, head = stages
    if not blocks or blocks[0].shared is None or any(b.shared is not blocks[0].shared for b in blocks):
        raise ValueError(
            "compile='regions' needs every block stage to carry the same Stage.shared function (one region "
            "for all blocks); build the blocks with functrain.models.lm.repeated_stages, or use compile=True"
        )
    if any(loss_fn.recompute):
        raise ValueError(
            "compile='regions' keeps every block's activations (remat 'none'); for recomputed blocks use "
            "compile=True (one graph, blocks inlined) or compile='blocks'"
        )
    from functrain.remat import _loss_and_aux, _seed  # (remat imports torch's custom-op machinery)

    names = tuple(blocks[0].own(dict.fromkeys(blocks[0].names)))  # a block's param names, prefix stripped
    shared = blocks[0].shared

    @torch.compiler.nested_compile_region
    def block(h, key, index, *weights):
        """Any block: `Stage.shared` on its own params (positional, in `names` order) at `index`."""
        return shared(dict(zip(names, weights)), h, key, index)

    def value_and_grad(params: Params, batch, key, *, loss_scale=None):
        """(loss, aux, grads of loss * loss_scale) with the blocks as region calls, by autograd."""
        order = list(params)
        leaves = {n: params[n].detach().requires_grad_(True) for n in order}
        with torch.enable_grad():
            loss, aux = forward(leaves, batch, key)
            seeded = loss if loss_scale is None else loss * _seed(loss, loss_scale)
        got = torch.autograd.grad(seeded, [leaves[n] for n in order], allow_unused=True)
        grads = {n: torch.zeros_like(params[n]) if g is None else g for n, g in zip(order, got)}
        return loss.detach(), {k: v.detach() for k, v in aux.items()}, grads

    def value_and_grad_sharded(params, batch, key, *, layout, loss_scale=None):
        """Not on this route: one clear error."""
        raise ValueError(
            "compile='regions' runs on one process (plain tensors); for sharded params use compile=True (one "
            "graph, per-block gathers) or compile='blocks'"
        )

    def forward(p: Params, batch, key):
        """(loss, aux): the embedding, each block a call of the region, the head (also the eval loss)."""
        h = embed.fn(embed.params(p), batch, key)
        for b in blocks:
            own = b.own(p)
            index = torch.tensor(b.index, dtype=torch.int64, device=h.device)
            h = block(h, key, index, *(own[n] for n in names))
        return _loss_and_aux(head.fn(head.params(p), h, batch, key))

    forward.value_and_grad = value_and_grad  # type: ignore[attr-defined]
    forward.value_and_grad_sharded = value_and_grad_sharded  # type: ignore[attr-defined]
    forward.blocks = loss_fn.blocks  # type: ignore[attr-defined]
    return forward


_patch_lock = threading.Lock()


@contextlib.contextmanager
def tracing():
    """The settings under which a step with block regions is traced: enter it around every call.

    Turns on `torch._dynamo.config.trace_autograd_ops` (the step's `torch.autograd.grad` is traced
    into the graph), sets `INDUCTOR_OPTIONS` (bug 2 of the module docstring) and, for the duration,
    links the fake outputs of reused region calls to their inputs (bug 1). They matter only while
    the step compiles (the first call); on later calls they cost a few attribute writes.

    Returns:
      A context manager.

    Example:
      >>> with regions.tracing():
      ...     state, metrics = compiled_step(state, batch)
    """
    import torch._inductor.config

    with torch._dynamo.config.patch(trace_autograd_ops=True), torch._inductor.config.patch(INDUCTOR_OPTIONS), \
            _reuse_keeps_autograd():
        yield


@contextlib.contextmanager
def _reuse_keeps_autograd():
    """While open, Dynamo's stamped-out region calls have fake outputs that reach their inputs."""
    try:
        import torch._dynamo.variables.invoke_subgraph as isg
    except ImportError:  # (another torch layout: nothing to mend)
        yield
        return
    original = getattr(isg, "stamp_out_subgraph", None)
    if original is None or not hasattr(isg, "get_flat_proxies") or getattr(original, "_functrain", False):
        yield
        return
    with _patch_lock:
        isg.stamp_out_subgraph = functools.partial(_stamp_out_linked, original, isg)
        isg.stamp_out_subgraph._functrain = True  # type: ignore[attr-defined]
        try:
            yield
        finally:
            isg.stamp_out_subgraph = original


def _stamp_out_linked(original, isg, tx, fingerprint, cached):
    """`stamp_out_subgraph` whose fake outputs that require grad are `empty + 0 * sum(inputs)`."""
    inputs = [p.node.meta.get("example_value") for p in isg.get_flat_proxies(fingerprint)]
    inputs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    empty_strided = torch.empty_strided

    def linked(*args, requires_grad=False, **kwargs):
        """A fake output; one that requires grad hangs off the call's inputs in the autograd graph."""
        out = empty_strided(*args, **kwargs)
        if not (requires_grad and inputs):
            return out.requires_grad_(requires_grad)
        return out + sum(t.sum() * 0 for t in inputs).to(out.dtype)

    torch.empty_strided = linked  # stamp_out_subgraph's only call of it makes the fake outputs
    try:
        return original(tx, fingerprint, cached)
    finally:
        torch.empty_strided = empty_strided


def region(fn: Callable, out_like: Callable | None = None) -> Callable:
    """`fn` as a `torch.compiler.nested_compile_region` (what `update_groups` wraps its phases in).

    Dynamo reuses a region's trace for a later call only when the outputs are tensors, so with
    `out_like` the region returns its output's leaves and the call rebuilds the tree from the
    structure of `out_like(*args)` (which must match `fn`'s output). A region may not return one of
    its inputs either (higher-order ops do not alias): such an output comes back as a copy.

    Args:
      fn: a function of pytrees of tensors that does not write into its inputs.
      out_like: `out_like(*args)` -> a tree shaped like `fn(*args)`'s output (e.g. the inputs it
        updates); None: `fn` returns a tensor or the tree as it is.

    Returns:
      The region: traced and compiled once per input signature, called as often as needed.

    Example:
      >>> update = region(update_phase, out_like=lambda p, g, s, norm, ok: (p, s, norm))
    """

    @functools.wraps(fn)
    def unaliased(*args):
        out, spec = tree_lib.flatten(fn(*args))
        ins = {id(x) for x in tree_lib.leaves(args) if isinstance(x, torch.Tensor)}
        out = [x.clone() if isinstance(x, torch.Tensor) and id(x) in ins else x for x in out]
        return spec.unflatten(out) if out_like is None else tuple(out)

    body = torch.compiler.nested_compile_region(unaliased)
    if out_like is None:
        return body

    @functools.wraps(fn)
    def call(*args):
        return tree_lib.flatten(out_like(*args))[1].unflatten(body(*args))

    return call


@torch.library.custom_op("functrain::copy_into", mutates_args=("dst",))
def _copy_into(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for each i: one opaque call in a compiled graph."""
    torch._foreach_copy_(dst, src)


@_copy_into.register_fake
def _(dst, src):
    """Nothing to compute: the op writes into `dst`."""
    return None


def write_into(old, new):
    """Copies every leaf of `new` into the matching leaf of `old`: donation after a region returns.

    In a compiled graph the copies are ONE call of the opaque op `functrain::copy_into` (a
    `torch._foreach_copy_`), which inductor writes straight into `old`'s buffers when they are the
    graph's inputs, instead of a pointwise node per tensor for its fusion search to weigh (module
    docstring, "Donation"). Eagerly it is `torch._foreach_copy_`.

    Args:
      old: a pytree of tensors, written into.
      new: a pytree of the same structure, shapes and dtypes.

    Returns:
      `old`, its leaves now holding `new`'s values.

    Example:
      >>> p = regions.write_into(state.params, new_params)   # state.params' buffers, new values
    """
    pairs = tree_lib._copy_pairs(old, new)
    if pairs:
        _copy_into([o for o, _ in pairs], [n for _, n in pairs])
    return old
