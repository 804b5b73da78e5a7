"""A trained decoder LM run for its outputs: sampling (`generate`) and the `functrain.eval.EvalModel` of a
family (`eval_model`), on plain params or on sharded ones gathered a stage at a time.

Example:
    >>> out = generate(template, params, torch.tensor([[10]]), 100, key=rng.key(1))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from functrain import functional, generation, parallel
from functrain.eval import EvalModel, of_module
from functrain.models.stages import LMStages

__all__ = ["eval_model", "generate"]


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

    The whole context again for every token (cropped to the last `model.cfg.block_size` tokens): the
    reference of `functrain.generation.generator`, which keeps a KV cache, and the path of sharded params and
    models without a cache. At step i row b's logits are divided by `temperature`, restricted to the `top_k`
    largest and drawn from as `generation.pick` draws with row b's key `request_keys(key, [(b, 0)])`: the same
    tokens as `Generator` (prompt b's first sample) on the same logits. `temperature=0` picks the argmax. No
    global RNG is used: the same (params, prompt, key) give the same tokens.

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
    sampling = generation.Sampling(temperature, top_k or 0)
    keys = None if sampling.greedy else generation.request_keys(key, [(b, 0) for b in range(idx.shape[0])])
    with torch.no_grad():
        for i in range(max_new_tokens):
            ctx = idx[:, -context:]  # (B, T<=block_size)
            if stages is not None and head is not None and staged:
                logits = _staged_logits(stages, head, params, ctx, parallel.gather)[:, -1, :].float()  # (B, V)
            else:
                logits = logits_fn(params, ctx)[:, -1, :].float()  # (B, V)
            nxt, _ = generation.pick(logits, keys, i, sampling)  # (B,)
            idx = torch.cat([idx, nxt[:, None]], dim=1)
    return idx[0] if squeeze else idx


def eval_model(
    template: nn.Module,
    tokenizer,
    *,
    block_size: int,
    stages: LMStages | None,
    head: str | None,
    logits_fn: Callable | None = None,
    cached: generation.CachedModel | None = None,
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
      cached: the model through a KV cache, for generation (default: the family's own forward's,
        `cached_model(template, stages, head)`, when there is no `logits_fn`; else none: generation recomputes).

    Returns:
      The `EvalModel` (`Task.eval_model`), generating through `cached` (`EvalModel.cached`).

    Example:
      >>> model = inference.eval_model(template, tok, block_size=128, stages=gpt.stages(template), head="wte.weight")
    """
    plain = logits_fn or (lambda p, idx: functional.apply(template, p, idx, train=False))

    def logits(params, model_state, idx):
        """(B, T, V) logits of `idx`; DTensor params gathered a stage at a time (or whole without stages)."""
        if not any(parallel.is_dtensor(t) for t in params.values()):
            return plain(params, idx)
        if stages is None or head is None:
            return plain(parallel.gather(params), idx)
        return _staged_logits(stages, head, params, idx, parallel.gather)

    model = of_module(template, tokenizer, block_size=block_size, logits=logits)
    if cached is None and logits_fn is None:
        cached = cached_model(template, stages, head)
    return model._replace(cached=cached)


def _staged_logits(stages: LMStages, head: str, params, idx: torch.Tensor, gather: Callable, view=None) -> torch.Tensor:
    """Logits (B, T, V): every stage run on `gather` of its own params only (one stage held at a time); through
    a KV cache's `view` (`generation.kv_cache.Cached`) when given. (`gather`: whole tensors, or a tensor-parallel
    copy's stages on this rank's shards, `Layout.gather`: the head is replicated on the tp axis.)"""
    h = stages.embed.fn(gather(stages.embed.params(params)), idx, None, view)  # (B, T, C)
    for i, block in enumerate(stages.blocks):
        h = block.fn(gather(block.params(params)), h, None, None if view is None else view.layer(i))  # (B, T, C)
    h = stages.final.fn(gather(stages.final.params(params)), h, None)  # (B, T, C)
    return F.linear(h, gather({head: params[head]})[head])  # (B, T, V): the forward's lm_head


def cached_model(
    template: nn.Module, stages: LMStages | None, head: str | None, tp_stages: LMStages | None = None, tp_size: int = 1
) -> generation.CachedModel:
    """A gpt or llama template through its KV cache (`generation.CachedModel.of`), on sharded params too when
    given its stages: their `sharded_forward` gathers one stage at a time, as the recompute path does, so no
    rank holds the whole model, and each token costs a gather of every stage but reads the cache. With
    `tp_stages` (a tensor-parallel copy's) each stage is gathered over the data-parallel axes only and runs on
    this rank's heads, the tensor-parallel plan training runs: its cache holds this rank's kv heads.

    Args:
      template: the (meta-device) gpt or llama template.
      stages: its `LMStages` (of the template, not a tensor-parallel copy: each stage is gathered whole), or None.
      head: the output projection's weight name, with `stages`.
      tp_stages: the stages of `parallel.tensor_parallel(template, mesh, rules)` (a tp axis of size > 1), or None.
      tp_size: the tp axis' size, with `tp_stages` (it divides the kv heads: `decoder.check_heads`).

    Returns:
      The `CachedModel`.

    Example:
      >>> gen = generation.Generator(cached_model(template, gpt.stages(template), "wte.weight"), compile=False)
    """
    cached = generation.CachedModel.of(template)
    if stages is None or head is None:
        return cached
    if tp_stages is None:
        return cached._replace(sharded_forward=staged_forward(stages, head))
    heads = cached.cache_shape[1] // tp_size
    return cached._replace(sharded_forward=staged_forward(tp_stages, head, tp=True), sharded_kv_heads=heads)


def staged_forward(stages: LMStages, head: str, *, tp: bool = False) -> Callable:
    """`forward(params, idx, view) -> logits (B, T, V)` on sharded params: every stage gathered just before it
    runs (one held at a time), the blocks given `view.layer(i)` where training passes packed rows' layout.

    Args:
      stages: the model's `LMStages`: of the template (each stage gathered whole), or with `tp` of its
        tensor-parallel copy (each stage gathered over the data-parallel axes only, `Layout.gather`: the rank's
        own heads, the head replicated).
      head: the output projection's weight name.
      tp: `stages` are a tensor-parallel copy's.

    Returns:
      The forward (a `generation.CachedModel`'s `sharded_forward`).

    Example:
      >>> logits = staged_forward(gpt.stages(template), "wte.weight")(sharded, idx, view)
    """

    def forward(params, idx, view):
        gather = parallel.layout_of(params).gather if tp else parallel.gather
        return _staged_logits(stages, head, params, idx, gather, view)

    return forward
