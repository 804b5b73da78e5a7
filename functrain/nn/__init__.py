"""Running any `torch.nn.Module` functionally: model state, train/eval modes, keyed dropout, meta checks.

Internals: docs/internals.md "functrain.nn".

Example:
    >>> from functrain import nn as fnn
    >>> state = functrain.init_state(cnn, opt)                 # model_state = fnn.buffers_of(cnn)
    >>> with fnn.keyed(key), fnn.running(train=True):
    ...     out, new_ms = functrain.apply(cnn, state.params, x, model_state=state.model_state)
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

if TYPE_CHECKING:
    from functrain.nn.mode import current, running
    from functrain.nn.model_state import buffers_of
    from functrain.nn.randomness import KeyedRandomness, keyed

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
