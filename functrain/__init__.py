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

from functrain._lazy import lazy_exports, moved_modules

__version__ = "0.1.0"

if TYPE_CHECKING:  # the public names; at run time each loads on first use (functrain._lazy)
    from functrain import checkpoint, data, losses, nn, optim, parallel, rng, step, tree
    from functrain.functional import apply
    from functrain.state import TrainState, init_state, params_of
    from functrain.step import apply_gradients, make_train_step, make_eval_step, update_step, value_and_grad
    from functrain.task import Task

# Names that left the top level in 0.1.x: still resolved until 0.2, with a FutureWarning.
_DEPRECATED = {
    "Guard": "functrain.state:Guard",
    "init_guard": "functrain.state:init_guard",
    "CheckpointError": "functrain.checkpoint:CheckpointError",
    "DataError": "functrain.data:DataError",
    "eval_batches": "functrain.data:eval_batches",
    "get_batch": "functrain.data:get_batch",
    "load_dataset": "functrain.data:load_dataset",
    "metric_names": "functrain.step:metric_names",
    "precision": "functrain.step:precision",
    "remat": "functrain.step:staged",
}

# Modules that moved in 0.1.x: their old names keep working until 0.2, with a FutureWarning.
_MOVED = {
    "functrain.remat": "functrain.step.staged",
    "functrain.remat_policy": "functrain.step.remat_policy",
    "functrain.update": "functrain.step.update",
    "functrain.update_groups": "functrain.step.update_groups",
    "functrain.precision": "functrain.step.precision",
    "functrain.loss_contract": "functrain.step.loss_contract",
    "functrain.metric_names": "functrain.step.metric_names",
    "functrain.foreach": "functrain.ops.foreach",
    "functrain.loop": "functrain.trainer.loop",
    "functrain.defaults": "functrain.trainer.defaults",
    "functrain.validate": "functrain.trainer.validate",
    "functrain.mesh_config": "functrain.config",
    "functrain.metrics": "functrain.trainer.metrics",
    "functrain.tensorboard": "functrain.trainer.tensorboard",
    "functrain.plot": "functrain.trainer.plot",
    "functrain.workdir_lock": "functrain.trainer.workdir_lock",
    "functrain.memory": "functrain.trainer.memory",
}
moved_modules(_MOVED, release="0.2")

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__, moved=_MOVED, deprecated=_DEPRECATED,
                                              release="0.2")
