"""The step: `make_train_step` / `make_eval_step` and the parts they are made of.

Internals: docs/internals.md "functrain.step".

Example:
    >>> from functrain.step import make_train_step
    >>> step = make_train_step(loss_fn, optim.adamw(3e-4))
    >>> state, metrics = step(state, batch)
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

if TYPE_CHECKING:  # the public names; at run time each loads on first use (functrain._lazy)
    from functrain.step import grads, precision, staged, update
    from functrain.step.grads import value_and_grad, with_frozen
    from functrain.step.steps import make_eval_step, make_train_step
    from functrain.step.update import apply_gradients, update_step

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
