"""A model family as the training loop sees it: a small NamedTuple of functions.

Internals: docs/internals.md "functrain.task".

Example:
    >>> task = Task(
    ...     describe="MLP 2 layers",
    ...     init_params=lambda key, device: mlp_init(key, device),
    ...     shard_rules=parallel.FSDP_RULES,
    ...     loss_fn=mse_loss,                                # (params, batch, key) -> (loss, aux)
    ...     train_batch=lambda step: batch_at(step),         # this rank's rows of step's batch
    ...     eval_batches=lambda: val_batches,
    ...     tokens_per_step=4096, flops_per_token=6 * n_params,
    ...     finish=lambda params, key: {},
    ... )
    >>> loop.run(task, optim.adamw(1e-3), config, "runs/mlp", ctx)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["Task"]

PyTree = Any


class Task(NamedTuple):
    """What the training loop needs from a model family.

    Attributes:
      describe: one line for the run's header (model, size, data).
      init_params: `(key, device) -> {name: tensor}`: the initial params, a pure function of the
        rng key (the loop shards them with `shard_rules`). On a mesh, an init that also takes
        `where=` (`where(name, shape) -> (offset, local_shape)`) draws only this rank's block of each
        parameter (`functrain.parallel.init_sharded`): no rank ever holds the whole model. Without
        `where`, every rank makes the whole tree and the loop then shards it, so each rank holds
        the whole model once at start: give `where` to a model that does not fit.
      shard_rules: sharding rules as data (`functrain.parallel.sharding`): regex -> placements.
      loss_fn: `(params, batch, key) -> (scalar loss, aux dict)` (or just the loss); `key` is the
        step's dropout key, None when evaluating.
      train_batch: `step -> batch`: this rank's part of the training batch of `step`, a pure
        function of the step (resuming and resharding need no loader state).
      eval_batches: `() -> iterable of batches`: this rank's part of the fixed evaluation set; or
        `() -> {name: iterable of batches}` for several sets (a data mixture's sources): the loop
        logs `val_loss/<name>` for each, and `val_loss`, the mean over all their batches.
      tokens_per_step: tokens in one global training batch (for throughput), or `batch -> tokens` when
        batches differ in length (padded supervised rows).
      flops_per_token: training FLOPs per token (for MFU; 0 if unknown).
      finish: `(params, key) -> dict`: called on every process after the last step with the params
        as trained (DTensors when sharded: gather them a stage or a tensor at a time, e.g.
        `models.lm.generate(..., stages=...)`, so no rank holds the whole model; each gather is a
        collective, hence every rank), e.g. `{"sample": text}`; the loop prints and records rank 0's.
      export: optional `(params, out_dir) -> path`: writes the params (full or sharded) in the
        family's interchange format (a Hugging Face directory); `python -m functrain.main
        --export_hf=DIR` calls it on a checkpoint. None: the family has none.
      data_position: optional `step -> {name: number}`: where the run is in its data after `step`
        steps (e.g. `{"epoch": 1, "epoch_fraction": 0.25}`), logged with the step's metrics.
      init_model_state: optional `device -> {name: tensor}`: the model's initial buffers
        (BatchNorm statistics; `functrain.nn.buffers_of(module)`), kept in `TrainState.model_state`
        and replicated on a mesh. With it, `loss_fn` is `(params, batch, key, model_state) -> (loss,
        aux, new_model_state)` (`functrain.nn.model_state`). None: the model has no state.
      data_record: optional JSON record of the data trained on (`LMData.record()`: files, sizes,
        sha256). The loop saves it with each checkpoint, and a resume on other data stops in one
        line unless `data.allow_changed`. None: not recorded, not checked.
      count_targets: optional `batch -> 0-d tensor`: the number of target tokens of a batch, for a
        loss that is a mean over them (`models.lm.count_targets()`): the step's loss and gradient are
        then the mean over every target token of the step, over microbatches and ranks, and the
        validation loss the mean over every target of the validation set (`make_train_step`'s
        `count_targets`). None: each batch weighs the same.
      steps_per_epoch: optional: the steps one epoch over the data takes (supervised examples): a run
        with `epochs > 0` trains `ceil(epochs * steps_per_epoch)` steps. None: the data has no epochs.
      eval_model: optional `functrain.eval.EvalModel` (logits of token ids in eval mode, tokenizer,
        block size): the loop scores `eval.tasks` (multiple-choice benchmarks) with it. None: the
        model cannot be evaluated that way (`eval.tasks` is then refused in one line).
      validation_text: optional `() -> list of str`: the validation documents' texts, from which the
        built-in `next_lines` task is made (`functrain.eval.next_lines`). None: no such task.
      frozen: optional `name -> bool`: the params of `init_params` the run holds frozen (a LoRA base,
        `functrain.nn.lora.is_base`): they go to `TrainState.frozen` (read by the loss, never trained,
        no optimizer state), the checkpoints record them (source, digest) instead of holding them,
        and `loss_fn`, `finish`, `export` and `eval_model` get the frozen and trained params together.
        None: every param trains.
    """

    describe: str
    init_params: Callable[[torch.Tensor, torch.device], PyTree]
    shard_rules: Sequence
    loss_fn: Callable
    train_batch: Callable[[int], PyTree]
    eval_batches: Callable[[], Iterable[PyTree]]
    tokens_per_step: int | Callable[[PyTree], int]
    flops_per_token: float
    finish: Callable[[PyTree, torch.Tensor], dict]
    export: Callable[[PyTree, Any], Any] | None = None
    data_position: Callable[[int], dict] | None = None
    init_model_state: Callable[[torch.device], PyTree] | None = None
    data_record: dict | None = None
    count_targets: Callable[[PyTree], torch.Tensor] | None = None
    steps_per_epoch: float | None = None
    eval_model: Any = None
    validation_text: Callable[[], list[str]] | None = None
    frozen: Callable[[str], bool] | None = None
