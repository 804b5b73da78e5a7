"""The Llama as a `functrain.task.Task`: its `decoder.ModelSpec`, fresh or from a Hugging Face directory (and
exported as one), over the run's tokenizer and data; `decoder.task` does the rest.

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
from functrain.interop.hf import HFDirectory, HFError, save_hf_directory
from functrain.models import decoder, lm_data
from functrain.models.llama import hf as hf_lib
from functrain.models.llama import model as llama_lib
from functrain.task import Task

__all__ = ["build"]

_FIX_VOCAB = "use the model's own tokenizer (--config.data.tokenizer) or a larger --config.model.vocab_size"


def _model_config(config: Any, hf: HFDirectory | None, vocab: int) -> llama_lib.LlamaConfig:
    """The LlamaConfig: the directory's (refused in one line), or the model.* keys with `vocab` ids."""
    if hf is None:
        return decoder.model_config(llama_lib.LlamaConfig, config.model, vocab)
    try:
        cfg = hf_lib.config_from_hf(hf.config, hf.path / "config.json")
    except HFError as exc:
        raise config_checks.ConfigError(f"init_from: {exc}") from None
    decoder.check_length(config.model.block_size, cfg.block_size, hf.path / "config.json")
    return cfg


def build(config: Any, ctx: parallel.ParallelContext, workdir: str | Path) -> Task:
    """The Llama `Task` for `config` (`configs/llama.py`; `init_from="hf:<dir>"` reads a directory's config and
    weights) on this process's place in `ctx`. Raises `ConfigError` / `DataError` in one line.

    Example:
      >>> task = build(get_config("tiny"), ctx, "runs/llama-tiny")
    """
    hf, weights = decoder.open_directory(config.init_from[3:], "init_from") if config.init_from else (None, None)
    text = lm_data.text_of(config, ctx, workdir, hf, fresh_vocab=config.model.vocab_size or 2048, key="init_from")
    cfg = _model_config(config, hf, config.model.vocab_size or text.vocab)
    decoder.check_heads(ctx, {"n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head}, "change the model or --config.mesh.tp")
    dataset = text.dataset(config, cfg.vocab_size, hf.path if hf is not None else None, _FIX_VOCAB)
    with torch.device("meta"):
        base = llama_lib.Llama(cfg)  # shapes only
    eos = getattr(text.tokenizer, "eos_id", None)
    hf_config = hf_lib.hf_llama_config(cfg, bos_token_id=eos, eos_token_id=eos)
    spec = decoder.ModelSpec(
        base=base,
        tp_rules=lambda template: llama_lib.TP_RULES,
        stages=llama_lib.stages,
        head=lambda template: llama_lib.head_name(cfg),
        init_params=decoder.init_or_read(base, weights, llama_lib.init_params, hf_lib.load_hf_params),
        export=lambda p, out: save_hf_directory(
            out, hf_lib.export_hf_llama(p, cfg), hf_config, tokenizer_file=text.file
        ),
        hf_name=hf_lib.hf_name,
        base_model=str(hf.path) if hf is not None else "",
    )
    heads, origin = f"{cfg.n_head}/{cfg.n_kv_head} heads", f"from {config.init_from}" if hf is not None else "fresh"
    describe = (
        f"Llama {llama_lib.num_params(cfg) / 1e6:.2f}M params ({cfg.n_layer} layers, d={cfg.n_embd}, {heads}, {origin})"
    )
    info = {"model": vars(cfg), "tokenizer": str(text.file or "bytes"), "init_from": config.init_from}
    flops = llama_lib.flops_per_token(dataclasses.replace(cfg, block_size=config.model.block_size))  # (trained length)
    facts = decoder.Facts(f"{describe}, {text.summary(cfg.vocab_size)}", config.model.block_size, flops, info)
    return decoder.task(config, ctx, workdir, spec, dataset, facts)
