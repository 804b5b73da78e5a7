"""Pipeline parallelism: a staged loss's stages on different ranks, microbatches on a schedule.

Internals: docs/internals.md "functrain.parallel.pipeline".

Example:
    >>> pipe = pipeline.place(gpt.make_loss_fn(template, staged=True), full_params)
    >>> state = init_state(pipe.params(full_params), opt)
    >>> step = pipeline.make_pipeline_step(pipe, opt, microbatches=8, schedule="1f1b")
    >>> state, metrics = step(state, batch)          # the same metrics on every pipeline rank
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import functrain.metric_names as M
import functrain.step.precision as precision_lib
from functrain import compiler
from functrain import tree as tree_lib
from functrain.nn.model_state import loss_and_aux
from functrain.parallel.dispatch import layout_of
from functrain.parallel.layout import Layout
from functrain.parallel.pipeline_schedule import Action, partition
from functrain.parallel.pipeline_schedule import schedule as make_schedule
from functrain.state import TrainState
from functrain.step.grads import Microbatches, step_key
from functrain.step.staged import StagedLoss, cotangent_seed
from functrain.step.update import make_update, to_master

__all__ = [
    "RANGE_RECV",
    "RANGE_SCHEDULE",
    "Pipeline",
    "Stages",
    "action_ranges",
    "global_norm",
    "make_pipeline_eval_step",
    "make_pipeline_step",
    "param_shapes",
    "place",
]

RANGE_SCHEDULE = "pipeline schedule"  # a step's whole schedule, its sends completed (a profiler range)
RANGE_RECV = "pipeline recv"  # one blocking receive, within an action's range
_RANGE_ACTION = "pipeline "  # + "F<micro>" or "B<micro>": one forward or backward action


def action_ranges(events) -> list[tuple[str, int, object]]:
    """The pipeline actions in a profile: (kind "F" or "B", microbatch, event), in the order they started.

    Args:
      events: `torch.profiler.profile(...).events()`, of steps run under that profiler.

    Returns:
      The list; each event's `time_range` gives its start and length.

    Example:
      >>> [f"{k}{m}" for k, m, _ in action_ranges(prof.events())]  # prof: a profile of a step
      ['F0', 'F1', 'B0', 'F2', 'B1', ...]
    """
    n = len(_RANGE_ACTION)
    out = [
        (e.name[n], int(e.name[n + 1 :]), e)
        for e in events
        if e.name.startswith(_RANGE_ACTION) and e.name[n : n + 1] in ("F", "B") and e.name[n + 1 :].isdigit()
    ]
    return sorted(out, key=lambda a: a[2].time_range.start)


PyTree = Any
Params = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """One rank's share of a staged loss cut into pipeline stages (made by `place`).

    Attributes:
      loss_fn: the whole staged loss (every rank knows every stage; it runs only its own).
      group: the pipeline's process group (None: the default group).
      rank, world: this rank's index in the pipeline and the number of pipeline ranks.
      blocks: the indices of the blocks this rank runs.
      names: the parameters this rank holds, in the full params' order.
      counted: the names whose gradient this rank counts in global norms (a tied weight: its first holder).
      tied: `(name, shape, dtype)` of each weight held by more than one rank (gradients summed over the group).
      owners: {block index: pipeline rank} for every block.
    """

    loss_fn: StagedLoss
    group: Any
    rank: int
    world: int
    blocks: range
    names: tuple[str, ...]
    counted: frozenset
    tied: tuple
    owners: dict

    @property
    def first(self) -> bool:
        """Whether this rank runs the embedding (reads the batch's inputs)."""
        return self.rank == 0

    @property
    def last(self) -> bool:
        """Whether this rank runs the head and the loss (reads the batch's targets)."""
        return self.rank == self.world - 1

    def params(self, params: Params) -> Params:
        """The params this rank holds, picked from the whole model's `params` ({name: tensor})."""
        return {n: params[n] for n in self.names}


def place(
    loss_fn: Callable, params: Params, *, group=None, rank: int | None = None, world: int | None = None
) -> Pipeline:
    """Cuts `loss_fn`'s stages over the pipeline ranks and returns this rank's share.

    Args:
      loss_fn: a `functrain.step.staged.StagedLoss` (e.g. `gpt.make_loss_fn(template, staged=True)`).
      params: the whole model's params, {name: tensor}; only their shapes are read (meta tensors do).
      group: the pipeline's process group (None: the default group).
      rank, world: this rank's pipeline index and the pipeline's size (default: from `group`).

    Returns:
      A `Pipeline`: blocks balanced by parameter count over the ranks, the embedding on rank 0, the
      head on the last.

    Raises:
      ValueError: more pipeline ranks than blocks, or a staged loss that is not a `StagedLoss` (one line).

    Example:
      >>> pipe = pipeline.place(loss_fn, dict(template.named_parameters()))
      >>> state = init_state(pipe.params(full_params), opt)
    """
    if not isinstance(loss_fn, StagedLoss):
        raise ValueError(
            "pipeline parallelism cuts a staged loss into stages: build the loss with "
            "staged=True (e.g. gpt.make_loss_fn(template, staged=True))"
        )
    if world is None:
        world = dist.get_world_size(group) if dist.is_initialized() else 1
    if rank is None:
        rank = dist.get_rank(group) if dist.is_initialized() else 0
    numel = {n: p.numel() for n, p in params.items()}
    parts = partition(
        [sum(numel[n] for n in b.names) for b in loss_fn.blocks],
        world,
        first=sum(numel[n] for n in loss_fn.embed.names),
        last=sum(numel[n] for n in loss_fn.head.names),
    )
    owners = {b: r for r, part in enumerate(parts) for b in part}
    readers: dict[str, set] = {}
    for stage, r in [
        (loss_fn.embed, 0),
        *[(b, owners[i]) for i, b in enumerate(loss_fn.blocks)],
        (loss_fn.head, world - 1),
    ]:
        for n in stage.names:
            readers.setdefault(n, set()).add(r)
    names = tuple(n for n in params if rank in readers.get(n, ()))
    tied = tuple((n, tuple(params[n].shape), params[n].dtype) for n in params if len(readers.get(n, ())) > 1)
    counted = frozenset(n for n in names if min(readers[n]) == rank)
    return Pipeline(loss_fn, group, rank, world, parts[rank], names, counted, tied, owners)


def param_shapes(init_params: Callable, key: torch.Tensor) -> Params:
    """The params `init_params(key, device, where=...)` makes, as meta tensors (no values drawn).

    Args:
      init_params: a `Task`'s init that takes `where` (`functrain.parallel.init_sharded`).
      key: the `rng` key.

    Returns:
      {name: meta tensor of the parameter's shape and dtype}: what `place` needs.

    Example:
      >>> pipe = pipeline.place(task.loss_fn, pipeline.param_shapes(task.init_params, rng.key(0)))
    """
    shapes: dict = {}

    def where(name, shape):
        """Records the shape; an empty block."""
        shapes[name] = tuple(int(s) for s in shape)
        return [0] * len(shape), [0] * len(shape)

    blocks = init_params(key, torch.device("cpu"), where=where)
    return {n: torch.empty(shapes[n], dtype=b.dtype, device="meta") for n, b in blocks.items()}


def global_norm(pipe: Pipeline, tree: Params) -> torch.Tensor:
    """The L2 norm of a params-shaped tree over every pipeline stage (a tied weight once).

    Args:
      pipe: this rank's `Pipeline`.
      tree: this rank's params (or gradients), plain tensors or DTensors.

    Returns:
      A 0-d float32 tensor, the same on every rank of the pipeline.

    Example:
      >>> param_norm = float(pipeline.global_norm(pipe, state.params))
    """
    return Stages(layout_of(tree), pipe).global_norm(tree)


class Stages(Layout):
    """The layout a pipeline rank's update runs with: `inner`'s, norms summed over the pipeline group.

    `global_norm` sums the squared norms of this rank's counted tensors over the pipeline ranks (a
    tied weight once), so clipping and the non-finite skip are one global decision; everything else
    is `inner`'s (`parallel.LOCAL` for plain tensors).
    """

    def __init__(self, inner: Layout, pipe: Pipeline):
        self.inner, self.pipe = inner, pipe
        self.dp_rank, self.dp_world, self.sharded = inner.dp_rank, inner.dp_world, inner.sharded

    def gather(self, params, rows=()):
        return self.inner.gather(params, rows)

    def reduce_grads(self, grads, params, rows=()):
        return self.inner.reduce_grads(grads, params, rows)

    def mean_over_dp(self, metrics):
        return self.inner.mean_over_dp(metrics)

    def fold_in_dp(self, key):
        return self.inner.fold_in_dp(key)

    def token_weights(self, counts):
        return self.inner.token_weights(counts)

    def global_norm(self, tree, *, fused: bool = False):
        mine = {k: v for k, v in tree.items() if k in self.pipe.counted}
        sq = torch.square(self.inner.global_norm(mine, fused=fused))
        return torch.sqrt(_all_reduce(sq, self.pipe))

    def select(self, ok, new, old):
        return self.inner.select(ok, new, old)

    def write_into(self, old, new):
        return self.inner.write_into(old, new)


def _all_reduce(x: torch.Tensor, pipe: Pipeline) -> torch.Tensor:
    """`x` summed over the pipeline group (traceable: a functional collective)."""
    if pipe.world == 1:
        return x
    group: Any = pipe.group if pipe.group is not None else dist.group.WORLD
    out = funcol.all_reduce(x, "sum", group)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 10  # dtype code, ndim, up to 8 dims


class _Wire:
    """A pipeline rank's point-to-point transfers: activations forward, cotangents backward."""

    def __init__(self, pipe: Pipeline):
        self.pipe = pipe
        glob = (lambda r: dist.get_global_rank(pipe.group, r)) if pipe.group is not None else (lambda r: r)
        self.prev = glob(pipe.rank - 1) if not pipe.first else None
        self.next = glob(pipe.rank + 1) if not pipe.last else None
        self.pending: list = []  # (work, tensor): sends in flight, waited at the end of the step
        self.posted: dict = {}  # (source, tag) -> (work, buffer): receives posted ahead of their action
        self.shapes: dict = {}  # batch signature -> (shape, dtype) of the activation this rank receives

    def send(self, x: torch.Tensor, to: int | None, tag: int) -> None:
        """Sends `x` without waiting (kept alive until `flush`)."""
        x = x.detach().contiguous()
        self.pending.append((dist.isend(x, to, group=self.pipe.group, tag=tag), x))

    def recv(self, shape, dtype, device, frm: int | None, tag: int) -> torch.Tensor:
        """Receives a tensor of `shape` and `dtype` (blocks until it arrives; posted ahead or now)."""
        posted = self.posted.pop((frm, tag), None)
        with torch.profiler.record_function(RANGE_RECV):
            if posted is None:
                buf = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(buf, frm, group=self.pipe.group, tag=tag)
            else:
                work, buf = posted
                work.wait()
        return buf

    def post(self, act, signature, device) -> None:
        """Posts the receive action `act` will wait on, if it has one whose shape is known.

        A receive posted before the sender sends lets the send go out at once: a sender whose
        peer has not posted its receive yet leaves the transfer to a background thread, which
        must wait for a core when every core computes (milliseconds on the critical path)."""
        if act.kind == "F" and not self.pipe.first:
            frm, tag, known = self.prev, 2 * act.micro, self.shapes.get((signature, "in"))
        elif act.kind == "B" and not self.pipe.last:
            frm, tag, known = self.next, 2 * act.micro + 1, self.shapes.get((signature, "out"))
        else:
            return
        if known is not None and (frm, tag) not in self.posted:
            buf = torch.empty(known[0], dtype=known[1], device=device)
            self.posted[frm, tag] = (dist.irecv(buf, frm, group=self.pipe.group, tag=tag), buf)

    def ahead(self, actions: list, signature, device):
        """Yields `actions` in order, each once the receive of the action after it is posted."""
        if actions:
            self.post(actions[0], signature, device)
        for j, act in enumerate(actions):
            if j + 1 < len(actions):
                self.post(actions[j + 1], signature, device)
            yield act

    def send_activation(self, h: torch.Tensor, micro: int, signature) -> None:
        """Sends microbatch `micro`'s output to the next rank (its shape first, once per batch signature)."""
        if (signature, "out") not in self.shapes:
            self.shapes[signature, "out"] = (h.shape, h.dtype)
            head = [_DTYPES.index(h.dtype), h.dim(), *h.shape] + [0] * (_HEADER - 2 - h.dim())
            self.send(torch.tensor(head, dtype=torch.int64, device=h.device), self.next, tag=2**20)
        self.send(h, self.next, tag=2 * micro)

    def recv_activation(self, micro: int, signature, device) -> torch.Tensor:
        """Receives microbatch `micro`'s input from the rank before."""
        if (signature, "in") not in self.shapes:
            head = self.recv((_HEADER,), torch.int64, device, self.prev, tag=2**20).tolist()
            self.shapes[signature, "in"] = (tuple(head[2 : 2 + head[1]]), _DTYPES[head[0]])
        shape, dtype = self.shapes[signature, "in"]
        return self.recv(shape, dtype, device, self.prev, tag=2 * micro)

    def flush(self) -> None:
        """Waits for every send in flight."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def _signature(batch: PyTree):
    """The shapes and dtypes of a batch's leaves: equal on every pipeline rank for the same batch."""
    return tuple((tuple(x.shape), str(x.dtype)) for x in tree_lib.leaves(batch))


def _own_params(p: Params) -> Callable:
    """The engine's `params_of` on a pipeline rank: a stage's params are this rank's own, never gathered."""
    return lambda stage, after=None: stage.params(p)


class _Rank:
    """The forward and backward of one microbatch through this rank's stages, on the staged loss's engine
    (`StagedLoss.forward_blocks`/`backward_blocks` over this rank's blocks)."""

    def __init__(self, pipe: Pipeline, loss_fn: StagedLoss, wire: _Wire, signature):
        self.pipe, self.loss_fn, self.wire, self.sig = pipe, loss_fn, wire, signature
        self.run = loss_fn.runner

    def forward(self, p: Params, mb, key, micro: int, grad: bool = True):
        """Runs microbatch `micro` forward on params `p` (plain tensors); returns what its backward needs
        (the last rank: and the loss and aux)."""
        pipe, run, loss_fn = self.pipe, self.run, self.loss_fn
        if not pipe.first:
            h, embed_vjp = self.wire.recv_activation(micro, self.sig, _device(p)), None
        elif grad:
            h, embed_vjp = run.vjp(run.embed, (loss_fn.embed.params(p),), mb, key)
        else:
            h, embed_vjp = run.embed(loss_fn.embed.params(p), mb, key), None
        side = loss_fn.side_of(mb)  # every rank holds the batch: the blocks' side inputs are made here
        h, saved = loss_fn.forward_blocks(pipe.blocks, h, key, _own_params(p), grad=grad, side=side)
        if not pipe.last:
            self.wire.send_activation(h, micro, self.sig)
            return (embed_vjp, saved, None, side), None, None
        hp = loss_fn.head.params(p)
        if not grad:
            loss, aux = loss_and_aux(run.head(hp, h, mb, key))
            return None, loss, aux
        loss, head_vjp, aux = run.vjp(run.head, (hp, h), mb, key, has_aux=True)
        return (embed_vjp, saved, (head_vjp, loss), side), loss, aux

    def backward(self, p: Params, held, key, micro: int, loss_scale, add: Callable) -> None:
        """Runs microbatch `micro` backward from what `forward` kept; `add(stage, grads)` takes each stage's grads."""
        pipe, loss_fn = self.pipe, self.loss_fn
        embed_vjp, saved, head, side = held
        if pipe.last:
            head_vjp, loss = head
            g_head, g = head_vjp(cotangent_seed(loss, loss_scale))
            add(loss_fn.head, g_head)
        else:
            shape, dtype = self.wire.shapes[self.sig, "out"]
            g = self.wire.recv(shape, dtype, _device(p), self.wire.next, tag=2 * micro + 1)
        cotangent, g = [g], None
        g = loss_fn.backward_blocks(pipe.blocks, saved, cotangent, key, _own_params(p), add, side)
        if pipe.first:
            (g_embed,) = embed_vjp(g)
            add(loss_fn.embed, g_embed)
        else:
            self.wire.send(g, self.wire.prev, tag=2 * micro + 1)


def _device(p: Params) -> torch.device:
    """The device the params compute on."""
    x = next(iter(p.values()))
    return x.to_local().device if hasattr(x, "to_local") else x.device


def make_pipeline_step(  # noqa: PLR0913
    pipe: Pipeline,
    optimizer,
    *,
    microbatches: int = 1,
    schedule: str = "1f1b",
    compile: bool = False,
    donate: bool = True,
    precision: str | torch.dtype | precision_lib.Precision | None = None,
    skip_nonfinite: bool = True,
    compile_options: dict | None = None,
    count_targets: Callable[[PyTree], torch.Tensor] | None = None,
) -> Callable[[TrainState, PyTree], tuple[TrainState, dict]]:
    """Builds one pipeline rank's `step(state, batch) -> (new_state, metrics)`.

    Args:
      pipe: this rank's share of the staged loss (`place`).
      optimizer: a `functrain.optim.Transform`; `state.opt_state` is its state over `pipe`'s params.
      microbatches: the batch is cut into this many microbatches (its dim 0 must divide by it);
        the gradients are their mean, as `functrain.make_train_step(accum_steps=microbatches)`.
      schedule: "1f1b" (at most `world - rank` microbatches' activations held), "eager-1f1b" (one
        more: a slow action on one rank idles the others less) or "gpipe" (all of them), see
        `functrain.parallel.pipeline_schedule`.
      compile: run the stages as the staged loss's compiled graphs and the update as one graph
        (module docstring: the compile contract); False: eager.
      donate: write the new params and optimizer state into the input state's buffers.
      precision: "fp32", "bf16" or "fp16" (loss scaling), as for `functrain.make_train_step`.
      skip_nonfinite: keep the old params and optimizer state when the global loss or gradient norm
        is not finite (the same decision on every rank).
      compile_options: extra keyword arguments for `torch.compile`.
      count_targets: `batch -> number of target tokens`, as for `functrain.make_train_step`: the
        loss and gradients are then the mean over every target token of the step (every rank counts
        them from its copy of the batch; summed over the data-parallel ranks).

    Returns:
      The step. Metrics, equal on every pipeline rank: `loss` and the head's aux (mean over
      microbatches, or weighted by their targets), `grad_norm`, `update_norm`, `lr`, the skip
      counters, and `targets` with `count_targets`.

    Raises:
      ValueError: an unknown schedule or microbatches < 1 (one line).

    Example:
      >>> step = pipeline.make_pipeline_step(pipe, optim.adamw(3e-4), microbatches=8)
      >>> state, metrics = step(state, batch)
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    actions = make_schedule(schedule, pipe.world, microbatches, pipe.rank)
    prec = precision_lib.get(precision)
    guarded = skip_nonfinite or prec.loss_scaling
    loss_fn = pipe.loss_fn.compile_stages(compile_options) if compile else pipe.loss_fn
    wire = _Wire(pipe)
    aux_names: list = []  # the head's aux metric names (sent once by the last rank)
    updates: dict = {}  # id(inner layout) -> (Stages, the update for it)

    def update_for(params: Params):
        """The layout and update for params laid out as they are (built at first use)."""
        inner = layout_of(params)
        if id(inner) not in updates:
            lay = Stages(inner, pipe)
            fn = make_update(optimizer, donate=donate, skip_nonfinite=guarded, precision=prec, layout=lay)
            updates[id(inner)] = lay, compiler.maybe_compile(fn, compile, compile_options)
        return updates[id(inner)]

    def step(state: TrainState, batch: PyTree):
        lay, update = update_for(state.params)
        params, batch = precision_lib.to_compute(prec, state.params, batch)
        params = lay.gather(params)  # this rank's stages, whole on the dp axes (tp slices stay slices)
        both = _with_frozen(lay, prec, state, params)  # what the stages read (a LoRA base too)
        key, loss_scale = step_key(state, lay), prec.scale_of(state.guard)
        # every rank holds the batch: the same counts on every stage
        mbs = Microbatches(
            batch, key, microbatches, lay, count_targets=count_targets, loss_scale=loss_scale, what="pp.microbatches"
        )
        stages = _Rank(pipe, loss_fn, wire, _signature(batch))

        def add(stage, g):
            mbs.add_grads({n: x for n, x in g.items() if n in params})  # (frozen, TrainState.frozen: none kept)

        held, losses, auxes = {}, [], []
        with torch.profiler.record_function(RANGE_SCHEDULE):
            for act in wire.ahead(actions, stages.sig, _device(params)):  # the next action's input posted
                i = act.micro
                with torch.profiler.record_function(f"{_RANGE_ACTION}{act.kind}{i}"):
                    if act.kind == "F":
                        held[i], loss, aux = stages.forward(both, mbs.batches[i], mbs.keys[i], i)
                        if pipe.last:
                            losses.append(loss.detach())
                            auxes.append({k: v.detach() for k, v in (aux or {}).items()})
                    else:
                        stages.backward(both, held.pop(i), mbs.keys[i], i, mbs.factor(i), add)
            wire.flush()
        grads = mbs.grads(params)
        grads = _sum_tied(grads, pipe)
        metrics = _metrics(losses, auxes, pipe, _device(params), aux_names, mbs.weights)
        if mbs.total is not None:
            metrics[M.TARGETS] = mbs.total
        grads = lay.reduce_grads(to_master(grads, state.params, loss_scale), state.params)  # dp mean, placements
        return update(state, lay.mean_over_dp(metrics), grads)

    return step


def _with_frozen(lay: Layout, prec, state: TrainState, params: Params) -> Params:
    """`params` with this rank's frozen params (`TrainState.frozen`, cast and gathered as they are) beside them."""
    if not state.frozen:
        return params
    frozen, _ = precision_lib.to_compute(prec, state.frozen, None)
    return {**lay.gather(frozen), **params}


def _sum_tied(grads: Params, pipe: Pipeline) -> Params:
    """Gradients of weights read on several ranks summed over the pipeline group (zeros where absent)."""
    if not pipe.tied:
        return grads
    device = next(iter(grads.values())).device
    parts = [
        grads[n].reshape(-1).float() if n in grads else torch.zeros(shape, device=device).reshape(-1)
        for n, shape, _ in pipe.tied
    ]
    total = _all_reduce(torch.cat(parts), pipe)
    out, at = dict(grads), 0
    for (n, _, _), part in zip(pipe.tied, parts):
        if n in grads:
            out[n] = total[at : at + part.numel()].reshape(grads[n].shape).to(grads[n].dtype)
        at += part.numel()
    return out


def _metrics(losses: list, auxes: list, pipe: Pipeline, device, names: list, weights=None) -> dict:
    """The loss and aux (mean over microbatches, or summed with `weights`) from the last rank, the same on
    every pipeline rank; `names` caches the aux names (filled by the last rank's broadcast at the first call)."""
    if not names:
        names.append(_aux_names(auxes, pipe))
    names = names[0]
    if pipe.last:
        rows = [torch.stack([ln.float(), *[a[k].float() for k in names]]) for ln, a in zip(losses, auxes)]
        if weights is not None:
            values = (torch.stack(rows) * weights.to(device)[:, None]).sum(0)
        else:
            values = torch.stack(rows).mean(0) if len(rows) > 1 else rows[0]
    else:
        values = torch.zeros(1 + len(names), device=device)
    values = _all_reduce(values.to(device), pipe)
    return {M.LOSS: values[0], **{k: values[1 + j] for j, k in enumerate(names)}}


def _aux_names(auxes: list, pipe: Pipeline) -> list:
    """The head's aux metric names, sent by the last pipeline rank to the others."""
    names = [sorted(auxes[0]) if pipe.last and auxes else None]
    if pipe.world > 1:
        src = pipe.world - 1 if pipe.group is None else dist.get_global_rank(pipe.group, pipe.world - 1)
        dist.broadcast_object_list(names, src=src, group=pipe.group)
    return names[0] or []


def make_pipeline_eval_step(
    pipe: Pipeline,
    *,
    microbatches: int = 1,
    compile: bool = False,
    precision: str | torch.dtype | precision_lib.Precision | None = None,
    compile_options: dict | None = None,
) -> Callable[[TrainState, PyTree], dict]:
    """Builds one pipeline rank's `eval_step(state, batch) -> metrics` (forward only, no dropout key).

    Args:
      pipe: this rank's share of the staged loss (`place`).
      microbatches: the batch is cut into this many microbatches, which flow through the ranks in turn.
      compile: run the stages as the staged loss's compiled graphs.
      precision: compute precision, as for `make_train_step`.
      compile_options: extra keyword arguments for `torch.compile`.

    Returns:
      The eval function; its metrics (`loss` and the head's aux, mean over microbatches) are equal on
      every pipeline rank. It never changes the state.

    Example:
      >>> val_loss = pipeline.make_pipeline_eval_step(pipe)(state, val_batch)["loss"]
    """
    prec = precision_lib.get(precision)
    loss_fn = pipe.loss_fn.compile_stages(compile_options) if compile else pipe.loss_fn
    wire = _Wire(pipe)
    aux_names: list = []

    def evaluate(state: TrainState, batch: PyTree):
        lay = Stages(layout_of(state.params), pipe)
        params, batch = precision_lib.to_compute(prec, state.params, batch)
        params = _with_frozen(lay, prec, state, lay.gather(params))
        stages = _Rank(pipe, loss_fn, wire, _signature(batch))
        losses, auxes = [], []
        forwards = wire.ahead([Action("F", i) for i in range(microbatches)], stages.sig, _device(params))
        with torch.no_grad():
            what = "pp.microbatches"
            mbs = Microbatches(batch, None, microbatches, lay, count_targets=None, loss_scale=None, what=what)
            for act, mb in zip(forwards, mbs.batches):
                _, loss, aux = stages.forward(params, mb, None, act.micro, grad=False)
                if pipe.last:
                    losses.append(loss)
                    auxes.append(dict(aux or {}))
        wire.flush()
        return lay.mean_over_dp(_metrics(losses, auxes, pipe, _device(params), aux_names))

    return evaluate
