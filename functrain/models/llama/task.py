"""The Llama as a `functrain.task.Task`: config -> tokenizer, data, and its `decoder.ModelSpec` (fresh or from
a Hugging Face directory, exported as one); `decoder.task` does the rest.

Internals: docs/internals.md "functrain.models.llama.task".

Example:
    >>> with parallel.setup(config.mesh) as ctx:
    ...     task = build(config, ctx, "runs/llama")
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from functrain import config_checks, parallel
from functrain import data as data_lib
from functrain.interop.hf import HFDirectory, HFError, save_hf_directory
from functrain.models import decoder, lm_data
from functrain.models.llama import hf as hf_lib
from functrain.models.llama import model as llama_lib
from functrain.task import Task

__all__ = ["build"]


def _model_config(config: Any, hf: HFDirectory | None, vocab: int) -> llama_lib.LlamaConfig:
    """The LlamaConfig: the HF directory's, or the model.* keys with `vocab` ids."""
    if hf is None:
        return decoder.model_config(llama_lib.LlamaConfig, config.model, vocab)
    cfg = hf_lib.config_from_hf(hf.config, hf.path / "config.json")
    decoder.check_length(config.model.block_size, cfg.block_size, hf.path / "config.json")
    return cfg


def build(config: Any, ctx: parallel.ParallelContext, workdir: str | Path) -> Task:
    """The Llama `Task` for `config` on this process's place in `ctx`.

    Args:
      config: the run config (`configs/llama.py`), checked by `functrain.main.check_config`.
      ctx: the parallel context.
      workdir: the run directory (data cache and trained tokenizer in `<workdir>/data`, the Hugging
        Face export in `<workdir>/hf`).

    Returns:
      A `Task`; with `init_from="hf:<dir>"` its `init_params` reads the directory's weights.

    Raises:
      ConfigError: a bad key, or an unusable Hugging Face directory (one line naming the file).
      DataError: missing data, or a tokenizer whose vocabulary exceeds the model's (naming it).

    Example:
      >>> task = build(get_config("tiny"), ctx, "runs/llama-tiny")
    """
    try:
        hf = HFDirectory(config.init_from[3:]) if config.init_from else None
        weights = hf.weights if hf is not None else None  # opened now: a missing shard fails before anything else
        place = lm_data.placement(config, ctx, workdir)
        tokenizer = lm_data.tokenizer_of(
            config, hf, place.cache_dir, fresh_vocab=config.model.vocab_size or 2048, key="init_from"
        )
        tok_vocab = tokenizer.vocab_size if tokenizer is not None else 256
        cfg = _model_config(config, hf, config.model.vocab_size or tok_vocab)
    except HFError as exc:
        raise config_checks.ConfigError(f"init_from: {exc}") from None
    fix = "use the model's own tokenizer (--config.data.tokenizer) or a larger --config.model.vocab_size"
    lm_data.check_vocab(tokenizer, cfg.vocab_size, fix)
    heads = {"n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head}
    decoder.check_heads(ctx, heads, "change the model or --config.mesh.tp")
    seq = config.model.block_size
    dataset = data_lib.run_data(
        config.data,
        place,
        data_lib.Batching.of(config, seq),
        tokenizer=tokenizer,
        vocab_size=cfg.vocab_size,
        model_dir=hf.path if hf is not None else None,
    )
    with torch.device("meta"):
        base = llama_lib.Llama(cfg)  # shapes only
    tokenizer_file = getattr(tokenizer, "path", None)

    def init_params(key, device, where=None):
        """Fresh params from `key`, or the Hugging Face directory's (only this rank's blocks with `where`)."""
        if weights is not None:
            return hf_lib.load_hf_params(weights, base, device=device, where=where)
        return llama_lib.init_params(base, key, device=device, where=where)

    def export(params, out):
        """Writes `params` as a Hugging Face directory `out` (config, weights, tokenizer)."""
        eos = getattr(tokenizer, "eos_id", None)
        hf_config = hf_lib.hf_llama_config(cfg, bos_token_id=eos, eos_token_id=eos)
        return save_hf_directory(out, hf_lib.export_hf_llama(params, cfg), hf_config, tokenizer_file=tokenizer_file)

    spec = decoder.ModelSpec(
        base=base,
        tp_rules=lambda template: llama_lib.TP_RULES,
        stages=llama_lib.stages,
        head=lambda template: llama_lib.head_name(cfg),
        init_params=init_params,
        export=export,
        hf_name=hf_lib.hf_name,
        base_model=str(hf.path) if hf is not None else "",
    )
    n_params = llama_lib.num_params(cfg)
    origin = f"from {config.init_from}" if hf is not None else "fresh"
    describe = (
        f"Llama {n_params / 1e6:.2f}M params ({cfg.n_layer} layers, d={cfg.n_embd}, {cfg.n_head}/"
        f"{cfg.n_kv_head} heads, {origin}), vocab {cfg.vocab_size} ({getattr(tokenizer, 'name', 'bytes')})"
    )
    info = {
        "model": vars(cfg),
        "tokenizer": str(tokenizer_file) if tokenizer_file else "bytes",
        "init_from": config.init_from,
    }
    flops = llama_lib.flops_per_token(dataclasses.replace(cfg, block_size=seq))  # (the trained length)
    return decoder.task(config, ctx, workdir, spec, dataset, decoder.Facts(describe, seq, flops, info))
