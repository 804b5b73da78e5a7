"""optax-style composable optimizers for PyTorch pytrees.

The names below load on first use (`functrain._lazy`).
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

if TYPE_CHECKING:  # the public names; at run time each loads on first use (functrain._lazy)
    from functrain.optim.aliases import adam, adamw, sgd
    from functrain.optim.base import (
        MaskedState,
        Traits,
        Transform,
        apply_updates,
        call_update,
        chain,
        identity,
        is_leafwise,
        masked,
        report,
    )
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

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
