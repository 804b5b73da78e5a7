"""The Llama's loss: next-token cross-entropy through its head (the tied embedding or `lm_head`),
plain, chunked or as `functrain.step.staged` stages (which also give the per-block sharded step).

Example:
    >>> loss_fn = make_loss_fn(template, chunk_size=1024, remat="full")
    >>> step = make_train_step(loss_fn, optim.adamw(3e-4))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from torch import nn

from functrain.models import lm
from functrain.models.llama import model as llama_lib

__all__ = ["make_loss_fn"]


def head_name(cfg) -> str:
    """The output projection's weight: the token embedding when tied, else `lm_head.weight`."""
    return "embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"


def make_loss_fn(
    model: nn.Module, *, chunk_size: int = 0, ignore_index: int = -1, remat: str | int = "none", staged: bool = False
) -> Callable:
    """`loss_fn(params, (x, y), key) -> (loss, {})` of a `Llama` (see `functrain.models.lm.make_lm_loss_fn`).

    Args:
      model: the (meta-device) Llama template, or its tensor-parallel copy.
      chunk_size: > 0: chunked cross-entropy (the logits never exist whole); 0: plain.
      ignore_index: target value to ignore.
      remat: "none", "full" or N: recompute blocks in the backward.
      staged: stages even without remat (per-block gather on sharded params).

    Returns:
      The loss function.

    Example:
      >>> loss, aux = make_loss_fn(template)(params, (x, y), None)
    """
    return lm.make_lm_loss_fn(
        model,
        llama_lib.stages(cast(llama_lib.Llama, model)),
        head=head_name(model.cfg),
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        remat=remat,
        staged=staged,
    )
