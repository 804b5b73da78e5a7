"""functrain: a JAX-free functional trainer for PyTorch.

Pure state (`TrainState`, one pytree), pure compiled steps (`make_train_step`), composable
optax-style optimizers (`functrain.optim`), explicit RNG keys (`functrain.rng`); the trainer
(`functrain.trainer`, `python -m functrain.main`) runs any model family's `Task` (the GPT:
`functrain.models.gpt`) and is built on the library, which never imports it.

The top level holds what a user composes (the state, the steps, `apply`, and the packages `optim`,
`rng`, `tree`, `nn`, `data`, `checkpoint`, `parallel`, `losses`, `step`); everything else stays in
its submodule (docs/layers.md). The names load on first use (`functrain._lazy`): `import functrain`
alone does not import torch, so the command line checks a config before the heavy modules load.
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

__version__ = "0.1.0"

if TYPE_CHECKING:  # the public names; at run time each loads on first use (functrain._lazy)
    from functrain import checkpoint, data, losses, nn, optim, parallel, rng, step, tree
    from functrain.functional import apply
    from functrain.state import TrainState, init_state, params_of
    from functrain.step import apply_gradients, make_eval_step, make_train_step, update_step, value_and_grad
    from functrain.task import Task

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
