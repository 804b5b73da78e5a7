"""How a decoder family's model is cut into stages (remat, per-block FSDP gathers, pipelines, stage-by-stage
compiles), runs its blocks with their dropout keys, is initialized block by block, and split over the sequence
(context parallelism).

Internals: docs/internals.md "functrain.models.stages".

Example:
    >>> blocks = repeated_stages(template, "layers", lambda m, p, h, key, i: functional_call(m, p, (h,)))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from functrain import config_checks, functional, parallel, rng
from functrain.step.staged import Stage

__all__ = [
    "LMStages",
    "block_stages",
    "dropout_key",
    "norm_stage",
    "run_blocks",
    "site_key",
    "context_model",
    "init_blocks",
    "repeated_stages",
    "resolve_remat",
    "submodule_stage",
    "wants_stages",
]


class LMStages(NamedTuple):
    """A decoder LM's forward (up to the hidden states the head reads) cut into `remat.Stage`s."""

    embed: Stage  # fn(p, idx, key, packed=None) -> (B, T, C)
    blocks: list[Stage]  # blocks[i].fn(p, h, key, packed=None) -> (B, T, C)
    final: Stage  # fn(p, h, key) -> (B, T, C): the final norm


# Dropout sites of a decoder family: 0 is the embedding; block i uses 1 + 2i (attention output), 2 + 2i (MLP output).
def site_key(key: torch.Tensor | None, site: int | torch.Tensor) -> torch.Tensor | None:
    """The dropout key of one site (`rng.fold_in(key, site)`), or None when dropout is off.

    Example:
      >>> x = rng.dropout(x, cfg.dropout, site_key(key, 0))   # the embedding's dropout
    """
    return None if key is None else rng.fold_in(key, site)


def dropout_key(dropout: float, key: torch.Tensor | None) -> torch.Tensor | None:
    """The key a forward draws its dropout masks from: None when the model has no dropout (`dropout == 0`).

    Example:
      >>> key = dropout_key(cfg.dropout, key)
    """
    return None if dropout == 0.0 else key


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, key: torch.Tensor | None, packed=None) -> torch.Tensor:
    """`x` through every block, block i called as `block(x, attn_key, mlp_key, layer)` with its sites' keys.

    Args:
      blocks: the model's blocks.
      x: (B, T, C) hidden states.
      key: the forward's dropout key (`dropout_key`), or None.
      packed: packed rows' `models.lm.Packed`, or a KV cache's view: each block gets its `packed.layer(i)`.

    Returns:
      (B, T, C).

    Example:
      >>> x = run_blocks(self.layers, x, dropout_key(cfg.dropout, key), packed)
    """
    for i, block in enumerate(blocks):
        layer = None if packed is None else packed.layer(i)  # (a KV cache: the block's own)
        x = block(x, site_key(key, 1 + 2 * i), site_key(key, 2 + 2 * i), layer)  # (B, T, C)
    return x


def block_stages(model: nn.Module, container: str, dropout: float) -> list[Stage]:
    """`repeated_stages` of blocks called as `run_blocks` calls them: block i's stage draws dropout at sites
    1 + 2i and 2 + 2i (`i` an int or a 0-d tensor), so the stages compute what the forward computes.

    Args:
      model: the (meta-device) model.
      container: the attribute holding the blocks (e.g. "layers").
      dropout: the model's dropout probability.

    Returns:
      The block stages, `fn(p, h, key, packed=None)`.

    Example:
      >>> blocks = block_stages(template, "layers", cfg.dropout)
    """

    def block(module, own, h, key, i, packed=None):
        """Block i's stage: dropout sites 1 + 2i and 2 + 2i; `packed`: the rows' documents."""
        key = dropout_key(dropout, key)
        return functional.apply(module, own, h, site_key(key, 1 + 2 * i), site_key(key, 2 + 2 * i), packed)

    return repeated_stages(model, container, block)


def norm_stage(model: nn.Module, prefix: str) -> Stage:
    """The final norm's stage (the submodule under `prefix`, e.g. "norm."): `fn(p, h, key) -> (B, T, C)`.

    Example:
      >>> final = norm_stage(template, "ln_f.")
    """
    return submodule_stage(model, prefix, lambda module, own, h, key: functional.apply(module, own, h))


def submodule_stage(model: nn.Module, prefix: str, fn: Callable) -> Stage:
    """A stage over the parameters under `prefix` (e.g. "layers.3."), running `fn(module, p, *args)`.

    `fn` gets the submodule and its parameters with the prefix stripped (ready for
    `torch.func.functional_call`), so a tensor-parallel copy of the model (Linears swapped) works
    unchanged.

    Args:
      model: the (meta-device) model.
      prefix: a submodule path ending in ".".
      fn: `fn(module, own_params, *args) -> tensor`.

    Returns:
      `Stage(names under prefix, lambda p, *args: fn(module, own(p), *args))`.

    Example:
      >>> st = submodule_stage(model, "norm.", lambda m, p, h, key: functional_call(m, p, (h,)))
    """
    module = model.get_submodule(prefix.rstrip("."))
    names = tuple(n for n, _ in model.named_parameters() if n.startswith(prefix))

    def run(p, *args):
        """`fn` on this submodule's own parameters."""
        own = {n[len(prefix) :]: t for n, t in p.items() if n.startswith(prefix)}
        return fn(module, own, *args)

    return Stage(names, run)


