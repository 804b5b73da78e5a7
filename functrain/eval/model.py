"""What evaluation needs of a model: its logits on token ids, its tokenizer, its longest context.

Internals: docs/internals.md "functrain.eval.model".

Example:
    >>> model = of_module(net, tokenizer, block_size=256)
    >>> logits = model.logits(params, None, ids)          # (B, T, V)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from functrain import functional
from functrain.data.tokenizer import separator_ids

if TYPE_CHECKING:
    from functrain.generation.generator import CachedModel

__all__ = ["EvalModel", "of_module", "positions_of"]


class EvalModel(NamedTuple):
    """A causal LM as the evaluation functions see it.

    Attributes:
      logits: `(params, model_state, ids (B, T)) -> logits (B, T, V)`, in eval mode (no dropout), with
        no side effects; `model_state` is None for a model without buffers. For sharded (DTensor) params
        it gathers a stage at a time (every rank calls it: the gathers are collectives).
      tokenizer: `encode(text) -> ids` and `decode(ids) -> text`, adding no special tokens.
      block_size: the longest input the model takes (T <= block_size).
      prefix_id: the token an empty context starts from (the harness's `prefix_token_id`: BOS, else
        end-of-text; the byte tokenizer's newline).
      eos_id: the end-of-text id generation stops at, or None.
      positions: the longest input the model's positions allow (its config's `n_positions`,
        `max_position_embeddings` or `n_ctx`, as lm-eval's HFLM reads them), or None where that is the block.
      cached: the model as a `functrain.generation.CachedModel` (it attends through a KV cache: gpt, llama),
        or None; with it `Scorer.extend` generates on plain params through the cache.
    """

    logits: Callable[[Any, Any, torch.Tensor], torch.Tensor]
    tokenizer: Any
    block_size: int
    prefix_id: int
    eos_id: int | None = None
    positions: int | None = None
    cached: CachedModel | None = None


def positions_of(module: nn.Module) -> int | None:
    """The longest input a transformers module's config allows (HFLM's order: `n_positions`,
    `max_position_embeddings`, `n_ctx`; a composite config's `text_config` first), or None."""
    config = getattr(module, "config", None)
    for c in (getattr(config, "text_config", None), config):
        for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
            if isinstance(getattr(c, attr, None), int):
                return int(getattr(c, attr))
    return None


def _prefix_of(tokenizer) -> int:
    """The id an empty context starts from: the tokenizer's end-of-text, else its first separator id."""
    return separator_ids(tokenizer)[0]


def of_module(
    module: nn.Module, tokenizer, *, block_size: int, logits: Callable | None = None, prefix_id: int | None = None
) -> EvalModel:
    """An `EvalModel` of any module whose forward maps ids (B, T) to logits (B, T, V).

    Args:
      module: the module (a meta-device template is fine: the weights come from `params`).
      tokenizer: its tokenizer (`functrain.data.ByteTokenizer`, `HFTokenizer`, ...).
      block_size: the longest input it takes.
      logits: optional `(params, model_state, ids) -> (B, T, V)` instead of the forward (e.g. a
        transformers model's `.logits`); default `functrain.apply(module, params, ids, model_state=...,
        train=False)` (an output with `.logits` gives those).
      prefix_id: the empty context's token (default: the tokenizer's end-of-text, else its newline).

    Returns:
      The `EvalModel` (plain params only: give a family's for sharded ones).

    Example:
      >>> model = of_module(net, ByteTokenizer(), block_size=128)
      >>> scores = functrain.eval.loglikelihood(model, params, [("def f(x):", " return x")])
    """
    eos = getattr(tokenizer, "eos_id", None)
    return EvalModel(
        logits or (lambda p, ms, ids: _module_logits(module, p, ms, ids)),
        tokenizer,
        block_size,
        _prefix_of(tokenizer) if prefix_id is None else prefix_id,
        eos,
        positions_of(module),
    )


def _module_logits(module: nn.Module, params, model_state, ids: torch.Tensor) -> torch.Tensor:
    """The module's logits in eval mode, with its model state when it has one."""
    out = functional.apply(module, params, ids, model_state=model_state, train=False)
    if model_state is not None:
        out = out[0]  # (output, new model state): evaluation keeps the state as it was
    return getattr(out, "logits", out)
