"""Tensor parallelism applied from the outside: a copy of the model whose Linears compute on tp shards.

Internals: docs/internals.md "functrain.parallel.tp".

Example:
    >>> tp_model = parallel.tensor_parallel(template, ctx.mesh, parallel.default_rules(gpt.TP_RULES))
    >>> loss_fn = lambda p, b, k: gpt.cross_entropy(functrain.apply(tp_model, p, b["x"], dropout_key=k), b["y"])
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from functrain.nn.lora import LoraLinear, adapter_names
from functrain.parallel.mesh import TP_AXIS
from functrain.parallel.sharding import Rule, placements_for

__all__ = ["adapter_rules", "tensor_parallel", "copy_to_tp", "meta_copy", "reduce_from_tp"]


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of `x` over `group` (a functional collective, waited)."""
    y = funcol.all_reduce(x.contiguous(), "sum", group)
    return y.wait() if isinstance(y, funcol.AsyncCollectiveTensor) else y


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (Megatron's `f`)."""

    @staticmethod
    def forward(x, group):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        # no_grad: the collective's own autograd kernel is not a functorch-ready Function.
        with torch.no_grad():
            return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (Megatron's `g`)."""

    @staticmethod
    def forward(x, group):
        return _all_reduce(x, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Marks a replicated activation entering tp-sharded compute (gradient summed over `group`).

    Args:
      x: an activation that is the same on every rank of `group`.
      group: the tp group (a 1-D DeviceMesh or a ProcessGroup).

    Returns:
      `x` (its gradient is all-reduced over `group` in backward).

    Example:
      >>> h = F.linear(copy_to_tp(x, tp_mesh), w_local)
    """
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Sums tp-partial activations over `group` (gradient passed through unchanged).

    Args:
      x: this rank's partial sum.
      group: the tp group (a 1-D DeviceMesh or a ProcessGroup).

    Returns:
      The full sum, the same on every rank of `group`.

    Example:
      >>> y = reduce_from_tp(F.linear(x_local, w_local), tp_mesh) + bias
    """
    return _ReduceFromTP.apply(x, group)


class _ColwiseLinear(nn.Linear):
    """Linear over this rank's output features; input gradient summed over tp."""

    tp_group = None

    def forward(self, x):
        return F.linear(copy_to_tp(x, self.tp_group), self.weight, self.bias)


class _RowwiseLinear(nn.Linear):
    """Linear over this rank's input features; partial outputs summed over tp, bias added once."""

    tp_group = None

    def forward(self, x):
        y = reduce_from_tp(F.linear(x, self.weight), self.tp_group)
        return y if self.bias is None else y + self.bias


class _ColwiseLora(LoraLinear):
    """A LoRA layer over a colwise base: the base on this rank's output features; A replicated, B (a
    `_ColwiseLinear`, its input's gradient summed over tp) on the same output features."""

    tp_group = None

    def forward(self, x):
        y = F.linear(copy_to_tp(x, self.tp_group), self.weight, self.bias)
        return y + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


class _RowwiseLora(LoraLinear):
    """A LoRA layer over a rowwise base: base and A (a `_RowwiseLinear`: its r outputs summed over tp) on
    this rank's input features, B replicated; the base's partial outputs summed, the bias added once."""

    tp_group = None

    def forward(self, x):
        y = reduce_from_tp(F.linear(x, self.weight), self.tp_group)
        y = y if self.bias is None else y + self.bias
        return y + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose parameters and buffers live on "meta": the template a parallel
    rewrite edits without touching the user's module.

    Ties are kept; the DeviceMeshes its modules name (another parallelism's groups) are shared, not
    copied.

    Args:
      model: any module.

    Returns:
      The copy, on meta.

    Example:
      >>> template = meta_copy(model)  # then swap its Linears for tensor-parallel ones
    """
    memo: dict[int, Any] = {id(v): v for m in model.modules() for v in vars(m).values() if isinstance(v, DeviceMesh)}
    memo.update(
        {
            id(v): v
            for m in model.modules()
            for v in vars(m).values()
            if isinstance(v, tuple) and any(isinstance(x, DeviceMesh) for x in v)
        }
    )
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def tensor_parallel(model: nn.Module, mesh, rules: Sequence[Rule]) -> nn.Module:
    """A tensor-parallel copy of `model` for the tp axis of `mesh` (the model itself is untouched).

    Args:
      model: the model (a real one or a "meta" template; the copy never holds weights).
      mesh: the DeviceMesh (axis "tp"), or None / a mesh whose tp axis has size 1.
      rules: the sharding rules used for the state (e.g. `default_rules(gpt.TP_RULES)`); the
        tp-axis placement of each Linear weight picks its style: Shard(0) colwise, Shard(1) rowwise.

    Returns:
      `model` itself when there is no tensor parallelism, else a storage-free copy with the
      sharded Linears swapped (same parameter names). Use it in the loss function.

    Raises:
      ValueError: a parameter outside an nn.Linear is sharded on tp, or a rowwise bias is sharded.

    Example:
      >>> tp_model = tensor_parallel(template, ctx.mesh, default_rules(gpt.TP_RULES))
    """
    if mesh is None or TP_AXIS not in (mesh.mesh_dim_names or ()) or mesh[TP_AXIS].size() == 1:
        return model
    tp_dim = mesh.mesh_dim_names.index(TP_AXIS)
    tp_mesh = mesh[TP_AXIS]
    placement = {name: placements_for(name, p.shape, mesh, rules)[tp_dim] for name, p in model.named_parameters()}
    out = meta_copy(model)
    handled = _lora_layers(out, placement, tp_mesh)
    linears = {name: m for name, m in out.named_modules() if type(m) is nn.Linear}
    for name, m in linears.items():
        prefix = f"{name}." if name else ""
        w = placement.get(prefix + "weight")
        b = placement.get(prefix + "bias", Replicate()) if m.bias is not None else Replicate()
        if w == Shard(0) and b in (Shard(0), Replicate()) and (m.bias is None or b == Shard(0)):
            m.__class__ = _ColwiseLinear
        elif w == Shard(1) and b == Replicate():
            m.__class__ = _RowwiseLinear
        elif isinstance(w, Shard) or isinstance(b, Shard):
            raise ValueError(f"tensor_parallel: unsupported tp placements for {name}: weight {w}, bias {b}")
        else:
            continue
        m.tp_group = tp_mesh
        handled.update({prefix + "weight", prefix + "bias"})
    for name, p in placement.items():
        if isinstance(p, Shard) and name not in handled:
            raise ValueError(
                f"tensor_parallel: {name} is sharded on tp ({p}) but is not the weight or bias of an "
                "nn.Linear; only colwise/rowwise Linears are supported"
            )
    return out


def _lora_layers(model: nn.Module, placement: dict, tp_mesh) -> set[str]:
    """Makes each LoRA layer (`functrain.nn.lora`) over a tp-sharded base tensor-parallel in place (its
    adapters, nn.Linears, follow as any Linear by their own placements); the base names it handled."""
    handled = set()
    for name, m in model.named_modules():
        if not isinstance(m, LoraLinear):
            continue
        w = placement.get(f"{name}.weight")
        if isinstance(w, Shard) and m.fan_in_fan_out:
            raise ValueError(
                f"tensor_parallel: {name} keeps its weight as (in, out) (transformers' Conv1D); LoRA on "
                "tensor-parallel Conv1D layers is not supported: set mesh.tp=1"
            )
        if w == Shard(0) and (m.bias is None or placement.get(f"{name}.bias") == Shard(0)):
            m.__class__ = _ColwiseLora
        elif w == Shard(1) and placement.get(f"{name}.bias", Replicate()) == Replicate():
            m.__class__ = _RowwiseLora
        elif isinstance(w, Shard):
            raise ValueError(f"tensor_parallel: unsupported tp placement {w} of {name}.weight")
        else:
            continue
        m.tp_group = tp_mesh
        handled.update({f"{name}.weight", f"{name}.bias"})
    return handled


def adapter_rules(model: nn.Module, rules: Sequence[Rule]) -> list[Rule]:
    """`rules` with each LoRA adapter of `model` (`functrain.nn.lora`) placed on the tp axis to follow its
    layer's plan: over a colwise base, B colwise (this rank's output features) and A replicated; over a
    rowwise base, A rowwise (this rank's input features) and B replicated (`tensor_parallel` then
    computes each layer in place). Without adapters, `rules` as they are.

    Args:
      model: the (wrapped) template.
      rules: the model's rules (e.g. `default_rules(TP_RULES)`).

    Returns:
      The rules, the adapters' first.

    Example:
      >>> rules = adapter_rules(template, default_rules(gpt.TP_RULES))
    """
    first: list[Rule] = []
    for name in adapter_names(model):
        layer, which, _ = name.rsplit(".", 2)  # ("...q_proj", "lora_A", "weight")
        spec = next(
            (
                per_axis[TP_AXIS]
                for pattern, per_axis in rules
                if TP_AXIS in per_axis and re.search(pattern, f"{layer}.weight")
            ),
            "replicate",
        )
        kind = {Shard(0): "colwise", Shard(1): "rowwise"}.get(spec, spec) if isinstance(spec, Shard) else spec
        own: dict[str, str] = {
            "colwise": {"lora_A": "replicate", "lora_B": "colwise"},
            "rowwise": {"lora_A": "rowwise", "lora_B": "replicate"},
        }.get(str(kind), {})
        first.append((f"^{re.escape(name)}$", {TP_AXIS: own.get(which, "replicate")}))
    return first + list(rules)
