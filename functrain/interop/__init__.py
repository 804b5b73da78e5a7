"""Interoperability with other tools' formats: safetensors files (model-free; a model's own name
mapping lives with the model, e.g. `functrain.models.gpt.hf`).

Example:
    >>> from functrain.interop import save_safetensors
    >>> save_safetensors(state.params, "out/model.safetensors")
"""

from functrain.interop.safetensors import (
    SafetensorsError,
    load_safetensors,
    open_safetensors,
    safetensors_metadata,
    save_safetensors,
)

__all__ = [
    "SafetensorsError",
    "save_safetensors",
    "load_safetensors",
    "safetensors_metadata",
    "open_safetensors",
]
