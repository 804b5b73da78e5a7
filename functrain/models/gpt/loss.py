"""The GPT's loss: next-token cross-entropy through the tied head, plain, chunked or recomputed.

Internals: docs/internals.md "functrain.models.gpt.loss".

Example:
    >>> step = make_train_step(make_loss_fn(template, chunk_size=1024), optim.adamw(3e-4))
    >>> step = make_train_step(make_loss_fn(template, remat=2), optim.adamw(3e-4))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from functrain.models import lm
from functrain.models.gpt import model as gpt_lib

__all__ = ["gpt_hidden", "gpt_loss", "make_loss_fn"]


def gpt_hidden(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    idx: torch.Tensor,
    dropout_key: torch.Tensor | None = None,
) -> torch.Tensor:
    """Final hidden states (after `ln_f`) of a `functrain.models.gpt.GPT`, with `params` functionally.

    The same computation as the model's forward (dropout sites and keys included) minus the
    lm_head, so `gpt_hidden(...) @ params["wte.weight"].T` equals `apply(model, params, idx, ...)`.

    Args:
      model: a `GPT` (a meta-device template is fine).
      params: its parameters, {name: tensor} as for `functrain.apply`.
      idx: int64 token ids (B, T), T <= block_size.
      dropout_key: an `rng` key for dropout, or None.

    Returns:
      (B, T, n_embd) hidden states.

    Example:
      >>> h = gpt_hidden(template, state.params, x, key)
    """
    return lm.lm_hidden(model, params, idx, dropout_key)  # (B, T, C)


def head_name(names) -> str:
    """The lm_head weight's name: its own entry when untied, else the tied token embedding."""
    return "lm_head.weight" if "lm_head.weight" in names else "wte.weight"


def gpt_loss(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    key: torch.Tensor | None = None,
    *,
    chunk_size: int = 0,
    ignore_index: int = -1,
) -> torch.Tensor:
    """Next-token cross-entropy of a GPT; with `chunk_size > 0` the (B, T, V) logits never exist.

    Args:
      model: a `functrain.models.gpt.GPT` (meta template is fine).
      params: its parameters.
      x: int64 input ids (B, T).
      y: int64 targets (B, T); `ignore_index` entries are skipped.
      key: dropout key (or None).
      chunk_size: 0 = plain loss over the full logits (`models.gpt.cross_entropy`);
        > 0 = `chunked_cross_entropy` with this many tokens per chunk.
      ignore_index: target value to ignore.

    Returns:
      A float32 scalar.

    Example:
      >>> loss = gpt_loss(template, params, x, y, key, chunk_size=2048)
    """
    return lm.lm_loss(
        model, params, x, y, key, head=head_name(params), chunk_size=chunk_size, ignore_index=ignore_index
    )


def make_loss_fn(
    model: nn.Module,
    *,
    chunk_size: int = 0,
    ignore_index: int = -1,
    remat: str | int = "none",
    staged: bool = False,
) -> Callable:
    """`loss_fn(params, (x, y), key) -> (loss, {})` for `make_train_step` / `make_eval_step`.

    Args:
      model: the (meta-device) GPT template (or its tensor-parallel copy).
      chunk_size: see `gpt_loss` (0 = plain loss).
      ignore_index: target value to ignore.
      remat: activation checkpointing of the transformer blocks (`functrain.step.staged.parse_policy`):
        "none", "full" (recompute every block in backward) or an int N (every N-th block). Other
        than "none", the loss is a `functrain.step.staged.staged_loss` (embedding, blocks, and a head
        ln_f -> loss through the tied lm_head) whose `value_and_grad` the train step uses. The
        loss and gradients are the same as without remat (to float rounding); only memory and
        time change.
      staged: build the staged loss even with remat "none": on sharded (DTensor) params the train
        step then gathers each block's parameters just before it runs and reduce-scatters its
        gradients as soon as they exist (see `functrain.step.staged`), instead of gathering the whole
        model; on plain params it is the same as the unstaged loss.

    Returns:
      The loss function.

    Raises:
      ValueError: for a bad `remat` policy.

    Example:
      >>> step = make_train_step(make_loss_fn(template, chunk_size=1024), optim.adamw(3e-4))
      >>> step = make_train_step(make_loss_fn(template, remat=2), optim.adamw(3e-4))
    """
    head = head_name({n for n, _ in model.named_parameters()})
    return lm.make_lm_loss_fn(
        model,
        gpt_lib.stages(cast(gpt_lib.GPT, model)),
        head=head,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        remat=remat,
        staged=staged,
    )
