"""functrain: a JAX-free functional trainer for PyTorch.

Pure state (`TrainState`, one pytree), pure compiled steps (`make_train_step`), composable
optax-style optimizers (`functrain.optim`), explicit RNG keys (`functrain.rng`).
"""

from functrain import checkpoint, losses, memory, ops, optim, precision, remat, rng, tree
from functrain.checkpoint import CheckpointError
from functrain.data import DataError, eval_batches, get_batch, load_dataset
from functrain.models import GPT, GPTConfig, cross_entropy, flops_per_token, generate, init_params, num_params
from functrain.state import Guard, TrainState, init_guard, init_state, params_of
from functrain.step import apply, apply_gradients, make_eval_step, make_train_step, value_and_grad

__version__ = "0.1.0"

__all__ = [
    "checkpoint",
    "CheckpointError",
    "losses",
    "memory",
    "ops",
    "optim",
    "precision",
    "remat",
    "rng",
    "tree",
    "TrainState",
    "Guard",
    "init_guard",
    "init_state",
    "params_of",
    "apply",
    "apply_gradients",
    "make_train_step",
    "make_eval_step",
    "value_and_grad",
    "GPT",
    "GPTConfig",
    "init_params",
    "cross_entropy",
    "generate",
    "flops_per_token",
    "num_params",
    "load_dataset",
    "get_batch",
    "eval_batches",
    "DataError",
]