def repeated_stages(model: nn.Module, container: str, fn: Callable) -> list[Stage]:
    """One stage per block of `model.<container>` (an `nn.ModuleList`), all sharing one computation.

    Block i's stage runs `fn(block_i, own_params, h, key, i, *side)`; its `Stage.shared` runs
    `fn(block_0, own_params, h, key, index, *side)` with `index` a 0-d tensor (`side`: the staged loss's
    side inputs, e.g. packed rows' `Packed`; usually none), the same function object for
    every block, so `step.staged.staged_loss(...).compile_stages()` compiles one block graph for all of them.
    `fn` must therefore use `index` only through tensor ops (e.g. `rng.fold_in(key, 1 + 2 * index)`),
    and the blocks must have the same parameter names and shapes (checked: else no `shared`).

    Args:
      model: the (meta-device) model.
      container: the attribute holding the blocks (e.g. "blocks", "layers").
      fn: `fn(module, own, h, key, index, *side) -> h`, `own` the block's params without its prefix.

    Returns:
      The block stages, in order.

    Example:
      >>> blocks = repeated_stages(model, "layers", lambda m, p, h, key, i: functional_call(m, p, (h,)))
    """
    modules = getattr(model, container)
    first = modules[0] if len(modules) else None

    def shared(own, h, key, index, *side):
        """Any block: block 0's module (they are alike) on `own`, at position `index`."""
        return fn(first, own, h, key, index, *side)

    def signature(m: nn.Module):
        """A block's parameter names and shapes."""
        return [(n, tuple(p.shape), type(m.get_submodule(n.rpartition(".")[0]))) for n, p in m.named_parameters()]

    first_signature = signature(first) if first is not None else None
    alike = all(signature(m) == first_signature for m in modules)
    stages = []
    for i in range(len(modules)):
        stage = submodule_stage(
            model, f"{container}.{i}.", lambda m, own, h, key, *side, i=i: fn(m, own, h, key, i, *side)
        )
        stages.append(Stage(stage.names, stage.fn, shared if alike else None, f"{container}.{i}.", i))
    return stages


def init_blocks(
    model: nn.Module,
    key: torch.Tensor,
    block: Callable,
    *,
    device=None,
    dtype: torch.dtype = torch.float32,
    where: Callable | None = None,
) -> dict[str, torch.Tensor]:
    """Every parameter of `model` (or only `where`'s block of each) from a family's block initializer.

    Args:
      model: the (meta-device) model.
      key: an `rng` key.
      block: `block(model, name, shape, key, offset, local_shape) -> CPU float32 tensor`: the values of
        that block of parameter `name`, a pure function of its arguments.
      device: where to put the tensors.
      dtype: their dtype.
      where: optional `where(name, shape) -> (offset, local_shape)` (this rank's shard); default whole.

    Returns:
      {name: tensor} in `model.named_parameters()` order (a tied weight once).

    Example:
      >>> params = init_blocks(template, rng.key(0), lambda m, n, s, k, o, l: torch.zeros(l), where=where)
    """
    out = {}
    for name, p in model.named_parameters():
        offset, local = where(name, p.shape) if where is not None else ([0] * p.ndim, list(p.shape))
        out[name] = block(model, name, p.shape, key, offset, local).to(device=device, dtype=dtype)
    return out


def context_model(model: nn.Module, ctx, block_size: int, kernel: str = "zigzag") -> nn.Module:
    """`model` for this rank's part of each sequence when the mesh has a cp axis (else `model`).

    Args:
      model: the (meta-device) LM template.
      ctx: the parallel context (`ctx.mesh`'s cp axis splits the sequences).
      block_size: the training sequence length.
      kernel: the attention's kernel (`config.cp_attention`, see `parallel.context.split_of`).

    Returns:
      `functrain.parallel.context.context_parallel(model, split)`: `model` itself without cp.

    Raises:
      ConfigError: the sequence length does not divide by 2 x cp (each rank holds two chunks).

    Example:
      >>> model = parallel.tensor_parallel(stages.context_model(template, ctx, 1024), ctx.mesh, rules)
    """
    split = parallel.context.split_of(ctx.mesh, kernel)
    config_checks.check_context(block_size, 1 if split is None else split.world)
    return parallel.context.context_parallel(model, split)


def resolve_remat(value, mesh) -> str | int:
    """The remat policy `value` means on `mesh`.

    Args:
      value: the config's `remat`: "auto", "none", "full" or N.
      mesh: the DeviceMesh, or None on one process.

    Returns:
      "auto" -> "full" on a mesh (a recomputed block's gathered params go after its forward: no
      rank ever holds the whole model), "none" on one process; other values unchanged.

    Example:
      >>> remat = stages.resolve_remat(config.remat, ctx.mesh)
    """
    if value == "auto":
        return "full" if mesh is not None else "none"
    return value


def wants_stages(config, ctx) -> bool:
    """Whether a family's loss must be staged even with remat "none".

    Args:
      config: the run config (`compile_unit` is read).
      ctx: the parallel context.

    Returns:
      True for sharded params (per-block gathers), `compile_unit="blocks"` (a graph per stage) or
      pipeline stages (`ctx.pp_world > 1`: the stages are cut over the ranks).

    Example:
      >>> loss_fn = make_loss_fn(model, remat=remat, staged=stages.wants_stages(config, ctx))
    """
    return ctx.mesh is not None or config.compile_unit == "blocks" or ctx.pp_world > 1
