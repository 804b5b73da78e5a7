"""Evaluation of a language model's params: log-likelihoods, generation and multiple-choice benchmarks.

Internals: docs/internals.md "functrain.eval".

Example:
    >>> from functrain import eval as fe
    >>> fe.loglikelihood(task.eval_model, state.params, [("def f(x):\n", "    return x\n")])
    >>> fe.choice.evaluate(model, params, fe.choice.load("hellaswag_val.jsonl"), scorer=fe.Scorer(model))
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

if TYPE_CHECKING:  # the public names; at run time each loads on first use (functrain._lazy)
    from functrain.eval import choice, next_lines
    from functrain.eval.calls import generate_until, loglikelihood, loglikelihood_rolling
    from functrain.eval.model import EvalModel, of_module
    from functrain.eval.scorer import Scorer

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
