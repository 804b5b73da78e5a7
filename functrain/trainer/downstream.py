"""Multiple-choice benchmarks inside the loop (`--config.eval.tasks`): loaded and checked before the
first step, scored on the live params every `eval_every` steps, at the end, and once before a fresh
run's first step.

Internals: docs/internals.md "functrain.trainer.downstream".

Example:
    >>> hook = downstream.hook(task, config, writer, compile=True, whole=True, print_fn=print)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from functrain import config_checks
from functrain import data as data_lib
from functrain.eval import Scorer, choice, next_lines
from functrain.eval.scorer import Interrupted, default_buckets
from functrain.task import Task
from functrain.trainer import frozen as frozen_lib
from functrain.trainer.hooks import Hook

__all__ = ["MultipleChoice", "Scoring", "hook", "load_tasks"]

NEXT_LINES_SEED = 0  # the built-in task's draw: fixed, whatever the run's seed
AUTO = "auto"  # eval.tasks: next_lines where the run can make it, else none (said in one line)


@dataclasses.dataclass
class Scoring:
    """How the hook scores: the examples' rendering for `acc_mean_token` (`eval.mean_token`), `eval.truncate`,
    and `interrupt()`, asked between batches (the loop's `PreemptionFlag.requested`: a SIGTERM stops the scores
    within a batch, unwritten, and the run stops after its next step with a checkpoint)."""

    mean_token: str = "nanogpt"
    truncate: bool = False
    interrupt: Callable[[], bool] | None = None
    print_fn: Callable[..., None] = print


class MultipleChoice(Hook):
    """Scores the tasks on the live params and writes `mc/<name>/<metric>` (see the module docstring)."""

    def __init__(self, n: int, tasks: dict, model, scorer: Scorer, writer, how: Scoring):
        self.every, self.tasks, self.model, self.scorer = n, tasks, model, scorer
        self.writer, self.how = writer, how
        self.last: dict = {}

    def evaluate(self, step: int, state) -> dict:
        """Every task's scores on `state`'s params, written to the metrics at `step`.

        Args:
          step: the step the scores are logged at (0 before training).
          state: the `TrainState` (its params and model state are read, nothing is written).

        Returns:
          {"mc/<name>/<metric>": fraction}, the same on every rank; {} when interrupted (nothing written).

        Example:
          >>> hook.evaluate(0, state)["mc/next_lines/acc"]
          0.254
        """
        row = {}
        for name, examples in self.tasks.items():
            try:
                scores = choice.evaluate(
                    self.model,
                    frozen_lib.merged(state),
                    examples,
                    scorer=self.scorer,
                    model_state=state.model_state,
                    truncate=self.how.truncate,
                    mean_token=self.how.mean_token,
                    interrupt=self.how.interrupt,
                )
            except Interrupted:
                self.how.print_fn(f"eval: stopped scoring {name} at step {step} (a stop was asked); no scores written")
                return {}
            row.update({f"mc/{name}/{metric}": scores[metric] for metric in choice.METRICS})
        self.writer.write(step, row)
        self.last = row
        return row

    def after(self, info):
        self.evaluate(info.step, info.state)


def load_tasks(names: str, task: Task, *, limit: int) -> dict[str, list]:
    """{name: examples} of `eval.tasks`.

    Args:
      names: comma-separated jsonl paths and/or "next_lines".
      task: the run's `Task` (its `eval_model` and `data.validation_text()`).
      limit: examples per task (0: all).

    Returns:
      The examples by name (a file's stem; `next_lines`).

    Raises:
      ConfigError: the family has no `eval_model`, `next_lines` without validation text, or two
        tasks of one name (one line each).
      DataError: a malformed file (one line naming file, line and fix).

    Example:
      >>> load_tasks("next_lines,data/hellaswag_val.jsonl", task, limit=500)
    """
    out: dict[str, list] = {}
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        if name == "next_lines":
            texts = task.data.validation_text()
            if texts is None:
                raise config_checks.ConfigError(
                    "eval.tasks=next_lines is made from the run's validation text, and this "
                    "run's data has none (supervised examples); give multiple-choice files"
                )
            try:
                examples = next_lines.build(
                    texts,
                    task.eval_model.tokenizer,
                    block_size=task.eval_model.block_size,
                    seed=NEXT_LINES_SEED,
                )
            except ValueError as exc:
                raise data_lib.DataError(f"eval.tasks=next_lines: {exc}") from None
            key = "next_lines"
            examples = examples[:limit] if limit else examples
        else:
            key = Path(name).name.removesuffix(".jsonl").removesuffix(".json")
            examples = choice.load(name, limit=limit)
        if key in out:
            raise config_checks.ConfigError(f"eval.tasks names two tasks called {key!r}; rename one file")
        out[key] = examples
    return out


def _checked_tasks(names: str, task: Task, ev, whole: bool) -> dict[str, list]:
    """`load_tasks` after the run's own checks, every example checked against the block."""
    if task.eval_model is None:
        raise config_checks.ConfigError(
            "eval.tasks: this model family gives no eval_model (Task.eval_model) to score "
            "with; drop --config.eval.tasks"
        )
    if not whole:
        raise config_checks.ConfigError(
            "eval.tasks with mesh.pp > 1: a pipeline rank holds only its stages, and scoring "
            "needs every stage; evaluate the checkpoint on mesh.pp=1 (functrain.eval.harness)"
        )
    tasks = load_tasks(names, task, limit=ev.limit)
    for examples in tasks.values():  # before the first step: a too-long example stops the run now
        choice.rows_of(examples, task.eval_model, truncate=ev.truncate)
    return tasks


def hook(
    task: Task,
    config: Any,
    writer,
    *,
    compile: bool,
    whole: bool,
    print_fn,
    interrupt: Callable[[], bool] | None = None,
) -> MultipleChoice | None:
    """The loop's multiple-choice hook for `config.eval`, its examples loaded and checked; None without tasks.

    Args:
      task: the run's `Task`.
      config: the run config (`eval.*`, `eval_every`).
      writer: where the scores go (the loop's metrics writer).
      compile: the run compiles (`eval.compile` then says whether the scoring forward is: one graph per
        bucket length).
      whole: this rank's state is the whole model's tree (`Route.whole`); False on a pipeline rank
        (`mesh.pp > 1`), which holds only its stages: refused.
      print_fn: where the line describing the tasks goes.
      interrupt: asked between scoring batches; True stops the scores (`Scoring.interrupt`).

    Returns:
      The hook, or None when `eval.tasks` is empty.

    Raises:
      ConfigError / DataError: as `load_tasks`, a family without `eval_model`, or a pipeline (one line);
        with `eval.tasks=auto` none: the line is printed and no hook made.

    Example:
      >>> mc = hook(task, config, writer, compile=True, whole=True, print_fn=print)
    """
    ev = config.eval
    names = ev.tasks
    if not names:
        return None
    try:
        tasks = _checked_tasks("next_lines" if names == AUTO else names, task, ev, whole)
    except (config_checks.ConfigError, data_lib.DataError) as exc:
        if names != AUTO:
            raise
        print_fn(
            f"eval.tasks=auto: no next_lines task ({exc}); name multiple-choice files in --config.eval.tasks, "
            "or set it to '' to drop this line"
        )
        return None
    model = task.eval_model
    print_fn("eval: " + ", ".join(f"{k} ({len(v)} examples, {len(v[0].choices)} choices)" for k, v in tasks.items()))
    scorer = Scorer(
        model,
        batch_size=ev.batch_size,
        compile=compile and ev.compile,
        buckets=default_buckets(model.block_size, smallest=max(32, model.block_size // 4)),
    )
    how = Scoring(ev.mean_token, ev.truncate, interrupt, print_fn)
    return MultipleChoice(config.eval_every, tasks, model, scorer, writer, how)
