"""LoRA: low-rank adapters beside a module's linear layers, trained while the base stays frozen.

Internals: docs/internals.md "functrain.nn.lora".

Example:
    >>> spec = lora.LoraSpec(rank=8, alpha=16, targets="q_proj|v_proj")
    >>> model = lora.wrap(template, spec)
    >>> adapters = lora.init_adapters(model, rng.key(0))
    >>> state = functrain.init_state(adapters, optim.adamw(1e-4), frozen=base_params)
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from functrain import rng as rng_lib

__all__ = [
    "ALL_LINEAR",
    "LoraLinear",
    "LoraSpec",
    "adapter_names",
    "init_adapters",
    "is_adapter",
    "is_base",
    "is_linear",
    "merge",
    "peft_config",
    "peft_directory",
    "peft_tensors",
    "split",
    "targets_of",
    "wrap",
]

ALL_LINEAR = "all-linear"
"""`LoraSpec.targets`: every linear layer but the output layer (`get_output_embeddings()`), as PEFT's "all-linear"."""

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module's name in an adapter file."""


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Which layers get an adapter, and its shape.

    Attributes:
      rank: r, the adapters' inner dimension.
      alpha: the scale's numerator: scaling = alpha / r (alpha / √r with `rslora`).
      targets: a regular expression matched in full against a linear layer's dotted name, its last
        part or its weight's name ("q_proj|v_proj", r".*attn\\.c_attn", r".*\\.mlp\\..*\\.weight"), or
        "all-linear": every linear layer but the module's `get_output_embeddings()` (as PEFT's "all-linear":
        a module without that method keeps every linear layer).
      dropout: the dropout on the adapters' input (training only).
      rslora: rank-stabilized scaling, alpha / √r.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: str = ALL_LINEAR
    dropout: float = 0.0
    rslora: bool = False

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be > 0 (the adapters' scale is alpha / rank), got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if self.targets != ALL_LINEAR:
            try:
                re.compile(self.targets)
            except re.error as exc:
                raise ValueError(f"lora.targets {self.targets!r} is not a regular expression ({exc})") from None

    @property
    def scaling(self) -> float:
        """The factor of the adapters' output."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class LoraLinear(nn.Module):
    """A linear layer (base weight and bias, under the base layer's names) with a LoRA adapter beside it.

    Args:
      base: the `nn.Linear` (weight (out, in)) or transformers `Conv1D` (weight (in, out)) it replaces;
        its parameters are taken over, not copied.
      spec: the adapter's rank, scale and dropout.

    Example:
      >>> layer = LoraLinear(nn.Linear(64, 64, device="meta"), LoraSpec(rank=4))
    """

    def __init__(self, base: nn.Module, spec: LoraSpec):
        super().__init__()
        self.fan_in_fan_out = not isinstance(base, nn.Linear)  # Conv1D keeps its weight as (in, out)
        self.weight: torch.Tensor = base.weight  # type: ignore[assignment]  # (a Module attribute, typed loosely)
        self.bias: torch.Tensor | None = base.bias  # type: ignore[assignment]
        n_in, n_out = self.weight.shape[::-1] if not self.fan_in_fan_out else self.weight.shape
        device, dtype = self.weight.device, self.weight.dtype
        self.in_features, self.out_features = int(n_in), int(n_out)
        self.lora_A = nn.Linear(self.in_features, spec.rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(spec.rank, self.out_features, bias=False, device=device, dtype=dtype)
        self.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.scaling = spec.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base layer's output plus the adapter's (PEFT's order of operations)."""
        weight = self.weight.t() if self.fan_in_fan_out else self.weight  # (out, in)
        y = F.linear(x, weight, self.bias)
        return y + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.lora_A.out_features}, scaling={self.scaling:g}"


def is_linear(module: nn.Module) -> bool:
    """Whether `module` is a layer LoRA adapts: an `nn.Linear`, or transformers' `Conv1D` (recognized by
    name: transformers is not imported).

    Example:
      >>> lora.is_linear(nn.Linear(4, 4))
      True
    """
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def targets_of(module: nn.Module, spec: LoraSpec) -> list[str]:
    """The dotted names of the linear layers `spec.targets` picks in `module`.

    Args:
      module: the model (a meta template or a real module).
      spec: the LoRA spec.

    Returns:
      The names, in `named_modules()` order.

    Raises:
      ValueError: no linear layer matches (one line with a few names that could be targets).

    Example:
      >>> targets_of(template, LoraSpec(targets="q_proj|v_proj"))[:2]
      ['model.layers.0.self_attn.q_proj', 'model.layers.0.self_attn.v_proj']
    """
    wrapped = set(_layers(module))  # (a wrapped model: its adapters' own Linears are no targets)
    linear = [n for n, m in module.named_modules() if n and is_linear(m) and n.rpartition(".")[0] not in wrapped]
    if spec.targets == ALL_LINEAR:
        head = _output_layer(module)
        picked = [n for n in linear if n != head]
    else:
        pattern = re.compile(spec.targets)
        picked = [n for n in linear if any(pattern.fullmatch(x) for x in (n, n.rsplit(".", 1)[-1], n + ".weight"))]
    if not picked:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in linear})
        listed = ", ".join(leaves[:8]) or "nothing: it has no linear layer"
        raise ValueError(
            f"lora.targets {spec.targets!r} matches no linear layer of the model (its layers end in "
            f"{listed}); give a regex over those names"
        )
    return picked


