"""Activation checkpointing ("remat") that works inside the compiled functional train step.

Internals: docs/internals.md "functrain.step.staged".

Example:
    >>> loss_fn = staged_loss(embed, blocks, head, policy="full")
    >>> loss, aux = loss_fn(params, batch, key)                 # plain composition (eval)
    >>> loss, aux, grads = loss_fn.value_and_grad(params, batch, key)
    >>> step = make_train_step(loss_fn, optim.adamw(3e-4))      # uses value_and_grad
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from functrain import compiler
from functrain import tree as tree_lib
from functrain.compiler.marks import mark_forward_done, remat_barrier
from functrain.config_checks import parse_policy, recomputed_blocks
from functrain.nn.model_state import loss_and_aux

__all__ = ["Stage", "StagedLoss", "staged_loss"]


Params = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Stage:
    """One piece of a staged model: the parameters it reads and a pure function of them.

    Args:
      names: the names (keys of the full params dict) the stage reads; it is differentiated with
        respect to exactly these.
      fn: a pure function whose first argument is `{name: tensor}` for `names`. Its other
        arguments depend on the stage's role in `staged_loss`:
          embed  `fn(p, batch, key) -> h`
          block  `fn(p, h, key, *side) -> h` (same shape in and out is not required; `side`: the
                 staged loss's `side(batch)`, usually nothing)
          head   `fn(p, h, batch, key) -> loss` or `(loss, aux dict)`
        `key` is the step's RNG key (or None); a stage derives its own dropout keys from it.
      shared: for a block, optionally the computation every block shares:
        `shared(own, h, key, index, *side) -> h` with `own` its params named without `prefix` and `index`
        the block's position as a 0-d int64 tensor; `shared(stage.own(p), h, key, tensor(index))`
        must equal `fn(p, h, key)`. Every block of a model passing the same `shared` object lets
        `compile_stages` compile one block graph for all of them (no block graph per block).
      prefix: stripped from `names` to make `own` (e.g. "blocks.3.").
      index: the block's position (what `shared` gets as `index`).
      rows: the position tables among `names` (e.g. learned position embeddings), read only at the
        batch's token positions through `functrain.parallel.context.position_rows`: on sharded params
        under context parallelism, the layout hands `fn` this rank's rows of them on the cp axis
        instead of the whole table (`Layout.gather`), so no rank holds a table of the whole sequence.

    Example:
      >>> block = Stage(("w0",), lambda p, h, key: h + torch.tanh(h @ p["w0"]))
    """

    names: tuple[str, ...]
    fn: Callable
    shared: Callable | None = None
    prefix: str = ""
    index: int = 0
    rows: tuple[str, ...] = ()

    def params(self, params: Params) -> Params:
        """The sub-dict of `params` this stage reads."""
        return {n: params[n] for n in self.names}

    def own(self, params: Params) -> Params:
        """The sub-dict of `params` this stage reads, named without `prefix` (what `shared` takes)."""
        k = len(self.prefix)
        return {n[k:]: params[n] for n in self.names}


def _add_grads(total: Params, grads: Params) -> None:
    """Adds `grads` into `total` in place of the dict (a name seen before is summed)."""
    for name, g in grads.items():
        total[name] = g if name not in total else total[name] + g


def cotangent_seed(loss: torch.Tensor, loss_scale) -> torch.Tensor:
    """The head's output cotangent: ones, or `loss_scale` in the loss's dtype and shape."""
    if loss_scale is None:
        return torch.ones_like(loss)
    scale = torch.as_tensor(loss_scale, device=loss.device)
    return scale.to(loss.dtype).expand(loss.shape)


class StagedLoss:
    """A loss over stages (embedding, blocks, head) with its own gradient routes: the loss contract's type.

    `functrain.step` recognises it by type (no attribute probing) and takes its routes:
    `value_and_grad` (blocks recomputed in the backward as `recompute` says), on sharded params
    `value_and_grad_sharded` and `apply_sharded` (each stage gathered just before it runs), and
    under `compile="blocks"` `compile_stages` (each stage its own compiled graph). Called, it is
    the plain composition `(params, batch, key) -> (loss, aux)`, so it is also an ordinary loss
    function (eval, `torch.func.grad_and_value`). Build one with `staged_loss`.

    Attributes:
      embed, blocks, head: the stages (`blocks` a tuple).
      recompute: per block, whether its backward recomputes it (from the policy).
      compiled: whether each stage runs as its own compiled graph (`compile_stages`).
      side: optional `side(batch) -> tuple`: what every block gets after its key (e.g. packed rows'
        document layout, `functrain.models.lm.Packed`), computed from the batch on every rank.

    Example:
      >>> loss_fn = staged_loss(embed, blocks, head, policy="full")
      >>> loss, aux = loss_fn(params, batch, key)
      >>> loss, aux, grads = loss_fn.value_and_grad(params, batch, key)
    """

    def __init__(self, embed: Stage, blocks: Sequence[Stage], head: Stage, policy: Any, run, side=None):
        self.embed, self.blocks, self.head = embed, tuple(blocks), head
        self.policy = policy
        self.side = side
        self.recompute = tuple(recomputed_blocks(policy, len(self.blocks)))
        self._run = run
        self.frozen: Params = {}  # params the stages read and nothing differentiates (`with_frozen`)

    def with_frozen(self, frozen: Params) -> StagedLoss:
        """This loss with `frozen` params beside the ones it is given (`TrainState.frozen`, a LoRA base):
        every stage reads `{**frozen, **params}`, gradients come back for `params` alone (a frozen
        param's gradient is never reduced, and the compiled step drops its computation)."""
        other = copy.copy(self)
        other.frozen = frozen
        return other

    @property
    def compiled(self) -> bool:
        """Whether each stage runs as its own compiled graph."""
        return self._run.compiled

    @property
    def runner(self):
        """The stage functions (`embed`, `blocks`, `head`) and the `vjp` that differentiates them
        (traced, or compiled stage by stage): what a pipeline rank runs its stages with."""
        return self._run

    def side_of(self, batch) -> tuple:
        """What every block gets after its key for `batch` (`side`): () without one."""
        return () if self.side is None else tuple(self.side(batch))

    def _compose(self, params: Params, batch, key, gather=lambda p, rows: p) -> tuple[torch.Tensor, dict]:
        """embed, every block, head, each on `gather` of its own params (no recomputation)."""
        run, side = self._run, self.side_of(batch)
        params = {**self.frozen, **params}
        h = run.embed(gather(self.embed.params(params), self.embed.rows), batch, key)
        for block, fn in zip(self.blocks, run.blocks):
            h = fn(gather(block.params(params), block.rows), h, key, *side)
        return run.head(gather(self.head.params(params), self.head.rows), h, batch, key)

    def __call__(self, params: Params, batch, key) -> tuple[torch.Tensor, dict]:
        """The loss: embed, every block, head (no recomputation, no gradients)."""
        return self._compose(params, batch, key)

    def value_and_grad(self, params: Params, batch, key, *, loss_scale=None):
        """`(loss, aux, grads)`: the loss (detached, never scaled), the aux dict, and the gradients of
        `loss * loss_scale` (of `loss` when `loss_scale` is None) in `params`' key order, recomputing
        the policy's blocks in the backward. A parameter read by several stages (a tied embedding and
        head) gets the sum of their gradients; one read by none gets zeros."""
        if self.policy == "none" and not self._run.compiled:
            return _plain_value_and_grad(self, params, batch, key, loss_scale)
        return _staged_value_and_grad(self, params, batch, key, loss_scale)

    def forward_blocks(
        self, indices: Sequence[int], h: torch.Tensor, key, params_of: Callable, *, grad: bool = True, side: tuple = ()
    ) -> tuple[torch.Tensor, list]:
        """Runs the blocks at `indices` in order from `h`, keeping what their backward needs.

        The forward half of the engine, shared by `value_and_grad` and a pipeline rank (which runs
        its own slice of the blocks). A recomputed block (`recompute`) keeps only its input; a kept
        block keeps its vjp closure (its activations).

        Args:
          indices: block positions, in forward order.
          h: the first block's input.
          key: the step's RNG key (or None).
          params_of: `params_of(stage, after=None)` gives a stage's params to compute with (its
            gather when sharded; `after`: a tensor the gather must wait for).
          grad: False runs the blocks under `torch.no_grad()` and keeps nothing (eval).
          side: what every block gets after its key (`side_of(batch)`).

        Returns:
          `(h, saved)`: the last block's output and, per block, what `backward_blocks` takes.

        Example:
          >>> h, saved = loss_fn.forward_blocks(range(4), h, key, lambda s, after=None: s.params(params))
        """
        run, saved = self._run, []
        for i in indices:
            block, fn = self.blocks[i], run.blocks[i]
            if not grad or self.recompute[i]:  # keep only the input (recomputed in the backward)
                saved.append(h if grad else None)
                with torch.no_grad():
                    h = fn(params_of(block), h, key, *side)
            else:
                h, block_vjp = run.vjp(fn, (params_of(block), h), key, *side)
                saved.append(block_vjp)
        return h, saved

    def backward_blocks(
        self,
        indices: Sequence[int],
        saved: list,
        cotangent: list,
        key,
        params_of: Callable,
        add: Callable,
        side: tuple = (),
    ) -> torch.Tensor:
        """Pulls a cotangent back through the blocks at `indices` (as given to `forward_blocks`).

        The backward half of the engine: blocks in reverse, a recomputed block run again under its
        vjp from its saved input once `g` exists (behind `remat_barrier` in a traced graph, so the
        compiler cannot merge it into the forward). Each entry of `saved` is freed as soon as its
        block is done.

        Args:
          indices: the block positions given to `forward_blocks`.
          saved: what `forward_blocks` returned (emptied here).
          cotangent: `[g]`, the cotangent of the last block's output, in a list this method empties: the
            caller keeps no reference, so `g` is freed as soon as the last block has used it (a
            variable of the caller's would hold one activation through the whole backward).
          key: the step's RNG key (the forward's, so a recomputed block draws the same dropout masks).
          params_of: as for `forward_blocks`.
          add: `add(stage, grads)` takes each block's gradients (a dict over its names).
          side: as for `forward_blocks` (a recomputed block runs again with it).

        Returns:
          The cotangent of the first block's input.

        Example:
          >>> g = loss_fn.backward_blocks(range(4), saved, [g], key, params_of, add)
        """
        run, indices, g = self._run, list(indices), cotangent.pop()
        for k in reversed(range(len(indices))):
            i = indices[k]
            block_vjp, saved[k] = saved[k], None  # free the closure / saved input as soon as the block is done
            if self.recompute[i]:  # block_vjp is the block's saved input: recompute it once g exists
                h_in = remat_barrier(block_vjp, g) if run.barrier else block_vjp
                _, block_vjp = run.vjp(run.blocks[i], (params_of(self.blocks[i], after=g), h_in), key, *side)
            g_block, g = block_vjp(g)
            del block_vjp  # (the closure holds the block's gathered parameters)
            add(self.blocks[i], g_block)
        return g

    def value_and_grad_sharded(self, params: Params, batch, key, *, layout, loss_scale=None):
        """`value_and_grad` over sharded params, each stage gathered just before it runs (module docstring)."""
        return _staged_value_and_grad(self, params, batch, key, loss_scale, layout=layout)

    def apply_sharded(self, params: Params, batch, key, *, layout):
        """The loss over sharded params, each stage gathered just before it runs (no gradients)."""
        with torch.no_grad():
            return self._compose(params, batch, key, gather=layout.gather)

    def compile_stages(self, options: dict | None = None) -> StagedLoss:
        """This loss with each stage its own compiled graph, one block graph shared by every block.

        For `make_train_step(..., compile="blocks")`: the stages run as separate compiled functions
        (embedding, block, head), called in order by eager Python, with gradients by autograd through
        the compiled graphs. Every block runs the same compiled graph (its `Stage.shared`
        computation), so the number of graphs does not grow with depth; the price is that the
        compiler cannot fuse across stage boundaries.

        Args:
          options: extra keyword arguments for `torch.compile` (always fullgraph, static shapes).

        Returns:
          A `StagedLoss` with the same routes, gradients equal to this one's to float rounding.

        Raises:
          ValueError: the blocks do not all carry the same `Stage.shared` function.

        Example:
          >>> fast = loss_fn.compile_stages()
          >>> loss, aux, grads = fast.value_and_grad(params, batch, key)
        """
        run = _Compiled(self.embed, self.blocks, self.head, options)
        return StagedLoss(self.embed, self.blocks, self.head, self.policy, run, self.side)


def staged_loss(
    embed: Stage, blocks: Sequence[Stage], head: Stage, *, policy: Any = "full", side: Callable | None = None
) -> StagedLoss:
    """A loss over stages that brings its own gradient routes, recomputing blocks in the backward.

    Args:
      embed: the first stage, `fn(p, batch, key) -> h`.
      blocks: the repeated stages, `fn(p, h, key) -> h`, applied in order.
      head: the last stage, `fn(p, h, batch, key) -> loss` or `(loss, aux)`.
      policy: which blocks to recompute (see `parse_policy`): "none", "full" or an int N (every
        N-th block). Blocks not recomputed keep their activations from the forward.
      side: optional `side(batch) -> tuple` of what every block gets after its key (not
        differentiated), e.g. packed rows' document layout: blocks are then `fn(p, h, key, *side)`.

    Returns:
      A `StagedLoss`: called, the plain composition `(params, batch, key) -> (loss, aux)`; its
      `value_and_grad(params, batch, key, *, loss_scale=None) -> (loss, aux, grads)` is what
      `functrain.step` uses in place of its own `grad_and_value`. With policy "none" that is
      `torch.func.grad_and_value` of the composition.

    Raises:
      ValueError: for a bad policy.

    Example:
      >>> loss_fn = staged_loss(embed, blocks, head, policy=2)    # recompute blocks 1, 3, 5, ...
      >>> loss, aux, grads = loss_fn.value_and_grad(params, batch, key, loss_scale=torch.tensor(1024.0))
    """
    blocks = tuple(blocks)
    return StagedLoss(embed, blocks, head, parse_policy(policy), _Traced(embed, blocks, head), side)


class _Traced:
    """Stages as plain calls, differentiated by `torch.func.vjp` (eager, or traced into one graph)."""

    compiled = False
    barrier = True  # in one traced graph, order the recomputation after the cotangent (see above)

    reshard = True  # mark the forward's end for compiler.regather (kept blocks gathered again)

    def __init__(self, embed: Stage, blocks: Sequence[Stage], head: Stage):
        self.embed = embed.fn
        self.blocks = [b.fn for b in blocks]
        self.head = lambda p, h, batch, key: loss_and_aux(head.fn(p, h, batch, key))

    @staticmethod
    def vjp(fn, primals: tuple, *rest, has_aux: bool = False):
        """`torch.func.vjp` of `fn(*primals, *rest)` with respect to `primals`."""
        return torch.func.vjp(lambda *xs: fn(*xs, *rest), *primals, has_aux=has_aux)


class _Compiled:
    """Stages as separately compiled graphs (one for all blocks), differentiated by autograd.

    `torch.func.vjp` cannot differentiate a compiled function from eager code (Dynamo: "Calling
    torch.func.grad(compiled_fn) function from eager mode is not supported"), but autograd can:
    AOTAutograd compiles a forward and a backward graph, the forward saving what the backward needs.
    So a stage's vjp here runs its compiled function on fresh leaves that require grad and returns
    `torch.autograd.grad` through that as the vjp function. Graphs: one per stage function and grad
    mode (a recomputed block's no-grad forward is a second block graph), none per block.
    The stages run in program order from eager code, so no `remat_barrier` is needed.
    """

    compiled = True
    barrier = False
    reshard = False  # (autograd saves a kept block's gathered params: no graph to rewrite)

    def __init__(self, embed: Stage, blocks: Sequence[Stage], head: Stage, options: dict | None):
        if blocks and (blocks[0].shared is None or any(b.shared is not blocks[0].shared for b in blocks)):
            raise ValueError(
                "compile='blocks' needs every block stage to carry the same Stage.shared function (one "
                "compiled graph for all blocks); build the blocks with functrain.models.stages.repeated_stages, "
                "or compile the whole step (compile=True)"
            )
        head_fn = head.fn
        self.embed = compiler.graph(embed.fn, options)
        self.head = compiler.graph(lambda p, h, batch, key: loss_and_aux(head_fn(p, h, batch, key)), options)
        if blocks:
            block = compiler.graph(blocks[0].shared, options)
            self.blocks = [_SharedBlock(block, b) for b in blocks]
        else:
            self.blocks = []

    @staticmethod
    def vjp(fn, primals: tuple, *rest, has_aux: bool = False):
        """`fn(*primals, *rest)` and its vjp function with respect to `primals`, by autograd."""
        flat, spec = tree_lib.flatten(primals)
        leaves = [x.detach().requires_grad_(True) for x in flat]
        with torch.enable_grad():
            out = fn(*spec.unflatten(leaves), *rest)
        aux = None
        if has_aux:
            out, aux = out
            aux = {k: v.detach() for k, v in aux.items()}

        def vjp_fn(g):
            """The cotangents of `primals` for the output cotangent `g` (zeros where unused)."""
            got = torch.autograd.grad(out, leaves, g, allow_unused=True)
            return spec.unflatten([torch.zeros_like(x) if d is None else d for x, d in zip(leaves, got)])

        return (out.detach(), vjp_fn, aux) if has_aux else (out.detach(), vjp_fn)


class _SharedBlock:
    """Block `stage` as a call of the compiled shared block graph on its own params and index."""

    def __init__(self, compiled: Callable, stage: Stage):
        self.compiled, self.stage, self.index = compiled, stage, torch.tensor(stage.index, dtype=torch.int64)

    def __call__(self, p: Params, h: torch.Tensor, key, *side):
        if self.index.device != h.device:
            self.index = self.index.to(h.device)
        return self.compiled(self.stage.own(p), h, key, self.index, *side)


def _plain_value_and_grad(loss_fn, params, batch, key, loss_scale):
    """(loss, aux, grads) by `torch.func.grad_and_value` over the whole composition."""

    def scaled(p):
        """(loss * loss_scale, (loss, aux))."""
        loss, aux = loss_fn(p, batch, key)
        out = loss if loss_scale is None else loss * cotangent_seed(loss, loss_scale)
        return out, (loss.detach(), aux)

    grads, (_, (loss, aux)) = torch.func.grad_and_value(scaled, has_aux=True)(params)
    return loss, aux, grads


def _barrier_tree(params: Params, after: torch.Tensor) -> Params:
    """`remat_barrier` on every (local shard of a) tensor of `params`, so its gather waits for `after`."""
    from functrain.parallel.layout import is_dtensor

    out = {}
    for name, p in params.items():
        if is_dtensor(p):
            d: Any = p  # a DTensor
            local = remat_barrier(d.to_local(), after)
            p = type(d).from_local(
                local, d.device_mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride()
            )
        else:
            p = remat_barrier(p, after)
        out[name] = p
    return out


def _staged_value_and_grad(staged: StagedLoss, params, batch, key, loss_scale, layout=None):
    """(loss, aux, grads) through per-stage vjps, recomputing the blocks marked in `staged.recompute`.

    `staged._run` (`_Traced` or `_Compiled`) holds the stage functions and the vjp that differentiates them.
    With a `layout` (sharded params, `functrain.parallel.layout.Layout`), FSDP's schedule: each stage's
    parameters are gathered just before its forward, and its gradients reduced to the params'
    placements (a reduce-scatter) as soon as its vjp has made them. A recomputed block lets its
    gathered parameters go after its forward and gathers them again for its backward (reshard after
    forward); a kept block's vjp closure holds them until its backward. Sharded, the embedding is
    recomputed as well and the head's closure dropped after its backward, so with every block
    recomputed at most one stage's gathered parameters are alive at a time (memory trace:
    tests/test_parallel_dist.py::test_at_most_one_stage_is_gathered_at_a_time).
    """
    embed, blocks, head, recompute, run = staged.embed, staged.blocks, staged.head, staged.recompute, staged._run
    trained, params = params, {**staged.frozen, **params}  # the stages read both; gradients: `trained` only

    # Compiled stage by stage (eager stage loop, sharded): each stage's gather starts while the stage
    # before it computes (`Layout.gather_start`), so at most two stages are gathered at a time. The
    # gathers come in a fixed order: forward embed, blocks, head; backward the recomputed blocks
    # from the last, the embedding.
    schedule = []
    if layout is not None and run.compiled:
        schedule = [embed, *blocks, head, *[b for b, again in zip(blocks[::-1], recompute[::-1]) if again], embed]
    started: dict = {}  # position in `schedule` -> the function that finishes its gather
    taken = [0]

    def local(stage, after=None):
        """The stage's params to compute with: gathered (after `after` exists) when sharded."""
        p = stage.params(params)
        if layout is None:
            return p
        if not schedule:
            return layout.gather(p if after is None or not run.barrier else _barrier_tree(p, after), stage.rows)
        k = taken[0]
        taken[0] += 1
        assert schedule[k] is stage, "the staged loss gathered its stages out of the expected order"
        finish = started.pop(k, None) or layout.gather_start(p, stage.rows)
        if k + 1 < len(schedule):  # the next stage's gather runs while this one computes
            started[k + 1] = layout.gather_start(schedule[k + 1].params(params), schedule[k + 1].rows)
        return finish()

    def add(stage, g):
        """Adds a stage's gradients of trained params to the total, reduced to their placements when sharded."""
        g = {n: v for n, v in g.items() if n in trained}
        _add_grads(grads, g if layout is None else layout.reduce_grads(g, {n: trained[n] for n in g}, stage.rows))

    # Forward: keep vjp closures of the embedding and of kept blocks, only the input of the others.
    # Sharded, the embedding is recomputed too: its vjp would hold its gathered parameters (often
    # the largest stage: the token embedding) through the whole step.
    if layout is None:
        h, embed_vjp = run.vjp(run.embed, (local(embed),), batch, key)
    else:
        with torch.no_grad():
            h = run.embed(local(embed), batch, key)
        embed_vjp = None
    every, side = range(len(blocks)), staged.side_of(batch)
    h, saved = staged.forward_blocks(every, h, key, local, side=side)
    if layout is not None and run.reshard and not all(recompute):
        h = mark_forward_done(h)  # kept blocks' gathered params: gathered again for their backward
    loss, head_vjp, aux = run.vjp(run.head, (local(head), h), batch, key, has_aux=True)

    # Backward: head, blocks in reverse (recomputing where asked), embedding.
    grads: Params = {}
    g_head, g = head_vjp(cotangent_seed(loss, loss_scale))
    del head_vjp  # its closure holds the head's gathered parameters
    add(head, g_head)
    cotangent, g = [g], None
    g = staged.backward_blocks(every, saved, cotangent, key, local, add, side)
    if embed_vjp is None:  # sharded: gathered again, once g exists
        _, embed_vjp = run.vjp(run.embed, (local(embed, after=g),), batch, key)
    (g_embed,) = embed_vjp(g)
    add(embed, g_embed)
    grads = {n: grads[n] if n in grads else torch.zeros_like(p) for n, p in trained.items()}
    return loss.detach(), aux, grads
