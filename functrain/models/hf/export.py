"""A Hugging Face model of the family written as a directory transformers loads: config, params, the persistent
buffers its `state_dict` holds, tokenizer.

Example:
    >>> export_directory("runs/hf/hf", load_config(path), template, params)
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from functrain.interop.hf import save_hf_directory

__all__ = ["export_directory", "persistent_buffers"]


def export_directory(out, config, model: nn.Module, params, *, tokenizer_file=None) -> Path:
    """Writes `params` as a directory transformers loads: config.json (float32, the cache on), the params and the
    model's persistent buffers in model.safetensors, tokenizer.json.

    Args:
      out: the directory.
      config: the model's transformers config (`load_config`).
      model: the template (its persistent buffers).
      params: {name: tensor or DTensor} (sharded: every rank calls this; rank 0 writes).
      tokenizer_file: a tokenizer.json to copy beside them, or None.

    Returns:
      The directory.

    Example:
      >>> export_directory("runs/hf/hf", load_config(path), template, params)
    """
    exported = config.to_dict()
    exported.pop("torch_dtype", None)
    exported.update(dtype="float32", use_cache=True)
    return save_hf_directory(out, {**params, **persistent_buffers(model)}, exported, tokenizer_file=tokenizer_file)


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers the model's `state_dict` holds (transformers saves and loads them; rotary tables are not among
    them), by name: e.g. apertus's xIELU `mlp.act_fn.beta` and `eps`. An export writes them beside the params.

    Example:
      >>> sorted(persistent_buffers(build_template(load_config("tiny-apertus"))))[:2]
      ['model.layers.0.mlp.act_fn.beta', 'model.layers.0.mlp.act_fn.eps']
    """
    saved = set(model.state_dict(keep_vars=True))
    return {name: buf for name, buf in model.named_buffers() if name in saved}
