"""What every decoder-only language model family shares: the next-token loss through the output
head (plain, chunked or as `functrain.step.staged` stages), packed rows' attention, stage helpers, and
sampling (the data side: `functrain.models.lm_data`).

Internals: docs/internals.md "functrain.models.lm".

Example:
    >>> loss_fn = make_lm_loss_fn(template, gpt.stages(template), head="wte.weight", chunk_size=1024)
    >>> out = generate(template, params, torch.tensor([[10]]), 100, key=rng.key(1))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

import functrain.step.staged as remat_lib
from functrain import config_checks, functional, parallel, rng
from functrain.eval import EvalModel, of_module
from functrain.losses import chunked_cross_entropy
from functrain.step.remat_policy import parse_policy
from functrain.step.staged import Stage

__all__ = [
    "LMStages",
    "Packed",
    "context_model",
    "count_targets",
    "cross_entropy",
    "eval_model",
    "generate",
    "init_blocks",
    "lm_hidden",
    "lm_loss",
    "make_lm_loss_fn",
    "packed",
    "repeated_stages",
    "resolve_remat",
    "submodule_stage",
    "wants_stages",
]


class Packed(NamedTuple):
    """Where the documents of packed rows are: what a decoder's attention and positions read.

    Attributes:
      positions: int64 (B, T): each token's position in its document (0 where one starts).
      mask: bool (B, 1, T, T): query i may attend to key j (same document, j <= i): block-causal.
    """

    positions: torch.Tensor
    mask: torch.Tensor


def packed(positions: torch.Tensor) -> Packed:
    """The `Packed` layout of rows whose documents restart their positions at 0.

    Args:
      positions: int64 (B, T), as `functrain.data.sft` batches carry them (padding is a document of its own).

    Returns:
      `Packed(positions, block-causal mask (B, 1, T, T))`.

    Example:
      >>> pk = packed(torch.tensor([[0, 1, 2, 0, 1]]))
      >>> pk.mask[0, 0, 3].tolist()            # the 2nd document's first token sees only itself
      [False, False, False, True, False]
    """
    t = positions.shape[-1]
    doc = (positions == 0).cumsum(-1)  # (B, T): the document each token is in
    causal = torch.ones(t, t, dtype=torch.bool, device=positions.device).tril()  # (T, T)
    return Packed(positions, ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None])  # (B, 1, T, T)


class LMStages(NamedTuple):
    """A decoder LM's forward (up to the hidden states the head reads) cut into `remat.Stage`s."""

    embed: Stage  # fn(p, idx, key, packed=None) -> (B, T, C)
    blocks: list[Stage]  # blocks[i].fn(p, h, key, packed=None) -> (B, T, C)
    final: Stage  # fn(p, h, key) -> (B, T, C): the final norm


def submodule_stage(model: nn.Module, prefix: str, fn: Callable) -> Stage:
    """A stage over the parameters under `prefix` (e.g. "layers.3."), running `fn(module, p, *args)`.

    `fn` gets the submodule and its parameters with the prefix stripped (ready for
    `torch.func.functional_call`), so a tensor-parallel copy of the model (Linears swapped) works
    unchanged.

    Args:
      model: the (meta-device) model.
      prefix: a submodule path ending in ".".
      fn: `fn(module, own_params, *args) -> tensor`.

    Returns:
      `Stage(names under prefix, lambda p, *args: fn(module, own(p), *args))`.

    Example:
      >>> st = submodule_stage(model, "norm.", lambda m, p, h, key: functional_call(m, p, (h,)))
    """
    module = model.get_submodule(prefix.rstrip("."))
    names = tuple(n for n, _ in model.named_parameters() if n.startswith(prefix))

    def run(p, *args):
        """`fn` on this submodule's own parameters."""
        own = {n[len(prefix) :]: t for n, t in p.items() if n.startswith(prefix)}
        return fn(module, own, *args)

    return Stage(names, run)


