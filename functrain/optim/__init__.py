"""optax-style composable optimizers for PyTorch pytrees.

The names below load on first use (`functrain._lazy`), so `functrain.optim.checks` (the config
checks) can be imported without torch.
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

_EXPORTS = {
    "config": "functrain.optim.config",
    "Transform": "functrain.optim.base:Transform",
    "is_leafwise": "functrain.optim.base:is_leafwise",
    "call_update": "functrain.optim.base:call_update",
    "report": "functrain.optim.base:report",
    "chain": "functrain.optim.base:chain",
    "masked": "functrain.optim.base:masked",
    "identity": "functrain.optim.base:identity",
    "apply_updates": "functrain.optim.base:apply_updates",
    "MaskedState": "functrain.optim.base:MaskedState",
    "scale_by_adam": "functrain.optim.transforms:scale_by_adam",
    "add_decayed_weights": "functrain.optim.transforms:add_decayed_weights",
    "clip_by_global_norm": "functrain.optim.transforms:clip_by_global_norm",
    "scale_by_learning_rate": "functrain.optim.transforms:scale_by_learning_rate",
    "scale": "functrain.optim.transforms:scale",
    "trace": "functrain.optim.transforms:trace",
    "learning_rate": "functrain.optim.transforms:learning_rate",
    "get_hyperparams": "functrain.optim.hyperparams:get_hyperparams",
    "set_hyperparams": "functrain.optim.hyperparams:set_hyperparams",
    "HyperState": "functrain.optim.transforms:HyperState",
    "Schedule": "functrain.optim.schedules:Schedule",
    "warmup_linear": "functrain.optim.schedules:warmup_linear",
    "ScaleByAdamState": "functrain.optim.transforms:ScaleByAdamState",
    "ScaleByLearningRateState": "functrain.optim.transforms:ScaleByLearningRateState",
    "TraceState": "functrain.optim.transforms:TraceState",
    "adamw": "functrain.optim.aliases:adamw",
    "adam": "functrain.optim.aliases:adam",
    "sgd": "functrain.optim.aliases:sgd",
    "constant": "functrain.optim.schedules:constant",
    "linear": "functrain.optim.schedules:linear",
    "linear_warmup": "functrain.optim.schedules:linear_warmup",
    "warmup_cosine": "functrain.optim.schedules:warmup_cosine",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what static tools see; at run time each name loads on first use
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
