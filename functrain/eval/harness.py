"""functrain params as an lm-evaluation-harness model: any of its tasks, run on functrain directly.

Internals: docs/internals.md "functrain.eval.harness".

Example:
    >>> import lm_eval
    >>> lm = FunctrainLM(task.eval_model, state.params, batch_size=32)
    >>> lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"], limit=100)["results"]
"""

from __future__ import annotations

from pathlib import Path

import torch

from functrain import checkpoint as ckpt_lib
from functrain import rng
from functrain.eval import calls
from functrain.eval.model import EvalModel
from functrain.eval.scorer import Scorer

try:
    from lm_eval.api.model import LM
except ImportError as exc:  # an optional extra: say how to get it, in one line
    raise ImportError(
        "functrain.eval.harness needs lm-evaluation-harness: pip install 'functrain[eval]' (or lm-eval)"
    ) from exc

__all__ = ["FunctrainLM"]


class FunctrainLM(LM):
    """An `lm_eval.api.model.LM` over a functrain model and params.

    Args:
      model: the `EvalModel` (a family's `Task.eval_model`, or `functrain.eval.of_module(...)`).
      params: the params (DTensors: every rank makes one and runs the same tasks; the requests are
        split over the data-parallel ranks and every rank gets every result).
      model_state: the model's buffers, or None.
      batch_size: rows per forward on each rank.
      compile: compile the forward (plain params), one graph per bucket length.
      key: the `rng` key requests that sample (`do_sample=True`) draw from; default `rng.key(1234)`
        (lm-eval's default torch seed): a sampling task runs reproducibly.
      max_length: the longest input scored or generated from (rolling windows, cut contexts); default as
        HFLM's: the model's positions (`EvalModel.positions`), else its block.

    Example:
      >>> lm = FunctrainLM(model, params)
      >>> lm.loglikelihood([Instance("loglikelihood", {}, ("2 + 2 =", " 4"), 0)])
    """

    def __init__(
        self,
        model: EvalModel,
        params,
        *,
        model_state=None,
        batch_size: int = 32,
        compile: bool = False,
        key: torch.Tensor | None = None,
        max_length: int | None = None,
    ):
        super().__init__()
        length = max_length or model.positions or model.block_size
        model = model._replace(block_size=int(length))
        self.model, self.params, self.model_state = model, params, model_state
        self.key = rng.key(1234) if key is None else key
        self.scorer = Scorer(model, batch_size=batch_size, compile=compile)

    @property
    def max_length(self) -> int:
        """The longest input (HFLM's `max_length`)."""
        return self.model.block_size

    @classmethod
    def from_checkpoint(cls, model: EvalModel, step_dir: str | Path, like, **kwargs) -> FunctrainLM:
        """The LM over the params of a checkpoint, read onto the placements of `like`.

        Args:
          model: the `EvalModel`.
          step_dir: a checkpoint step directory (`<workdir>/checkpoints/<step>`).
          like: a params tree of the shapes, dtypes and placements to read into (e.g. a fresh
            `task.init_params(key, device)`, sharded as the run shards it).
          **kwargs: `FunctrainLM`'s other arguments.

        Returns:
          The `FunctrainLM`.

        Raises:
          CheckpointError: the directory is not a checkpoint, or its params do not fit `like` (one line).

        Example:
          >>> lm = FunctrainLM.from_checkpoint(task.eval_model, "runs/gpt/checkpoints/2500", fresh_params)
        """
        params = ckpt_lib.restore(str(step_dir), {"params": ckpt_lib.abstract(like)}).result()["params"]
        return cls(model, params, **kwargs)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log p(continuation | context), is_greedy) per request (`Instance.args` = (context, continuation))."""
        return calls.loglikelihood(
            self.model, self.params, [r.args for r in requests], model_state=self.model_state, scorer=self.scorer
        )

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood per request (`Instance.args` = (text,))."""
        return calls.loglikelihood_rolling(
            self.model, self.params, [r.args[0] for r in requests], model_state=self.model_state, scorer=self.scorer
        )

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The generated text per request (`Instance.args` = (context, gen_kwargs))."""
        return calls.generate_until(
            self.model,
            self.params,
            [(r.args[0], dict(r.args[1])) for r in requests],
            key=self.key,
            model_state=self.model_state,
            scorer=self.scorer,
        )
