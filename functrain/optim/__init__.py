"""optax-style composable optimizers for PyTorch pytrees."""

from functrain.optim.aliases import adam, adamw, sgd
from functrain.optim.base import MaskedState, Transform, apply_updates, call_update, chain, identity, masked, report
from functrain.optim import config
from functrain.optim.schedules import constant, linear, linear_warmup, warmup_cosine
from functrain.optim.transforms import (
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