def repeated_stages(model: nn.Module, container: str, fn: Callable) -> list[Stage]:
    """One stage per block of `model.<container>` (an `nn.ModuleList`), all sharing one computation.

    Block i's stage runs `fn(block_i, own_params, h, key, i, *side)`; its `Stage.shared` runs
    `fn(block_0, own_params, h, key, index, *side)` with `index` a 0-d tensor (`side`: the staged loss's
    side inputs, e.g. packed rows' `Packed`; usually none), the same function object for
    every block, so `step.staged.staged_loss(...).compile_stages()` compiles one block graph for all of them.
    `fn` must therefore use `index` only through tensor ops (e.g. `rng.fold_in(key, 1 + 2 * index)`),
    and the blocks must have the same parameter names and shapes (checked: else no `shared`).

    Args:
      model: the (meta-device) model.
      container: the attribute holding the blocks (e.g. "blocks", "layers").
      fn: `fn(module, own, h, key, index, *side) -> h`, `own` the block's params without its prefix.

    Returns:
      The block stages, in order.

    Example:
      >>> blocks = repeated_stages(model, "layers", lambda m, p, h, key, i: functional_call(m, p, (h,)))
    """
    modules = getattr(model, container)
    first = modules[0] if len(modules) else None

    def shared(own, h, key, index, *side):
        """Any block: block 0's module (they are alike) on `own`, at position `index`."""
        return fn(first, own, h, key, index, *side)

    def signature(m: nn.Module):
        """A block's parameter names and shapes."""
        return [(n, tuple(p.shape), type(m.get_submodule(n.rpartition(".")[0]))) for n, p in m.named_parameters()]

    first_signature = signature(first) if first is not None else None
    alike = all(signature(m) == first_signature for m in modules)
    stages = []
    for i in range(len(modules)):
        stage = submodule_stage(
            model, f"{container}.{i}.", lambda m, own, h, key, *side, i=i: fn(m, own, h, key, i, *side)
        )
        stages.append(Stage(stage.names, stage.fn, shared if alike else None, f"{container}.{i}.", i))
    return stages


def init_blocks(
    model: nn.Module, block: Callable, *, device=None, dtype: torch.dtype = torch.float32, where: Callable | None = None
) -> dict[str, torch.Tensor]:
    """Every parameter of `model` (or only `where`'s block of each) from a family's block initializer.

    Args:
      model: the (meta-device) model.
      block: `block(name, shape, offset, local_shape) -> CPU float32 tensor`: the values of that block
        of parameter `name`, a pure function of its arguments (and the family's key).
      device: where to put the tensors.
      dtype: their dtype.
      where: optional `where(name, shape) -> (offset, local_shape)` (this rank's shard); default whole.

    Returns:
      {name: tensor} in `model.named_parameters()` order (a tied weight once).

    Example:
      >>> params = init_blocks(template, lambda n, s, o, l: torch.zeros(l), where=where)
    """
    out = {}
    for name, p in model.named_parameters():
        offset, local = where(name, p.shape) if where is not None else ([0] * p.ndim, list(p.shape))
        out[name] = block(name, p.shape, offset, local).to(device=device, dtype=dtype)
    return out


def context_model(model: nn.Module, ctx, block_size: int, kernel: str = "zigzag") -> nn.Module:
    """`model` for this rank's part of each sequence when the mesh has a cp axis (else `model`).

    Args:
      model: the (meta-device) LM template.
      ctx: the parallel context (`ctx.mesh`'s cp axis splits the sequences).
      block_size: the training sequence length.
      kernel: the attention's kernel (`config.cp_attention`, see `parallel.context.split_of`).

    Returns:
      `functrain.parallel.context.context_parallel(model, split)`: `model` itself without cp.

    Raises:
      ConfigError: the sequence length does not divide by 2 x cp (each rank holds two chunks).

    Example:
      >>> model = parallel.tensor_parallel(lm.context_model(template, ctx, 1024), ctx.mesh, rules)
    """
    split = parallel.context.split_of(ctx.mesh, kernel)
    config_checks.check_context(block_size, 1 if split is None else split.world)
    return parallel.context.context_parallel(model, split)


