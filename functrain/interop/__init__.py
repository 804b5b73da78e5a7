"""Interoperability with other tools' formats: safetensors files and Hugging Face GPT-2 names.

Example:
    >>> from functrain.interop import export_hf_gpt2, save_safetensors
    >>> save_safetensors(export_hf_gpt2(state.params, cfg), "hf/model.safetensors")
"""

from functrain.interop.hf_gpt2 import export_hf_gpt2, hf_gpt2_config, import_hf_gpt2
from functrain.interop.safetensors import SafetensorsError, load_safetensors, safetensors_metadata, save_safetensors

__all__ = [
    "SafetensorsError",
    "save_safetensors",
    "load_safetensors",
    "safetensors_metadata",
    "export_hf_gpt2",
    "import_hf_gpt2",
    "hf_gpt2_config",
]
