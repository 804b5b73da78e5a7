"""The Llama as a `functrain.task.Task`: config -> tokenizer, data, model (fresh or from a Hugging
Face directory), loss, batches, FLOPs, a text sample and the Hugging Face export.

Internals: docs/internals.md "functrain.models.llama.task".

Example:
    >>> with parallel.setup(config.mesh) as ctx:
    ...     task = build(config, ctx, "runs/llama")
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, cast

import torch

from functrain import config_checks, parallel
from functrain import data as data_lib
from functrain.interop.hf import HFDirectory, HFError, save_hf_directory
from functrain.models import lm, lm_data, lm_lora
from functrain.models.llama import hf as hf_lib
from functrain.models.llama import model as llama_lib
from functrain.models.llama.checks import CHECKS
from functrain.models.llama.loss import head_name, make_loss_fn
from functrain.models.lm_task import lm_task
from functrain.task import Task

__all__ = ["CHECKS", "build"]


def _model_config(config: Any, hf: HFDirectory | None, vocab: int) -> llama_lib.LlamaConfig:
    """The LlamaConfig: the HF directory's, or the model.* keys with `vocab` ids."""
    if hf is not None:
        cfg = hf_lib.config_from_hf(hf.config, hf.path / "config.json")
        if config.model.block_size > cfg.block_size:
            raise config_checks.ConfigError(
                f"model.block_size={config.model.block_size} exceeds {hf.path / 'config.json'}'s "
                f"max_position_embeddings={cfg.block_size}; lower --config.model.block_size"
            )
        return cfg
    m = config.model
    try:
        return llama_lib.LlamaConfig(
            vocab_size=vocab,
            block_size=m.block_size,
            n_layer=m.n_layer,
            n_head=m.n_head,
            n_kv_head=m.n_kv_head,
            n_embd=m.n_embd,
            intermediate_size=m.intermediate_size,
            head_dim=m.head_dim,
            rope_theta=m.rope_theta,
            norm_eps=m.norm_eps,
            tie_embeddings=m.tie_embeddings,
            dropout=m.dropout,
        )
    except ValueError as exc:
        raise config_checks.ConfigError(f"model: {exc} (--config.model.*)") from None


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
        cache_dir = config.data.cache_dir or str(Path(workdir) / "data")
        tokenizer = lm_data.tokenizer_of(
            config, hf, cache_dir, fresh_vocab=config.model.vocab_size or 2048, key="init_from"
        )
        tok_vocab = tokenizer.vocab_size if tokenizer is not None else 256
        cfg = _model_config(config, hf, config.model.vocab_size or tok_vocab)
    except HFError as exc:
        raise config_checks.ConfigError(f"init_from: {exc}") from None
    if tok_vocab > cfg.vocab_size:
        where = getattr(tokenizer, "path", "the byte tokenizer")
        raise data_lib.DataError(
            f"{where}: the tokenizer has {tok_vocab} ids but the model only {cfg.vocab_size}; use the model's own "
            "tokenizer (--config.data.tokenizer) or a larger --config.model.vocab_size"
        )
    if ctx.tp_world > 1 and (cfg.n_head % ctx.tp_world or cfg.n_kv_head % ctx.tp_world):
        raise config_checks.ConfigError(
            f"n_head={cfg.n_head} and n_kv_head={cfg.n_kv_head} must divide by the tensor-parallel size "
            f"{ctx.tp_world} (each rank computes whole heads); change the model or --config.mesh.tp"
        )
    seq = config.model.block_size
    dataset = lm_data.load_data(
        config,
        ctx,
        cache_dir,
        block_size=seq,
        vocab_size=cfg.vocab_size,
        tokenizer=tokenizer,
        model_dir=hf.path if hf is not None else None,
    )
    with torch.device("meta"):
        base = llama_lib.Llama(cfg)  # shapes only
    template, lora_spec = lm_lora.wrap(base, config, ctx)  # with adapters under --config.lora.rank
    rules = parallel.adapter_rules(template, parallel.default_rules(llama_lib.TP_RULES))  # (adapters: their layer's)
    model = lm.context_model(template, ctx, seq, config.get("cp_attention", "zigzag"))
    model = parallel.tensor_parallel(model, ctx.mesh, rules)
    remat = lm.resolve_remat(config.remat, ctx.mesh)
    lm_data.check_packing(config, ctx)
    loss_fn = make_loss_fn(model, chunk_size=config.loss_chunk_size, remat=remat, staged=lm.wants_stages(config, ctx))
    sample = config.sample
    tokenizer_file = getattr(tokenizer, "path", None)
    if ctx.is_main_process:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        info = {
            "model": vars(cfg),
            "tokenizer": str(tokenizer_file) if tokenizer_file else "bytes",
            "init_from": config.init_from,
        }
        (Path(workdir) / "model.json").write_text(json.dumps(info, indent=2) + "\n")

    def init_params(key, device, where=None):
        """Fresh params from `key`, or the Hugging Face directory's (only this rank's blocks with `where`)."""
        if weights is not None:
            return hf_lib.load_hf_params(weights, base, device=device, where=where)
        return llama_lib.init_params(base, key, device=device, where=where)

    def export_base(params, out):
        """Writes `params` as a Hugging Face directory `out` (config, weights, tokenizer)."""
        eos = getattr(tokenizer, "eos_id", None)
        return save_hf_directory(
            out,
            hf_lib.export_hf_llama(params, cfg),
            hf_lib.hf_llama_config(cfg, bos_token_id=eos, eos_token_id=eos),
            tokenizer_file=tokenizer_file,
        )

    # LoRA: the merged model, and the adapters as a PEFT directory (transformers' Llama names)
    export = lm_lora.exporter(
        export_base, template, lora_spec, hf_name=hf_lib.hf_name, base_model=str(hf.path) if hf is not None else ""
    )

    def finish(params, key):
        """A text sample from the prompt (sharded params: gathered a stage at a time)."""
        return lm_data.finish_text(
            dataset,
            sample,
            lambda prompt, n: lm.generate(
                template,
                params,
                prompt,
                n,
                temperature=sample.temperature,
                top_k=sample.top_k or None,
                key=key,
                stages=llama_lib.stages(cast(llama_lib.Llama, template)),
                head=head_name(cfg),
            ),
            ctx.device,
        )

    n_params = llama_lib.num_params(cfg)
    origin = f"from {config.init_from}" if hf is not None else "fresh"
    return lm_task(
        config,
        dataset,
        template,
        lora_spec,
        describe=(
            f"Llama {n_params / 1e6:.2f}M params ({cfg.n_layer} layers, d={cfg.n_embd}, {cfg.n_head}/"
            f"{cfg.n_kv_head} heads, {origin}), vocab {cfg.vocab_size} ({getattr(tokenizer, 'name', 'bytes')})"
        ),
        init_params=init_params,
        shard_rules=rules,
        loss_fn=loss_fn,
        seq=seq,
        flops_per_token=llama_lib.flops_per_token(dataclasses.replace(cfg, block_size=seq)),  # (the trained length)
        finish=finish,
        export=export,
        stages=llama_lib.stages(cast(llama_lib.Llama, template)),
        head=head_name(cfg),
        hf_name=hf_lib.hf_name,
        base_model=str(hf.path) if hf is not None else "",
    )
