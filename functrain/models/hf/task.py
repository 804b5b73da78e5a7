"""Any transformers causal LM as a `functrain.task.Task`: a model directory -> tokenizer, data, model
(initialized from the run's key by transformers' own init, or its weights), loss, batches, FLOPs, a
text sample and the export of a directory transformers loads.

Internals: docs/internals.md "functrain.models.hf.task".

Example:
    >>> with parallel.setup(config.mesh) as ctx:
    ...     task = build(config, ctx, "runs/hf")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from functrain import config_checks, parallel
from functrain.interop.hf import HFError
from functrain.models import decoder, lm_data
from functrain.models.hf import model as hf_lib
from functrain.models.hf.cache import run_cache
from functrain.models.hf.export import export_directory
from functrain.models.hf.loss import run_loss
from functrain.models.hf.tiny import model_directory
from functrain.models.hf.weights import read_params, with_buffers
from functrain.task import Task

__all__ = ["build"]


def build(config: Any, ctx: parallel.ParallelContext, workdir: str | Path) -> Task:
    """The Task of the transformers model in `config.model.path` (`configs/hf.py`: its weights, or fresh from the run's
    key by transformers' own init) on this process's place in `ctx`. Raises `ConfigError` / `DataError` in one line:
    an unusable directory, an encoder-decoder or mixture-of-experts model, a mesh axis the family cannot split.

    Example:
      >>> task = build(get_config(), ctx, "runs/hf")
    """
    try:
        path = model_directory(config.model.path, workdir)  # "tiny:qwen2": a tiny model written to the workdir
        hf_config = hf_lib.load_config(path)
    except (hf_lib.HFModelError, HFError) as exc:
        raise config_checks.ConfigError(f"model.path: {exc}") from None
    has_weights = config.model.weights and any(Path(path).glob("*.safetensors"))
    directory, weights = decoder.open_directory(path, "model.path", weights=has_weights)
    hf_lib.refuse_axes(ctx, hf_config.model_type)
    text = lm_data.text_of(config, ctx, workdir, directory, fresh_vocab=hf_config.vocab_size, key="model.path")
    seq, longest = config.model.block_size, getattr(hf_config, "max_position_embeddings", None)
    decoder.check_length(seq, longest or getattr(hf_config, "n_positions", None), directory.path / "config.json")
    heads = {k: getattr(hf_config, k, 0) for k in ("num_attention_heads", "num_key_value_heads")}
    decoder.check_heads(ctx, heads, f"{hf_config.model_type}: change --config.mesh.tp")
    fix = "use the model's own tokenizer (--config.data.tokenizer)"
    dataset = text.dataset(config, hf_config.vocab_size, directory.path, fix)
    base = hf_lib.build_template(hf_config, device=ctx.device)

    def build_model(template, rules) -> decoder.Built:
        """The tensor-parallel copy (with the template's buffers) and the loss, staged where the family can."""
        model = with_buffers(parallel.tensor_parallel(template, ctx.mesh, rules), template)
        loss_fn, staged = run_loss(config, ctx, model, base)  # (the staging probe: the base model's own forward)
        st = hf_lib.stages(template) if staged else None
        cached = run_cache(ctx, template, base, st, model if ctx.tp_world > 1 else None)  # (tp: the rank's heads)
        return decoder.Built(model, loss_fn, st, hf_lib.eval_logits(template), seq, cached)

    spec = decoder.ModelSpec(
        base=base,
        tp_rules=lambda template: hf_lib.tp_rules(template) if ctx.tp_world > 1 else None,
        stages=hf_lib.stages,
        head=hf_lib.head_name,
        init_params=decoder.init_or_read(base, weights, hf_lib.init_params, read_params),
        # LoRA: the merged model, and the adapters as a PEFT directory over the model directory's weights
        export=lambda params, out: export_directory(out, hf_config, base, params, tokenizer_file=text.file),
        hf_name=str,
        base_model=str(directory.path) if weights is not None else "",
    )
    n_params = sum(p.numel() for p in base.parameters())
    layers, width = getattr(hf_config, "num_hidden_layers", 0), getattr(hf_config, "hidden_size", 0)
    origin = "its weights" if weights is not None else "fresh"
    describe = f"{type(base).__name__} {n_params / 1e6:.2f}M params ({layers} layers, d={width}, {origin})"
    # weights, and attention over the trained length (a LoRA run: no gradient of the frozen weights)
    flops = 6 * n_params + 12 * layers * width * seq
    info = {"model": hf_config.to_dict(), "path": str(directory.path), "weights": weights is not None}
    info["tokenizer"] = str(text.file or "bytes")
    facts = decoder.Facts(f"{describe}, {text.summary(hf_config.vocab_size)}", seq, flops, info)
    try:
        return decoder.task(config, ctx, workdir, spec, dataset, facts, build_model)
    except hf_lib.HFModelError as exc:
        raise config_checks.ConfigError(f"model.path: {exc}") from None
