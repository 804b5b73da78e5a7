"""The `Task` of a language-model family: the parts every LM family shares, built in one place.

Example:
    >>> return lm_task(config, dataset, template, lora_spec, describe="GPT 0.84M params", init_params=init,
    ...                shard_rules=rules, loss_fn=loss_fn, seq=cfg.block_size, flops_per_token=flops,
    ...                finish=finish, export=export, stages=gpt.stages(template), head="lm_head.weight")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from functrain.models import lm, lm_data, lm_lora
from functrain.nn import lora
from functrain.task import Task

__all__ = ["lm_task"]


def lm_task(
    config: Any,
    dataset: Any,
    template: nn.Module,
    lora_spec: lora.LoraSpec | None,
    *,
    describe: str,
    init_params: Callable,
    shard_rules: Any,
    loss_fn: Callable,
    seq: int,
    flops_per_token: float,
    finish: Callable,
    export: Callable | None,
    stages: lm.LMStages | None,
    head: str | None,
    logits_fn: Callable | None = None,
    hf_name: Callable[[str], str] | None = None,
    base_model: str = "",
) -> Task:
    """A language-model family's `Task` over `dataset` (a `functrain.data.LMData` or `SFTData`).

    Args:
      config: the run config (its `batch_size` and `data`).
      dataset: the family's data (`lm_data.dataset`): batches, eval sets, position, record, tokenizer.
      template: the (meta-device) model, with its LoRA adapters when `lora_spec` is given.
      lora_spec: the adapters' spec, or None (every param trains).
      describe: the model's line of the run's summary (the data's is appended).
      init_params: `key -> params` of the base model (adapters are added here).
      shard_rules: the family's sharding rules.
      loss_fn: the family's loss.
      seq: the trained sequence length.
      flops_per_token: the full model's training FLOPs per token (a LoRA run's are derived here).
      finish: the family's end-of-run sample (`Task.finish`).
      export: the family's export (LoRA-aware already), or None.
      stages, head, logits_fn: the evaluation model's (`lm.eval_model`).
      hf_name, base_model: a param's name in the transformers model and the base's directory, for
        `lora.init_from` (a PEFT directory: `lm_lora.with_adapters`); hf_name None: the family reads none.

    Returns:
      The `Task`.

    Example:
      >>> task = lm_task(config, dataset, template, None, describe="GPT", init_params=init, ...)
    """
    text = lm_data.supervised_format(config.data) == "text"
    return Task(
        describe=f"{describe}, {dataset.describe()}",
        init_params=lm_lora.with_adapters(
            init_params,
            template,
            lora_spec,
            init_from=config.get("lora", {}).get("init_from", ""),
            hf_name=hf_name,
            base_model=base_model,
        ),
        shard_rules=shard_rules,
        loss_fn=loss_fn,
        train_batch=dataset.train_batch,
        eval_batches=dataset.eval_sets,
        data_position=dataset.position,
        data_record=dataset.record(),
        count_targets=lm.count_targets(),
        steps_per_epoch=dataset.steps_per_epoch,
        tokens_per_step=lambda batch: config.batch_size * batch[0].shape[-1],  # (padded rows: the batch's length)
        flops_per_token=lm_lora.flops_per_token(flops_per_token, template, lora_spec),
        finish=finish,
        export=export,
        frozen=lm_lora.frozen(lora_spec),
        eval_model=lm.eval_model(
            template, dataset.tokenizer, block_size=seq, stages=stages, head=head, logits_fn=logits_fn
        ),
        validation_text=lm_data.validation_text(config) if text else None,
    )
