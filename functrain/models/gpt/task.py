"""The GPT as a `functrain.task.Task`: its `decoder.ModelSpec` over the run's data (`decoder.task` does the rest).

Example:
    >>> with parallel.setup(config.mesh) as ctx:
    ...     task = build(config, ctx, "runs/gpt")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from functrain import data as data_lib
from functrain import parallel
from functrain.interop.hf import save_hf_directory
from functrain.models import decoder, lm_data
from functrain.models.gpt import model as gpt_lib
from functrain.models.gpt.hf import export_hf_gpt2, hf_gpt2_config
from functrain.task import Task

__all__ = ["build"]


def build(config: Any, ctx: parallel.ParallelContext, workdir: str | Path) -> Task:
    """The GPT `Task` for `config` (`configs/gpt.py`) on this process's place in `ctx`; data cached in
    `<workdir>/data` unless `data.cache_dir`. Raises `ConfigError` / `DataError` in one line.

    Example:
      >>> task = build(get_config("tiny"), ctx, "runs/tiny")
    """
    m = config.model
    decoder.model_config(gpt_lib.GPTConfig, m, max(m.vocab_size, 1))  # its own checks, before the data is read
    decoder.check_heads(ctx, {"model.n_head": m.n_head}, "change --config.model.n_head or --config.mesh.tp")
    place, batching = lm_data.placement(config, ctx, workdir), data_lib.Batching.of(config, m.block_size)
    dataset = data_lib.run_data(config.data, place, batching, vocab_size=m.vocab_size or None)
    cfg = decoder.model_config(gpt_lib.GPTConfig, m, decoder.vocab_of(m.vocab_size, dataset.vocab_size))
    with torch.device("meta"):
        base = gpt_lib.GPT(cfg)  # shapes only; the state holds the real tensors
    spec = decoder.ModelSpec(
        base=base,
        tp_rules=lambda template: gpt_lib.TP_RULES,
        stages=gpt_lib.stages,
        head=lambda template: gpt_lib.head_name(dict(template.named_parameters())),
        init_params=decoder.init_or_read(base, None, gpt_lib.init_params),
        # (LoRA: no PEFT directory, HF's GPT-2 fuses q, k and v)
        export=lambda params, out: save_hf_directory(out, export_hf_gpt2(params, cfg), hf_gpt2_config(cfg)),
    )
    n = gpt_lib.num_params(cfg) / 1e6
    describe = f"GPT {n:.2f}M params ({cfg.n_layer} layers, d={cfg.n_embd}), vocab {cfg.vocab_size}"
    facts = decoder.Facts(describe, cfg.block_size, gpt_lib.flops_per_token(cfg))
    return decoder.task(config, ctx, workdir, spec, dataset, facts)
