"""The next-token loss every decoder-only language model family shares: through the output head, plain,
chunked or as `functrain.step.staged` stages, on packed rows or padded ones (how a model is cut into stages:
`functrain.models.stages`; sampling and evaluation: `functrain.models.inference`; the data side:
`functrain.models.lm_data`).

Internals: docs/internals.md "functrain.models.lm".

Example:
    >>> loss_fn = make_lm_loss_fn(template, gpt.stages(template), head="wte.weight", chunk_size=1024)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import functrain.step.staged as remat_lib
from functrain import functional
from functrain.config_checks import parse_policy
from functrain.losses import chunked_cross_entropy
from functrain.models.stages import LMStages
from functrain.step.staged import Stage

__all__ = [
    "Packed",
    "count_targets",
    "cross_entropy",
    "lm_hidden",
    "lm_loss",
    "make_lm_loss_fn",
    "packed",
]


class Packed(NamedTuple):
    """Where the documents of packed rows are: what a decoder's attention and positions read.

    Attributes:
      positions: int64 (B, T): each token's position in its document (0 where one starts).
      mask: bool (B, 1, T, T): query i may attend to key j (same document, j <= i): block-causal.
    """

    positions: torch.Tensor
    mask: torch.Tensor

    def layer(self, i: int) -> Packed:
        """Layer `i`'s view: the same for every layer (a `kv_cache.Cached` forward gives each its cache)."""
        return self

    def keys_values(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values attention reads: these rows' own (a `kv_cache.LayerCache` adds the cache's)."""
        return k, v


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
      remat: activation checkpointing of the blocks (`functrain.config_checks.parse_policy`): "none", "full"
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
