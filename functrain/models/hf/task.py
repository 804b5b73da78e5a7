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

import torch

from functrain import config_checks, functional, parallel
from functrain import data as data_lib
from functrain.interop.hf import HFDirectory, HFError
from functrain.models import decoder, lm_data
from functrain.models import stages as stages_lib
from functrain.models.hf.export import export_directory
from functrain.models.hf.loss import make_loss_fn
from functrain.models.hf.model import (
    HFModelError,
    StagingError,
    build_template,
    head_name,
    init_params,
    load_config,
    stages,
    tp_rules,
)
from functrain.models.hf.tiny import model_directory
from functrain.task import Task

__all__ = ["build"]


def _refuse_axes(ctx, model_type: str) -> None:
    """One line for a mesh axis this family cannot split (the sequence: the attention is transformers')."""
    if ctx.cp_world > 1:
        raise config_checks.ConfigError(
            f"mesh.cp={ctx.cp_world}: the hf family ({model_type}) has no context parallelism yet; "
            "shard it with FSDP (--config.mesh.dp_shard) and set mesh.cp=1"
        )


def _with_buffers(model, template):
    """`model` (a tensor-parallel copy, made on meta) with the template's real buffers (rotary tables)."""
    if model is not template:
        for name, module in model.named_modules():
            source = template.get_submodule(name)
            module._buffers.update({n: source._buffers[n] for n, b in module._buffers.items() if b is not None})
    return model


def _load(weights, template, name: str, device, where):
    """Parameter `name` (this rank's block with `where`) from the directory's safetensors."""
    stored = name
    if name not in weights:  # checkpoints saved by the base model lack its prefix (e.g. GPT-2's "h.0...")
        stored = name.split(".", 1)[1] if name.startswith(f"{template.base_model_prefix}.") else name
    shape = tuple(template.get_parameter(name).shape)
    offset, local = where(name, shape) if where is not None else ([0] * len(shape), list(shape))
    if stored not in weights or tuple(weights.shape(stored)) != shape:
        found = tuple(weights.shape(stored)) if stored in weights else "missing"
        raise HFError(
            f"{weights.directory}: tensor {stored} is {found}, the model's config wants {shape}; "
            "the weights and config.json disagree"
        )
    return weights.read(stored, offset, local).to(device=device, dtype=torch.float32)


def _loss(config, ctx, model, template):
    """(the loss, whether it is staged): staged where the run asks for it; a model the family cannot stage trains
    unstaged (one line says so) where the run only asked for stages by default (`remat=auto` on a mesh), and
    is refused in one line naming the flags to change where the run asked for them."""
    remat, staged = stages_lib.resolve_remat(config.remat, ctx.mesh), stages_lib.wants_stages(config, ctx)
    try:
        return make_loss_fn(
            model, chunk_size=config.loss_chunk_size, remat=remat, staged=staged, probe=template
        ), staged or remat != "none"
    except StagingError as exc:
        asked = [
            flag
            for flag, on in (
                ("--config.remat=none", config.remat not in ("auto", "none")),
                ("--config.compile_unit=step", config.compile_unit == "blocks"),
                ("--config.mesh.pp=1", ctx.pp_world > 1),
            )
            if on
        ]
        if asked:
            raise HFModelError(f"{exc}; this family cannot stage it: train it with {' and '.join(asked)}") from None
        if ctx.is_main_process:
            print(
                f"functrain: note: {exc}; this family cannot stage it, so it trains unstaged: the whole model is "
                "gathered for each step",
                file=sys.stderr,
                flush=True,
            )
        return make_loss_fn(model, chunk_size=config.loss_chunk_size), False


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
        hf_config = load_config(path)
        directory = HFDirectory(path)
        has_weights = any(directory.path.glob("*.safetensors"))
        weights = directory.weights if has_weights and config.model.weights else None  # a bad shard fails now
    except (HFModelError, HFError) as exc:
        raise config_checks.ConfigError(f"model.path: {exc}") from None
    _refuse_axes(ctx, hf_config.model_type)
    place = lm_data.placement(config, ctx, workdir)
    tokenizer = lm_data.tokenizer_of(
        config, directory, place.cache_dir, fresh_vocab=hf_config.vocab_size, key="model.path"
    )
    tok_vocab = tokenizer.vocab_size if tokenizer is not None else 256
    if tok_vocab > hf_config.vocab_size:
        where = getattr(tokenizer, "path", "the byte tokenizer")
        raise data_lib.DataError(
            f"{where}: the tokenizer has {tok_vocab} ids but the model only {hf_config.vocab_size}; "
            "use the model's own tokenizer (--config.data.tokenizer)"
        )
    seq = config.model.block_size
    longest = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
    if longest and seq > longest:
        raise config_checks.ConfigError(
            f"model.block_size={seq} exceeds {directory.path / 'config.json'}'s {longest} positions; "
            "lower --config.model.block_size"
        )
    base = build_template(hf_config, device=ctx.device)
    heads = [getattr(hf_config, k, 0) for k in ("num_attention_heads", "num_key_value_heads")]
    if ctx.tp_world > 1 and any(h % ctx.tp_world for h in heads if h):
        raise config_checks.ConfigError(
            f"model.path: {hf_config.model_type}: {heads[0]} query and {heads[1]} key/value heads do not divide "
            f"by mesh.tp={ctx.tp_world} (each rank computes whole heads); change mesh.tp"
        )
    batching = data_lib.Batching.of(config, seq)
    dataset = data_lib.run_data(
        config.data, place, batching, tokenizer=tokenizer, vocab_size=hf_config.vocab_size, model_dir=directory.path
    )
    tokenizer_file = getattr(tokenizer, "path", None)

    def init(key, device, where=None):
        """Fresh params from `key`, or the directory's (only this rank's block of each with `where`)."""
        if weights is None:
            return init_params(base, key, device=device, where=where)
        return {name: _load(weights, base, name, device, where) for name, _ in base.named_parameters()}

    def build_model(template, rules) -> decoder.Built:
        """The tensor-parallel copy (with the template's buffers) and the loss, staged where the family can."""
        model = _with_buffers(parallel.tensor_parallel(template, ctx.mesh, rules), template)
        loss_fn, staged = _loss(config, ctx, model, base)  # (the staging probe: the base model's own forward)
        return decoder.Built(model, loss_fn, stages(template) if staged else None, _hf_logits(template), seq)

    spec = decoder.ModelSpec(
        base=base,
        tp_rules=lambda template: tp_rules(template) if ctx.tp_world > 1 else None,
        stages=stages,
        head=head_name,
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
    except HFModelError as exc:
        raise config_checks.ConfigError(f"model.path: {exc}") from None


def _hf_logits(template):
    """`(params, idx) -> (B, T, V)`: the transformers model's logits in eval mode."""
    return lambda p, idx: functional.apply(template, p, input_ids=idx, train=False).logits
