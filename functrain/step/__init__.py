"""The step: `make_train_step` / `make_eval_step` and the parts they are made of.

* `steps`: value and grad, accumulation, the train and eval steps (the public names below).
* `staged`: the staged-loss engine. A loss given as stages (`StagedLoss`) runs its stages one by
  one; activation checkpointing, FSDP's per-block gathers, `compile="blocks"` and pipeline stages
  are all built on it. `remat_policy` says which blocks recompute.
* `update`: the optimizer half of a step (`apply_gradients`, the skip guard, the masters);
  `update_groups`: the update run group by group, one graph for every block.
* `precision`: bf16/fp16 compute over fp32 masters, with dynamic loss scaling.
* `loss_contract`: what a loss returns; `metric_names`: the metrics' names.

Example:
    >>> from functrain.step import make_train_step
    >>> step = make_train_step(loss_fn, optim.adamw(3e-4))
    >>> state, metrics = step(state, batch)
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

if TYPE_CHECKING:  # the public names; at run time each loads on first use (functrain._lazy)
    from functrain.step import loss_contract, metric_names, precision, remat_policy, staged, update, update_groups
    from functrain.step.steps import (
        apply_gradients,
        loss_and_aux,
        make_eval_step,
        make_train_step,
        update_step,
        value_and_grad,
        with_frozen,
    )

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