def _output_layer(module: nn.Module) -> str | None:
    """The name of `module.get_output_embeddings()` (the first it has), or None (PEFT's "all-linear" exclusion)."""
    get = getattr(module, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return next((n for n, m in module.named_modules() if m is head), None) if head is not None else None


def wrap(module: nn.Module, spec: LoraSpec) -> nn.Module:
    """A copy of `module` with a `LoraLinear` in place of every targeted linear layer.

    Args:
      module: the model, typically the family's meta template (it is not changed).
      spec: the LoRA spec.

    Returns:
      The wrapped copy: the base parameters keep their names, the adapters are
      `<layer>.lora_A.weight` and `<layer>.lora_B.weight`.

    Raises:
      ValueError: no layer matches `spec.targets`.

    Example:
      >>> model = wrap(template, LoraSpec(rank=8, targets="all-linear"))
    """
    names = targets_of(module, spec)
    wrapped = copy.deepcopy(module)
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = wrapped.get_submodule(parent_name) if parent_name else wrapped
        setattr(parent, leaf, LoraLinear(getattr(parent, leaf), spec))
    return wrapped


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (`...lora_A.weight` / `...lora_B.weight`)."""
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def is_base(name: str) -> bool:
    """Whether a parameter name is the base's (not an adapter's): what a LoRA run holds frozen (`Task.frozen`)."""
    return not is_adapter(name)


def adapter_names(model: nn.Module) -> list[str]:
    """The adapter parameters of a wrapped model, in `named_parameters()` order."""
    return [n for n, _ in model.named_parameters() if is_adapter(n)]


def split(params: Mapping[str, Any]) -> tuple[dict, dict]:
    """`(adapters, base)`: a wrapped model's params split by name.

    Example:
      >>> adapters, base = split(params)
    """
    adapters = {n: v for n, v in params.items() if is_adapter(n)}
    return adapters, {n: v for n, v in params.items() if not is_adapter(n)}


def init_adapters(
    model: nn.Module, key: torch.Tensor, device=None, dtype=torch.float32, where=None
) -> dict[str, torch.Tensor]:
    """Fresh adapters for a wrapped model: A kaiming-uniform (a=√5: U(±1/√in)), B zero.

    Args:
      model: the wrapped model (`wrap`).
      key: the rng key they are drawn from (`functrain.rng`); each A from `fold_in(key, its index)`.
      device: where they live (default: the key's device).
      dtype: their dtype.
      where: optional `where(name, shape) -> (offset, local_shape)` (`functrain.parallel.init_sharded`):
        only this rank's block of each adapter is returned, the same numbers as the whole one's.

    Returns:
      {name: tensor} of every adapter parameter, in `named_parameters()` order.

    Example:
      >>> adapters = init_adapters(model, rng.key(0))
    """
    out = {}
    for i, name in enumerate(adapter_names(model)):
        shape = tuple(model.get_parameter(name).shape)
        if name.endswith(".lora_A.weight"):  # (r, in)
            u = rng_lib.uniform(rng_lib.fold_in(key, i), shape, dtype=torch.float32)
            value = ((u * 2.0 - 1.0) / math.sqrt(shape[1])).to(dtype)
        else:  # (out, r)
            value = torch.zeros(shape, dtype=dtype, device=key.device)
        if where is not None:
            offset, local = where(name, shape)
            value = value[tuple(slice(o, o + n) for o, n in zip(offset, local))].clone()
        out[name] = value if device is None else value.to(device)
    return out


def _layers(model: nn.Module) -> dict[str, LoraLinear]:
    """{name: layer} of the wrapped model's `LoraLinear`s."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def merge(model: nn.Module, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base params with every adapter folded in: W + scaling · B A (transposed for `Conv1D`).

    Args:
      model: the wrapped model (its layers' scaling and weight layout).
      params: base and adapter params by name (plain tensors).

    Returns:
      The base params (adapters dropped), each targeted weight replaced by its merged copy, computed as
      PEFT's `merge` computes it (in the adapters' dtype; float16/bfloat16 on the CPU through float32); the
      model without adapters computes with them what the wrapped one computes. DTensors merge as DTensors
      (no rank gathers a whole weight).

    Example:
      >>> merged = merge(model, {**state.frozen, **state.params})
    """
    out = {n: v for n, v in params.items() if not is_adapter(n)}
    for name, layer in _layers(model).items():
        a, b = params[f"{name}.lora_A.weight"], params[f"{name}.lora_B.weight"]
        upcast = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)  # (PEFT's: slow CPU matmuls)
        delta = b.float() @ a.float() if upcast else b @ a  # (out, in)
        delta = ((delta.t() if layer.fan_in_fan_out else delta) * layer.scaling).to(b.dtype)  # the adapters' dtype
        w = out[f"{name}.weight"]
        out[f"{name}.weight"] = w + delta.to(w.dtype)
    return out


def peft_directory(out: str | os.PathLike) -> Path:
    """Where the PEFT adapter directory of an export to `out` goes: `<out>-peft` beside it.

    Example:
      >>> peft_directory("runs/sft/hf")
      PosixPath('runs/sft/hf-peft')
    """
    out = Path(out)
    return out.with_name(out.name + "-peft")


def peft_tensors(adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters under the names of PEFT's `adapter_model.safetensors` (`base_model.model.<layer>.lora_A.weight`)."""
    return {PEFT_PREFIX + n: v for n, v in adapters.items()}


def peft_config(
    model: nn.Module, spec: LoraSpec, base_model: str = "", hf_name: Callable[[str], str] = str
) -> dict[str, Any]:
    """PEFT's `adapter_config.json` for the wrapped model: the exact layers, as a full-match regex.

    Args:
      model: the wrapped model.
      spec: its spec.
      base_model: `base_model_name_or_path` (the directory of the base weights).
      hf_name: a parameter's name in the transformers model PEFT loads into (default: the same).

    Returns:
      The JSON-able config (`peft.LoraConfig` fields).

    Example:
      >>> json.dump(peft_config(model, spec, "runs/base/hf"), open("adapter_config.json", "w"))
    """
    names = [hf_name(f"{n}.weight").removesuffix(".weight") for n in _layers(model)]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "use_rslora": spec.rslora,
        "target_modules": "(" + "|".join(re.escape(n) for n in names) + ")",
        "bias": "none",
        "fan_in_fan_out": any(m.fan_in_fan_out for m in _layers(model).values()),
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
