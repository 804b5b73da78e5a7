"""functrain: a JAX-free functional trainer for PyTorch.

Pure state (`TrainState`, one pytree), pure compiled steps (`make_train_step`), composable
optax-style optimizers (`functrain.optim`), explicit RNG keys (`functrain.rng`), and a training loop
(`functrain.loop`) that runs any model family's `Task` (the GPT: `functrain.models.gpt`).

The names below load on first use (`functrain._lazy`): `import functrain` alone does not import
torch, so the command line checks a config before the heavy modules load.
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "checkpoint": "functrain.checkpoint",
    "CheckpointError": "functrain.checkpoint.errors:CheckpointError",
    "losses": "functrain.losses",
    "memory": "functrain.memory",
    "metric_names": "functrain.metric_names",
    "ops": "functrain.ops",
    "optim": "functrain.optim",
    "per_example": "functrain.per_example",
    "precision": "functrain.precision",
    "remat": "functrain.remat",
    "rng": "functrain.rng",
    "tree": "functrain.tree",
    "Task": "functrain.task:Task",
    "TrainState": "functrain.state:TrainState",
    "Guard": "functrain.state:Guard",
    "init_guard": "functrain.state:init_guard",
    "init_state": "functrain.state:init_state",
    "params_of": "functrain.state:params_of",
    "apply": "functrain.step:apply",
    "apply_gradients": "functrain.step:apply_gradients",
    "make_train_step": "functrain.step:make_train_step",
    "make_eval_step": "functrain.step:make_eval_step",
    "update_step": "functrain.step:update_step",
    "value_and_grad": "functrain.step:value_and_grad",
    "load_dataset": "functrain.data.corpus:load_dataset",
    "get_batch": "functrain.data.batches:get_batch",
    "eval_batches": "functrain.data.batches:eval_batches",
    "DataError": "functrain.data.errors:DataError",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what static tools see; at run time each name loads on first use
    from functrain import checkpoint, losses, memory, metric_names, ops, optim, per_example, precision, remat, rng, tree
    from functrain.checkpoint import CheckpointError
    from functrain.data import DataError, eval_batches, get_batch, load_dataset
    from functrain.state import Guard, TrainState, init_guard, init_state, params_of
    from functrain.step import apply, apply_gradients, make_train_step, make_eval_step, update_step, value_and_grad
    from functrain.task import Task
