"""Any transformers causal LM as a `functrain.task.Task`: a model directory -> tokenizer, data, model
(initialized from the run's key by transformers' own init, or its weights), loss, batches, FLOPs, a
text sample and the export of a directory transformers loads.

Internals: docs/internals.md "functrain.models.hf.task".

Example:
    >>> with parallel.setup(config.mesh) as ctx:
    ...     task = build(config, ctx, "runs/hf")
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from functrain import config_checks, generation, parallel
from functrain import data as data_lib
from functrain.interop.hf import HFDirectory, HFError
from functrain.models import decoder, lm_data
from functrain.models.hf import model as hf_lib
from functrain.models.hf.cache import cached_model
from functrain.models.hf.export import export_directory
from functrain.models.hf.loss import run_loss
from functrain.models.hf.tiny import model_directory
from functrain.models.hf.weights import read_params, with_buffers
from functrain.task import Task

__all__ = ["build", "refuse_axes"]


def build(config: Any, ctx: parallel.ParallelContext, workdir: str | Path) -> Task:
    """The Task of the transformers model in `config.model.path` on this process's place in `ctx`.

    Args:
      config: the run config (`configs/hf.py`), checked by `functrain.main.check_config`.
      ctx: the parallel context.
      workdir: the run directory (data cache and trained tokenizer in `<workdir>/data`, the export in
        `<workdir>/hf`).

    Returns:
      A `Task`.

    Raises:
      ConfigError: a bad key, an unusable directory, an encoder-decoder or mixture-of-experts model,
        a mesh axis the family cannot split (one line each).
      DataError: missing data, or a tokenizer whose vocabulary exceeds the model's.

    Example:
      >>> task = build(get_config(), ctx, "runs/hf")
    """
    try:
        path = model_directory(config.model.path, workdir)  # "tiny:qwen2": a tiny model written to the workdir
        hf_config = hf_lib.load_config(path)
        directory = HFDirectory(path)
        has_weights = any(directory.path.glob("*.safetensors"))
        weights = directory.weights if has_weights and config.model.weights else None  # a bad shard fails now
    except (hf_lib.HFModelError, HFError) as exc:
        raise config_checks.ConfigError(f"model.path: {exc}") from None
    refuse_axes(ctx, hf_config.model_type)
    place, seq = lm_data.placement(config, ctx, workdir), config.model.block_size
    tokenizer = lm_data.tokenizer_of(
        config, directory, place.cache_dir, fresh_vocab=hf_config.vocab_size, key="model.path"
    )
    lm_data.check_vocab(tokenizer, hf_config.vocab_size, "use the model's own tokenizer (--config.data.tokenizer)")
    longest = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
    decoder.check_length(seq, longest, directory.path / "config.json")
    heads = {k: getattr(hf_config, k, 0) for k in ("num_attention_heads", "num_key_value_heads")}
    decoder.check_heads(ctx, heads, f"{hf_config.model_type}: change --config.mesh.tp")
    base = hf_lib.build_template(hf_config, device=ctx.device)
    batching = data_lib.Batching.of(config, seq)
    dataset = data_lib.run_data(
        config.data, place, batching, tokenizer=tokenizer, vocab_size=hf_config.vocab_size, model_dir=directory.path
    )
    tokenizer_file = getattr(tokenizer, "path", None)

    def init(key, device, where=None):
        """Fresh params from `key`, or the directory's (only this rank's block of each with `where`)."""
        if weights is None:
            return hf_lib.init_params(base, key, device=device, where=where)
        return read_params(weights, base, device=device, where=where)

    def build_model(template, rules) -> decoder.Built:
        """The tensor-parallel copy (with the template's buffers) and the loss, staged where the family can."""
        model = with_buffers(parallel.tensor_parallel(template, ctx.mesh, rules), template)
        loss_fn, staged = run_loss(config, ctx, model, base)  # (the staging probe: the base model's own forward)
        st = hf_lib.stages(template) if staged else None
        return decoder.Built(model, loss_fn, st, hf_lib.eval_logits(template), seq, _cached(template, base, st, ctx))

    spec = decoder.ModelSpec(
        base=base,
        tp_rules=lambda template: hf_lib.tp_rules(template) if ctx.tp_world > 1 else None,
        stages=hf_lib.stages,
        head=hf_lib.head_name,
        init_params=init,
        # LoRA: the merged model, and the adapters as a PEFT directory over the model directory's weights
        export=lambda params, out: export_directory(out, hf_config, base, params, tokenizer_file=tokenizer_file),
        hf_name=str,
        base_model=str(directory.path) if weights is not None else "",
    )
    n_params = sum(p.numel() for p in base.parameters())
    layers, width = getattr(hf_config, "num_hidden_layers", 0), getattr(hf_config, "hidden_size", 0)
    origin = "its weights" if weights is not None else "fresh"
    describe = (
        f"{type(base).__name__} {n_params / 1e6:.2f}M params ({layers} layers, d={width}, {origin}), "
        f"vocab {hf_config.vocab_size} ({getattr(tokenizer, 'name', 'bytes')})"
    )
    # weights, and attention over the trained length (a LoRA run: no gradient of the frozen weights)
    flops = 6 * n_params + 12 * layers * width * seq
    info = {
        "model": hf_config.to_dict(),
        "path": str(directory.path),
        "weights": weights is not None,
        "tokenizer": str(tokenizer_file) if tokenizer_file else "bytes",
    }
    try:
        return decoder.task(config, ctx, workdir, spec, dataset, decoder.Facts(describe, seq, flops, info), build_model)
    except hf_lib.HFModelError as exc:
        raise config_checks.ConfigError(f"model.path: {exc}") from None


def _cached(template, base, st, ctx: parallel.ParallelContext) -> generation.CachedModel | None:
    """The model through a KV cache (sharded params: its stages `st`, when staged), or None (with a note line)
    where its probe refuses it: generation recomputes."""
    try:
        return cached_model(template, probe=base, stages=st, head=hf_lib.head_name(template))
    except hf_lib.HFModelError as exc:
        if ctx.is_main_process:
            print(f"functrain: note: {exc}; it generates without a KV cache", file=sys.stderr, flush=True)
        return None


def refuse_axes(ctx: parallel.ParallelContext, model_type: str) -> None:
    """Refuses, in one line, a mesh axis this family cannot split (the sequence: the attention is transformers').

    Example:
      >>> refuse_axes(ctx, "qwen2")
    """
    if ctx.cp_world > 1:
        raise config_checks.ConfigError(
            f"mesh.cp={ctx.cp_world}: the hf family ({model_type}) has no context parallelism yet; "
            "shard it with FSDP (--config.mesh.dp_shard) and set mesh.cp=1"
        )
