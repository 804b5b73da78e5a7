"""functrain: a JAX-free functional trainer for PyTorch.

Pure state (`TrainState`, one pytree), pure compiled steps (`make_train_step`), composable
optax-style optimizers (`functrain.optim`), explicit RNG keys (`functrain.rng`), and a training loop
(`functrain.loop`) that runs any model family's `Task` (the GPT: `functrain.models.gpt`).
"""

from functrain import checkpoint, losses, memory, metric_names, ops, optim, per_example, precision, remat, rng, tree
from functrain.checkpoint import CheckpointError
from functrain.data import DataError, eval_batches, get_batch, load_dataset
from functrain.state import Guard, TrainState, init_guard, init_state, params_of
from functrain.step import apply, apply_gradients, make_eval_step, make_train_step, update_step, value_and_grad
from functrain.task import Task

__version__ = "0.1.0"

__all__ = [
    "checkpoint",
    "CheckpointError",
    "losses",
    "memory",
    "metric_names",
    "ops",
    "optim",
    "per_example",
    "precision",
    "remat",
    "rng",
    "tree",
    "Task",
    "TrainState",
    "Guard",
    "init_guard",
    "init_state",
    "params_of",
    "apply",
    "apply_gradients",
    "make_train_step",
    "make_eval_step",
    "update_step",
    "value_and_grad",
    "load_dataset",
    "get_batch",
    "eval_batches",
    "DataError",
]
