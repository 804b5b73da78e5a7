"""functrain: a JAX-free functional trainer for PyTorch.

Internals: docs/internals.md "functrain".
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

__version__ = "0.1.0"

if TYPE_CHECKING:  # the public names; at run time each loads on first use (functrain._lazy)
    from functrain import checkpoint, data, grpo, losses, metric_names, nn, optim, parallel, preference, rng, step, tree
    from functrain.errors import FunctrainError
    from functrain.functional import apply
    from functrain.state import TrainState, init_state, params_of
    from functrain.step import apply_gradients, make_eval_step, make_train_step, update_step, value_and_grad
    from functrain.task import Task

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
