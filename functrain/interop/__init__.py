"""Interoperability with other tools' formats: safetensors files (model-free; a model's own name
mapping lives with the model, e.g. `functrain.models.gpt.hf`).

Example:
    >>> from functrain.interop import save_safetensors
    >>> save_safetensors(state.params, "out/model.safetensors")
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

if TYPE_CHECKING:  # the public names; at run time each loads on first use (functrain._lazy)
    from functrain.interop.safetensors import (
        SafetensorsError,
        load_safetensors,
        open_safetensors,
        safetensors_metadata,
        save_safetensors,
    )

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
