"""A model directory's weights onto the family's template: every parameter (a rank's block of each) read from
its safetensors, and the template's real buffers (rotary tables) on a tensor-parallel copy.

Example:
    >>> params = read_params(HFDirectory(path).weights, template, where=where)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from functrain.interop.hf import HFError
from functrain.models.hf.model import HFModel

__all__ = ["read_params", "with_buffers"]


def read_params(weights, template: HFModel, *, device=None, where: Callable | None = None) -> dict[str, torch.Tensor]:
    """A model directory's parameters (only this rank's block of each with `where`), float32.

    Args:
      weights: the directory's safetensors (`functrain.interop.hf.HFDirectory.weights`).
      template: `build_template`'s model (the names and shapes wanted).
      device: where the tensors go.
      where: optional `where(name, shape) -> (offset, local_shape)` (this rank's block).

    Returns:
      {name: tensor} in `named_parameters()` order.

    Raises:
      HFError: a tensor missing or of another shape than the config makes (one line naming it).

    Example:
      >>> params = read_params(HFDirectory("Qwen2.5-0.5B").weights, template)
    """
    return {name: _read(weights, template, name, device, where) for name, _ in template.named_parameters()}


def _read(weights, template: HFModel, name: str, device, where) -> torch.Tensor:
    """Parameter `name` (this rank's block with `where`) from the directory's safetensors."""
    stored = name
    if name not in weights:  # checkpoints saved by the base model lack its prefix (e.g. GPT-2's "h.0...")
        stored = name.split(".", 1)[1] if name.startswith(f"{template.base_model_prefix}.") else name
    shape = tuple(template.get_parameter(name).shape)
    offset, local = where(name, shape) if where is not None else ([0] * len(shape), list(shape))
    if stored not in weights or tuple(weights.shape(stored)) != shape:
        found = tuple(weights.shape(stored)) if stored in weights else "missing"
        raise HFError(
            f"{weights.directory}: tensor {stored} is {found}, the model's config wants {shape}; "
            "the weights and config.json disagree"
        )
    return weights.read(stored, offset, local).to(device=device, dtype=torch.float32)


def with_buffers(model: HFModel, template: HFModel) -> HFModel:
    """`model` (a tensor-parallel copy, made on meta) with the template's real buffers (rotary tables).

    Example:
      >>> model = with_buffers(parallel.tensor_parallel(template, mesh, rules), template)
    """
    if model is not template:
        for name, module in model.named_modules():
            source = template.get_submodule(name)
            module._buffers.update({n: source._buffers[n] for n, b in module._buffers.items() if b is not None})
    return model
