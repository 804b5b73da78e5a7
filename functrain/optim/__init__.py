"""optax-style composable optimizers for PyTorch pytrees."""

from functrain.optim.aliases import adam, adamw, sgd
from functrain.optim.base import (
    MaskedState,
    Transform,
    apply_updates,
    call_update,
    chain,
    identity,
    is_leafwise,
    masked,
    report,
)
from functrain.optim import config
from functrain.optim.hyperparams import get_hyperparams, set_hyperparams
from functrain.optim.schedules import Schedule, constant, linear, linear_warmup, warmup_cosine, warmup_linear
from functrain.optim.transforms import (
    HyperState,
    ScaleByAdamState,
    ScaleByLearningRateState,
    TraceState,
    add_decayed_weights,
    clip_by_global_norm,
    learning_rate,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)

__all__ = [
    "config",
    "Transform",
    "is_leafwise",
    "call_update",
    "report",
    "chain",
    "masked",
    "identity",
    "apply_updates",
    "MaskedState",
    "scale_by_adam",
    "add_decayed_weights",
    "clip_by_global_norm",
    "scale_by_learning_rate",
    "scale",
    "trace",
    "learning_rate",
    "get_hyperparams",
    "set_hyperparams",
    "HyperState",
    "Schedule",
    "warmup_linear",
    "ScaleByAdamState",
    "ScaleByLearningRateState",
    "TraceState",
    "adamw",
    "adam",
    "sgd",
    "constant",
    "linear",
    "linear_warmup",
    "warmup_cosine",
]
