"""The GPT as a `functrain.task.Task`: config -> data, model, loss, batches, FLOPs and a text sample.

Internals: docs/internals.md "functrain.models.gpt.task".

Example:
    >>> with parallel.setup(config.mesh) as ctx:
    ...     task = build(config, ctx, "runs/gpt")
    ...     loop.run(task, optimizer.from_config(config.optim, config.steps), config, "runs/gpt", ctx)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch

from functrain import config_checks, parallel
from functrain.interop.hf import save_hf_directory
from functrain.models import lm, lm_data, lm_lora
from functrain.models.gpt import model as gpt_lib
from functrain.models.gpt.checks import CHECKS
from functrain.models.gpt.hf import export_hf_gpt2, hf_gpt2_config
from functrain.models.gpt.loss import head_name, make_loss_fn
from functrain.models.lm_task import lm_task
from functrain.task import Task

__all__ = ["CHECKS", "build"]


def build(config: Any, ctx: parallel.ParallelContext, workdir: str | Path) -> Task:
    """The GPT `Task` for `config` on this process's place in `ctx`.

    Args:
      config: the run config (`configs/gpt.py`), checked by `functrain.main.check_config`.
      ctx: the parallel context (mesh, dp rank and world, device).
      workdir: the run directory (the data cache goes to `<workdir>/data` by default).

    Returns:
      A `Task`; its batches are this dp rank's rows, its loss runs the tensor-parallel copy of the
      model when the mesh has a tp axis.

    Raises:
      ConfigError: a model/data/sample key out of range (one line).
      DataError: the data path is missing or unusable.

    Example:
      >>> task = build(get_config("tiny"), ctx, "runs/tiny")
    """
    m = config.model
    try:  # GPTConfig checks its own invariants (n_head divides n_embd)
        gpt_lib.GPTConfig(
            vocab_size=max(m.vocab_size, 1),
            block_size=m.block_size,
            n_layer=m.n_layer,
            n_head=m.n_head,
            n_embd=m.n_embd,
            dropout=m.dropout,
            bias=m.bias,
        )
    except ValueError as exc:
        raise config_checks.ConfigError(f"model: {exc} (--config.model.n_embd / --config.model.n_head)") from None
    if ctx.tp_world > 1 and m.n_head % ctx.tp_world:
        raise config_checks.ConfigError(
            f"model.n_head={m.n_head} must divide by the tensor-parallel size {ctx.tp_world} (each rank "
            "computes whole heads); change --config.model.n_head or --config.mesh.tp"
        )
    cache_dir = config.data.cache_dir or str(Path(workdir) / "data")
    dataset = lm_data.load_data(config, ctx, cache_dir, block_size=m.block_size, vocab_size=m.vocab_size or None)
    vocab = m.vocab_size or dataset.vocab_size
    if vocab < dataset.vocab_size:
        raise config_checks.ConfigError(
            f"model.vocab_size={vocab} is smaller than the data's vocabulary ({dataset.vocab_size}); set "
            "model.vocab_size=0 to take it from the data (--config.model.vocab_size)"
        )
    cfg = gpt_lib.GPTConfig(
        vocab_size=vocab,
        block_size=m.block_size,
        n_layer=m.n_layer,
        n_head=m.n_head,
        n_embd=m.n_embd,
        dropout=m.dropout,
        bias=m.bias,
    )
    with torch.device("meta"):
        base = gpt_lib.GPT(cfg)  # shapes only; the state holds the real tensors
    template, lora_spec = lm_lora.wrap(base, config, ctx)  # with adapters under --config.lora.rank
    rules = parallel.adapter_rules(template, parallel.default_rules(gpt_lib.TP_RULES))  # (adapters: their layer's)
    # the cp copy (positions and attention of this rank's tokens), then the tp copy: `template` without either
    model = lm.context_model(template, ctx, m.block_size, config.get("cp_attention", "zigzag"))
    model = parallel.tensor_parallel(model, ctx.mesh, rules)
    # sharded: staged, so each block is gathered just before it runs; "auto" recomputes the blocks on
    # a mesh so their gathered params go after the forward (never the whole model), none on 1 process
    remat = lm.resolve_remat(config.remat, ctx.mesh)
    lm_data.check_packing(config, ctx)
    loss_fn = make_loss_fn(model, chunk_size=config.loss_chunk_size, remat=remat, staged=lm.wants_stages(config, ctx))
    sample = config.sample

    def finish(params, key):
        """A text sample from the prompt (or the answer to a held-out prompt), drawn from `key` (sharded params:
        gathered a stage at a time)."""
        return lm_data.finish_text(
            dataset,
            sample,
            lambda prompt, n: gpt_lib.generate(
                template,
                params,
                prompt,
                n,
                temperature=sample.temperature,
                top_k=sample.top_k or None,
                key=key,
                stages=gpt_lib.stages(cast(gpt_lib.GPT, template)),
                head=head_name(params),
            ),
            ctx.device,
        )

    def export(params, out):
        """Writes `params` as a Hugging Face GPT-2 directory `out` (config.json, model.safetensors)."""
        return save_hf_directory(out, export_hf_gpt2(params, cfg), hf_gpt2_config(cfg))

    def init(key, device, where=None):
        """The base's fresh params (this rank's block of each with `where`)."""
        return gpt_lib.init_params(base, key, device=device, where=where)

    n_params = gpt_lib.num_params(cfg)
    return lm_task(
        config,
        dataset,
        template,
        lora_spec,
        describe=f"GPT {n_params / 1e6:.2f}M params ({cfg.n_layer} layers, d={cfg.n_embd}), vocab {vocab}",
        init_params=init,
        shard_rules=rules,
        loss_fn=loss_fn,
        seq=cfg.block_size,
        flops_per_token=gpt_lib.flops_per_token(cfg),
        finish=finish,
        export=lm_lora.exporter(export, template, lora_spec, hf_name=None),  # (HF's GPT-2 fuses q, k, v)
        stages=gpt_lib.stages(cast(gpt_lib.GPT, template)),
        head=head_name(dict(template.named_parameters())),
    )
