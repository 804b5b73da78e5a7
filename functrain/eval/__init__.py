"""Evaluation of a language model's params: log-likelihoods, generation and multiple-choice benchmarks.

The library below the trainer (like `functrain.step`): `EvalModel` is what it needs of a model (a
family's `Task.eval_model`, or `of_module` for a user's own); `loglikelihood`,
`loglikelihood_rolling` and `generate_until` are lm-evaluation-harness's three calls
(`functrain.eval.harness.FunctrainLM` wraps them as its `LM`); `choice` loads and scores
multiple-choice files (HellaSwag's format, and a plain one); `next_lines` makes a multiple-choice
task from a run's own validation text. Every call batches the requests into fixed bucket shapes
(`Scorer`: one compiled graph per bucket), splits them over the data-parallel ranks and gathers the
results in order; sharded params are gathered a stage at a time.

Example:
    >>> from functrain import eval as fe
    >>> fe.loglikelihood(task.eval_model, state.params, [("def f(x):\\n", "    return x\\n")])
    >>> fe.choice.evaluate(model, params, fe.choice.load("hellaswag_val.jsonl"), scorer=fe.Scorer(model))
"""

from functrain.eval import choice, next_lines
from functrain.eval.calls import generate_until, loglikelihood, loglikelihood_rolling
from functrain.eval.model import EvalModel, of_module
from functrain.eval.scorer import Scorer

__all__ = [
    "EvalModel",
    "Scorer",
    "choice",
    "generate_until",
    "loglikelihood",
    "loglikelihood_rolling",
    "next_lines",
    "of_module",
]