def resolve_remat(value, mesh) -> str | int:
    """The remat policy `value` means on `mesh`.

    Args:
      value: the config's `remat`: "auto", "none", "full" or N.
      mesh: the DeviceMesh, or None on one process.

    Returns:
      "auto" -> "full" on a mesh (a recomputed block's gathered params go after its forward: no
      rank ever holds the whole model), "none" on one process; other values unchanged.

    Example:
      >>> remat = lm.resolve_remat(config.remat, ctx.mesh)
    """
    if value == "auto":
        return "full" if mesh is not None else "none"
    return value


def wants_stages(config, ctx) -> bool:
    """Whether a family's loss must be staged even with remat "none".

    Args:
      config: the run config (`compile_unit` is read).
      ctx: the parallel context.

    Returns:
      True for sharded params (per-block gathers), `compile_unit="blocks"` (a graph per stage) or
      pipeline stages (`ctx.pp_world > 1`: the stages are cut over the ranks).

    Example:
      >>> loss_fn = make_loss_fn(model, remat=remat, staged=lm.wants_stages(config, ctx))
    """
    return ctx.mesh is not None or config.compile_unit == "blocks" or ctx.pp_world > 1


def lm_hidden(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    idx: torch.Tensor,
    dropout_key: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Final hidden states (after the last norm, before the head) with `params`, functionally.

    Args:
      model: a decoder LM (a meta-device template is fine).
      params: its parameters, {name: tensor}.
      idx: int64 token ids (B, T).
      dropout_key: an `rng` key for dropout, or None.
      positions: packed rows' positions (B, T) (`packed`), or None: one sequence per row.

    Returns:
      (B, T, C) hidden states; `hidden @ head.T` are the model's logits.

    Example:
      >>> h = lm_hidden(template, state.params, x, key)
    """
    if positions is None:
        return functional.apply(model, params, idx, dropout_key=dropout_key, return_hidden=True)
    return functional.apply(model, params, idx, dropout_key=dropout_key, packed=packed(positions), return_hidden=True)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -1) -> torch.Tensor:
    """Mean next-token cross-entropy over the counted targets, computed in float32.

    Args:
      logits: (B, T, V) in any floating dtype.
      targets: int64 (B, T); positions equal to `ignore_index` are left out of the mean.
      ignore_index: target value to ignore (nanoGPT uses -1).

    Returns:
      A float32 scalar tensor; 0 (with zero gradients) when every target is ignored, where
      `F.cross_entropy` gives NaN: a microbatch of prompts only then adds nothing to a step weighted
      by `count_targets`.

    Example:
      >>> loss = cross_entropy(model(x), y)
    """
    flat = logits.flatten(0, 1).float()  # (B, T, V) -> (B*T, V)
    total = F.cross_entropy(flat, targets.flatten(), ignore_index=ignore_index, reduction="sum")  # targets (B*T,)
    return total / (targets != ignore_index).sum().clamp(min=1)


def count_targets(ignore_index: int = -1) -> Callable:
    """`count(batch) -> int64 0-d tensor`: the targets of an LM batch `(x, y, ...)` not equal to `ignore_index`.

    The `Task.count_targets` of every decoder LM family, for `make_train_step(count_targets=...)`:
    the step's loss is then the mean over every target token of the step.

    Args:
      ignore_index: the target value left out.

    Returns:
      The counting function (traceable: a comparison and a sum).

    Example:
      >>> step = make_train_step(loss_fn, opt, accum_steps=4, count_targets=lm.count_targets())
    """

    def count(batch) -> torch.Tensor:
        """The counted targets of `batch[1]`."""
        return (batch[1] != ignore_index).sum()

    return count


def _positions(batch) -> torch.Tensor | None:
    """A packed batch's positions (its third entry), or None for (x, y)."""
    return batch[2] if len(batch) > 2 else None


def _unpacked_only(batch, what: str) -> None:
    """Refuses a packed batch (x, y, positions) where `what` cannot carry its document layout (one line)."""
    if len(batch) > 2:
        raise ValueError(
            f"packed rows (data.packing=True): {what} has no document mask; set "
            "--config.data.packing=False (padded rows), or train without it"
        )


def _head_loss(hidden, weight, y, chunk_size: int, ignore_index: int) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T` against y, chunked when chunk_size > 0."""
    if chunk_size > 0:
        return chunked_cross_entropy(hidden, weight, y, chunk_size=chunk_size, ignore_index=ignore_index)
    return cross_entropy(F.linear(hidden, weight), y, ignore_index=ignore_index)


def lm_loss(  # noqa: PLR0913
    model: nn.Module,
    params: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    key: torch.Tensor | None = None,
    *,
    head: str,
    chunk_size: int = 0,
    ignore_index: int = -1,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token cross-entropy; with `chunk_size > 0` the (B, T, V) logits never exist whole.

    Args:
      model: the decoder LM (meta template is fine).
      params: its parameters.
      x: int64 input ids (B, T).
      y: int64 targets (B, T).
      key: dropout key (or None).
      head: the name of the output projection's weight (V, C) in `params` (a tied model's embedding).
      chunk_size: 0 = plain loss over the full logits; > 0 = `chunked_cross_entropy`.
      ignore_index: target value to ignore.
      positions: packed rows' positions (B, T), or None.

    Returns:
      A float32 scalar.

    Example:
      >>> loss = lm_loss(template, params, x, y, key, head="wte.weight", chunk_size=2048)
    """
    hidden = lm_hidden(model, params, x, key, positions)  # (B, T, C)
    return _head_loss(hidden, params[head], y, chunk_size, ignore_index)


def make_lm_loss_fn(
    model: nn.Module,
    stages: LMStages,
    *,
    head: str,
    chunk_size: int = 0,
    ignore_index: int = -1,
    remat: str | int = "none",
    staged: bool = False,
) -> Callable:
    """`loss_fn(params, (x, y), key) -> (loss, {})` for `make_train_step` / `make_eval_step`.

    Args:
      model: the (meta-device) LM template, or its tensor-parallel copy.
      stages: its forward as `LMStages` (used when `remat != "none"` or `staged`).
      head: the output projection's parameter name (see `lm_loss`).
      chunk_size: see `lm_loss`.
      ignore_index: target value to ignore.
      remat: activation checkpointing of the blocks (`functrain.step.remat_policy.parse_policy`): "none", "full"
        or an int N (every N-th block). Other than "none" the loss is a `step.staged.staged_loss` whose
        `value_and_grad` the train step uses; loss and gradients are unchanged (to float rounding).
      staged: build the staged loss even with remat "none": on sharded (DTensor) params the train
        step then gathers each block's parameters just before it runs and reduce-scatters its
        gradients as soon as they exist, instead of gathering the whole model.

    Context parallelism: when `model` is a `functrain.parallel.context.context_parallel` copy (its
    `context` is a `Split`), the loss takes the whole sequences (x, y), keeps this rank's tokens of
    both and returns `Split.token_mean` of their mean: averaged over the cp ranks (as the sharded
    step averages losses and gradients) it is the mean over every token of the sequence.

    Returns:
      The loss function.

    Raises:
      ValueError: for a bad `remat` policy.

    Example:
      >>> loss_fn = make_lm_loss_fn(template, llama.stages(template), head="lm_head.weight", remat="full")
    """
    remat = parse_policy(remat)
    split = getattr(model, "context", None)
    mine = (lambda t: t) if split is None else split.shard  # this rank's tokens (B, T) -> (B, T / cp)

    def over_sequence(loss, y):
        """The loss of this rank's targets `y` as its share of the whole sequence's mean."""
        return loss if split is None else split.token_mean(loss, y, ignore_index)

    if remat == "none" and not staged:

        def loss_fn(params, batch, key):
            """(lm_loss of batch = (x, y) or, packed, (x, y, positions), {})."""
            x, y = mine(batch[0]), mine(batch[1])
            if split is not None:
                _unpacked_only(batch, "context parallelism")
            loss = lm_loss(
                model,
                params,
                x,
                y,
                key,
                head=head,
                chunk_size=chunk_size,
                ignore_index=ignore_index,
                positions=_positions(batch),
            )
            return over_sequence(loss, y), {}

        return loss_fn

    def side(batch) -> tuple:
        """What every block gets after its key: packed rows' `Packed` layout, else nothing."""
        positions = _positions(batch)
        return () if positions is None else (packed(positions),)

    def embed(p, batch, key):
        """Embeddings of the inputs x of batch = (x, y) or, packed, (x, y, positions)."""
        if split is not None:
            _unpacked_only(batch, "context parallelism")
        return stages.embed.fn(p, mine(batch[0]), key, *side(batch))

    def head_stage(p, h, batch, key):
        """The final norm, then the (chunked) cross-entropy through the head against y."""
        hidden = stages.final.fn({n: p[n] for n in stages.final.names}, h, key)  # (B, T, C)
        y = mine(batch[1])
        return over_sequence(_head_loss(hidden, p[head], y, chunk_size, ignore_index), y)

    head_names = stages.final.names + ((head,) if head not in stages.final.names else ())
    return remat_lib.staged_loss(
        Stage(stages.embed.names, embed, rows=stages.embed.rows),
        stages.blocks,
        Stage(head_names, head_stage),
        policy=remat,
        side=side,
    )


@torch.no_grad()
def generate(  # noqa: PLR0913
    model: nn.Module,
    params: dict[str, torch.Tensor],
    prompt_idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    key: torch.Tensor,
    stages: LMStages | None = None,
    head: str | None = None,
    block_size: int | None = None,
    logits_fn: Callable | None = None,
) -> torch.Tensor:
    """Samples a continuation autoregressively (eager), with randomness from an explicit key.

    At step i the logits of the last position (context cropped to the last `model.cfg.block_size`
    tokens) are divided by `temperature`, restricted to the `top_k` largest, and a token is drawn by
    Gumbel-max with noise `rng.uniform(rng.fold_in(key, i), ...)`. `temperature=0` picks the argmax.
    No global RNG is used: the same (params, prompt, key) give the same tokens.

    Sharded (DTensor) params are sampled stage by stage: each forward gathers one stage's
    parameters (`functrain.parallel.gather`), runs it and lets them go, so no rank ever holds the
    whole model; every rank must call it (the gathers are collectives) and all get the same tokens,
    equal to sampling the full params (the stages compose to the model's forward, same ops).

    Args:
      model: a decoder LM with `cfg.block_size` (a meta template is fine: weights come from `params`).
      params: name -> tensor, as for `torch.func.functional_call`; or DTensors (then `stages`, `head`).
      prompt_idx: int64 token ids, (B, T0) or (T0,), T0 >= 1.
      max_new_tokens: how many tokens to append.
      temperature: softmax temperature; 0 means greedy.
      top_k: keep only the k most likely tokens (None: all).
      key: an `rng` key.
      stages: the model's `LMStages` (e.g. `gpt.stages(model)`): needed for sharded params.
      head: the output projection's weight name (e.g. "wte.weight" when tied), with `stages`.
      block_size: the longest context (default `model.cfg.block_size`).
      logits_fn: `(params, idx) -> (B, T, V)` logits of plain params (default `apply(model, params, idx)`;
        e.g. a transformers model's `.logits`).

    Returns:
      int64 ids of shape (B, T0 + max_new_tokens) (or (T0 + max_new_tokens,) for a 1-D prompt).

    Example:
      >>> out = generate(model, params, torch.tensor([[10]]), 100, top_k=50, key=rng.key(1))
      >>> text = dataset.decode(out[0].tolist())
      >>> out = generate(model, state.params, prompt, 100, key=k, stages=gpt.stages(model), head="wte.weight")
    """
    squeeze = prompt_idx.ndim == 1
    idx = prompt_idx[None] if squeeze else prompt_idx  # (B, T0)
    key = key.to(idx.device)
    context: int = block_size or cast(Any, model).cfg.block_size  # (a family's cfg)
    logits_fn = logits_fn or (lambda p, i: functional.apply(model, p, i))
    staged = any(parallel.is_dtensor(t) for t in params.values())
    if staged and (stages is None or head is None):
        raise ValueError(
            "generate: the params are sharded (DTensors); pass the model's `stages=` and `head=` so "
            "they are gathered one stage at a time, or `functrain.parallel.gather` them first"
        )
    with torch.no_grad():
        for i in range(max_new_tokens):
            ctx = idx[:, -context:]  # (B, T<=block_size)
            if stages is not None and head is not None and staged:
                logits = _staged_logits(stages, head, params, ctx, parallel.gather)[:, -1, :].float()  # (B, V)
            else:
                logits = logits_fn(params, ctx)[:, -1, :].float()  # (B, V)
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]  # (B, 1)
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                u = rng.uniform(rng.fold_in(key, i), logits.shape).clamp_(1e-20, 1.0 - 1e-7)
                nxt = (logits - torch.log(-torch.log(u))).argmax(dim=-1, keepdim=True)  # (B, 1)
            idx = torch.cat([idx, nxt], dim=1)
    return idx[0] if squeeze else idx


def eval_model(
    template: nn.Module,
    tokenizer,
    *,
    block_size: int,
    stages: LMStages | None,
    head: str | None,
    logits_fn: Callable | None = None,
) -> EvalModel:
    """A decoder LM family's `functrain.eval.EvalModel`: its logits in eval mode, on plain or sharded params.

    Args:
      template: the (meta-device) LM, not its tensor- or context-parallel copy (evaluation reads whole
        sequences and gathers each stage whole).
      tokenizer: the data's tokenizer.
      block_size: the longest input (the trained length).
      stages: the model's `LMStages`: sharded params are gathered a stage at a time (no rank holds the
        whole model); None: sharded params are gathered whole (a model whose loss is unstaged).
      head: the output projection's weight name, with `stages`.
      logits_fn: `(params, idx) -> (B, T, V)` of plain params (default `apply(template, params, idx,
        train=False)`; a transformers model's `.logits`).

    Returns:
      The `EvalModel` (`Task.eval_model`).

    Example:
      >>> model = lm.eval_model(template, tok, block_size=128, stages=gpt.stages(template), head="wte.weight")
    """
    plain = logits_fn or (lambda p, idx: functional.apply(template, p, idx, train=False))

    def logits(params, model_state, idx):
        """(B, T, V) logits of `idx`; DTensor params gathered a stage at a time (or whole without stages)."""
        if not any(parallel.is_dtensor(t) for t in params.values()):
            return plain(params, idx)
        if stages is None or head is None:
            return plain(parallel.gather(params), idx)
        return _staged_logits(stages, head, params, idx, parallel.gather)

    return of_module(template, tokenizer, block_size=block_size, logits=logits)


def _staged_logits(stages: LMStages, head: str, params, idx: torch.Tensor, gather: Callable) -> torch.Tensor:
    """Logits (B, T, V): every stage run on `gather` of its own params only (one stage held at a time)."""
    h = stages.embed.fn(gather(stages.embed.params(params)), idx, None)  # (B, T, C)
    for block in stages.blocks:
        h = block.fn(gather(block.params(params)), h, None)  # (B, T, C)
    h = stages.final.fn(gather(stages.final.params(params)), h, None)  # (B, T, C)
    return F.linear(h, gather({head: params[head]})[head])  # (B, T, V): the forward's lm_head
