"""A model family as the training loop sees it: a small NamedTuple of functions.

Internals: docs/internals.md "functrain.task".

Example:
    >>> task = Task(
    ...     describe="MLP 2 layers",
    ...     init_params=lambda key, device: mlp_init(key, device),
    ...     shard_rules=parallel.FSDP_RULES,
    ...     loss_fn=mse_loss,                                # (params, batch, key) -> (loss, aux)
    ...     data=Batches(batch_at, lambda: val_batches),     # this rank's rows of step's batch; validation
    ...     tokens_per_step=4096, flops_per_token=6 * n_params,
    ...     finish=lambda params, key: {},
    ... )
    >>> loop.run(task, optim.adamw(1e-3), config, "runs/mlp", ctx)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

__all__ = ["Batches", "Data", "OnPolicy", "Task"]

PyTree = Any


class Data(Protocol):
    """A task's data as the loop reads it (`functrain.data.LMData` and `SFTData` are ones; `Batches` makes one
    of plain functions)."""

    @property
    def steps_per_epoch(self) -> float | None:
        """The steps one epoch over the data takes (supervised examples, text sampled by epochs): a run with
        `epochs > 0` trains `ceil(epochs * steps_per_epoch)` steps. None: no epochs."""

    def train_batch(self, step: int) -> PyTree:
        """This rank's part of the training batch of `step`, a pure function of the step (resuming and
        resharding need no loader state)."""

    def eval_sets(self) -> Iterable[PyTree] | dict[str, Iterable[PyTree]]:
        """This rank's part of the fixed evaluation set; or {name: batches} for several sets (a mixture's
        sources): the loop logs `val_loss/<name>` for each, and `val_loss`, the mean over all their batches."""

    def position(self, step: int) -> dict:
        """Where the run is in its data after `step` steps (e.g. {"epoch": 1, "epoch_fraction": 0.25}), logged
        with the step's metrics ({} when nothing to say)."""

    def record(self) -> dict | None:
        """A JSON record of the data trained on (files, sizes, sha256): the loop saves it with each checkpoint,
        and a resume on other data stops in one line unless `data.allow_changed`. None: not checked."""

    def validation_text(self) -> list[str] | None:
        """The validation documents' texts, from which the built-in `next_lines` task is made. None: none."""


class OnPolicy(Data, Protocol):
    """Data whose batches are drawn from the model being trained (`functrain.models.lm_grpo.Rollouts`): the loop
    reads each step's batch with the params the step starts from, never ahead of it (no prefetch), and compiles
    no step on a batch before a restore."""

    on_policy: bool  # True

    def train_batch(self, step: int, params: dict) -> PyTree:  # type: ignore[override]
        """This rank's part of the batch of `step`, drawn with `params` (what the model computes with when the step
        starts: the trained params and the frozen ones, a reference copy left out)."""


def _nothing() -> None:
    """A `Batches` default: nothing to say."""


def _nowhere(step: int) -> dict:
    """A `Batches` default: no position in the data."""
    return {}


class Batches(NamedTuple):
    """`Data` made of plain functions, for a task whose data is not a `functrain.data` loader's.

    Attributes:
      train_batch: `step -> batch` (`Data.train_batch`).
      eval_sets: `() -> batches` or `() -> {name: batches}` (`Data.eval_sets`).
      position: `step -> dict` (default: {}).
      record: `() -> dict | None` (default: None, not recorded).
      steps_per_epoch: the steps of one epoch, or None.
      validation_text: `() -> list of str | None` (default: None).

    Example:
      >>> Batches(lambda step: batches[step % len(batches)], lambda: batches[:2])
    """

    train_batch: Callable[[int], PyTree]
    eval_sets: Callable[[], Any]
    position: Callable[[int], dict] = _nowhere
    record: Callable[[], dict | None] = _nothing
    steps_per_epoch: float | None = None
    validation_text: Callable[[], list[str] | None] = _nothing


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
      data: the batches and what the loop logs and checks of them (`Data`: `functrain.data.run_data`'s, or
        `Batches` of plain functions).
      tokens_per_step: tokens in one global training batch (for throughput), or `batch -> tokens` when
        batches differ in length (padded supervised rows).
      flops_per_token: training FLOPs per token (for MFU; 0 if unknown).
      finish: `(params, key) -> dict`: called on every process after the last step with the params
        as trained (DTensors when sharded: gather them a stage or a tensor at a time, e.g.
        `models.inference.generate(..., stages=...)`, so no rank holds the whole model; each gather is a
        collective, hence every rank), e.g. `{"sample": text}`; the loop prints and records rank 0's.
      export: optional `(params, out_dir) -> path`: writes the params (full or sharded) in the
        family's interchange format (a Hugging Face directory); `python -m functrain.main
        --export_hf=DIR` calls it on a checkpoint. None: the family has none.
      init_model_state: optional `device -> {name: tensor}`: the model's initial buffers
        (BatchNorm statistics; `functrain.nn.buffers_of(module)`), kept in `TrainState.model_state`
        and replicated on a mesh. With it, `loss_fn` is `(params, batch, key, model_state) -> (loss,
        aux, new_model_state)` (`functrain.nn.model_state`). None: the model has no state.
      count_targets: optional `batch -> 0-d tensor`: the number of target tokens of a batch, for a
        loss that is a mean over them (`models.lm.count_targets()`): the step's loss and gradient are
        then the mean over every target token of the step, over microbatches and ranks, and the
        validation loss the mean over every target of the validation set (`make_train_step`'s
        `count_targets`). None: each batch weighs the same.
      eval_model: optional `functrain.eval.EvalModel` (logits of token ids in eval mode, tokenizer,
        block size): the loop scores `eval.tasks` (multiple-choice benchmarks) with it. None: the
        model cannot be evaluated that way (`eval.tasks` is then refused in one line).
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
    data: Data
    tokens_per_step: int | Callable[[PyTree], int]
    flops_per_token: float
    finish: Callable[[PyTree, torch.Tensor], dict]
    export: Callable[[PyTree, Any], Any] | None = None
    init_model_state: Callable[[torch.device], PyTree] | None = None
    count_targets: Callable[[PyTree], torch.Tensor] | None = None
    eval_model: Any = None
    frozen: Callable[[str], bool] | None = None
