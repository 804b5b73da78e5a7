"""LoRA in a language-model family (`--config.lora.*`): the wrapped template, the adapters beside the
base's init, and the export of both the merged model and the PEFT adapter directory.

Internals: docs/internals.md "functrain.models.lm_lora".

Example:
    >>> template, spec = lm_lora.wrap(template, config, ctx)
    >>> init = lm_lora.with_adapters(base_init, template, spec)
    >>> export = lm_lora.exporter(export, template, spec, hf_name=str, base_model=path)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, overload

from torch import nn

from functrain import config_checks as validate
from functrain import rng
from functrain.interop.safetensors import rank_and_world, save_safetensors
from functrain.nn import lora

__all__ = [
    "ADAPTER_STREAM",
    "exporter",
    "flops_per_token",
    "frozen",
    "peft_directory",
    "save_peft",
    "spec_of",
    "with_adapters",
    "wrap",
]

ADAPTER_STREAM = 0x10AA
"""The adapters are drawn from `fold_in(key, ADAPTER_STREAM)`: the base's draws from `key` stay as without LoRA."""


def spec_of(config: Any) -> lora.LoraSpec | None:
    """The run's `LoraSpec` (`config.lora`), or None when `lora.rank` is 0 (or the config has no `lora`)."""
    c = config.get("lora")
    if not c or not c.get("rank", 0):
        return None
    try:
        return lora.LoraSpec(
            rank=int(c.rank),
            alpha=float(c.alpha),
            targets=str(c.targets),
            dropout=float(c.dropout),
            rslora=bool(c.rslora),
        )
    except ValueError as exc:
        raise validate.ConfigError(f"{exc} (--config.lora.*)") from None


def wrap(template: nn.Module, config: Any, ctx) -> tuple[nn.Module, lora.LoraSpec | None]:
    """`(template with adapters, spec)` when `config.lora.rank > 0`, else `(template, None)`.

    Args:
      template: the family's meta template.
      config: the run config (`lora.*`).
      ctx: the parallel context.

    Returns:
      The wrapped template (`functrain.nn.lora.wrap`) and its spec.

    Raises:
      ConfigError: no layer matches `lora.targets` (one line).

    Example:
      >>> template, spec = wrap(template, config, ctx)
    """
    spec = spec_of(config)
    if spec is None:
        return template, None
    try:
        return lora.wrap(template, spec), spec
    except ValueError as exc:
        raise validate.ConfigError(f"{exc} (--config.lora.targets)") from None


def flops_per_token(flops: float, model: nn.Module, spec: lora.LoraSpec | None) -> float:
    """The family's training FLOPs per token (6 per weight and token, plus attention) for a LoRA run: the
    frozen weights' gradients are not computed (4 per weight and token: forward and the input's
    gradient), the adapters' are (6 per adapter weight). `flops` itself without `spec`.

    Example:
      >>> flops = flops_per_token(6 * n_params + attention, template, spec)
    """
    if spec is None:
        return flops
    adapters = set(lora.adapter_names(model))
    inner = {n.rsplit(".", 1)[0] for n in adapters}  # the adapters' own Linear modules
    weights = {
        id(m.weight): m.weight.numel()
        for n, m in model.named_modules()
        if n not in inner
        and hasattr(m, "weight")
        and m.weight is not None
        and m.weight.dim() == 2
        and (isinstance(m, lora.LoraLinear) or lora.is_linear(m))
    }
    n_adapters = sum(model.get_parameter(n).numel() for n in adapters)
    return flops - 2 * sum(weights.values()) + 6 * n_adapters


def frozen(spec: lora.LoraSpec | None) -> Callable[[str], bool] | None:
    """`Task.frozen` for the run: the base's names under LoRA, None without it."""
    return lora.is_base if spec is not None else None


def with_adapters(init: Callable, model: nn.Module, spec: lora.LoraSpec | None) -> Callable:
    """The family's `init_params(key, device, where=None)` followed by fresh adapters (none without `spec`).

    Example:
      >>> init = with_adapters(base_init, template, spec)
      >>> params = init(rng.key(0), torch.device("cpu"))   # base, then adapters
    """
    if spec is None:
        return init

    def init_with_adapters(key, device, where=None):
        base = init(key, device, where=where) if where is not None else init(key, device)
        adapters = lora.init_adapters(model, rng.fold_in(key, ADAPTER_STREAM), device=device, where=where)
        return {**base, **adapters}

    return init_with_adapters


def peft_directory(out: str | Path) -> Path:
    """Where the PEFT adapter directory of an export to `out` goes: `<out>-peft` beside it."""
    out = Path(out)
    return out.with_name(out.name + "-peft")


def save_peft(
    directory: str | Path,
    model: nn.Module,
    spec: lora.LoraSpec,
    adapters: dict,
    base_model: str = "",
    hf_name: Callable[[str], str] = str,
) -> Path:
    """Writes the adapters as a PEFT directory: `adapter_model.safetensors` (PEFT's key names) and
    `adapter_config.json`, which `peft.PeftModel.from_pretrained(base, directory)` loads.

    Args:
      directory: where (created).
      model: the wrapped template.
      spec: its spec.
      adapters: {name: tensor} (plain or DTensors: gathered one at a time, written by rank 0).
      base_model: the base's directory for `base_model_name_or_path` ("" when it has none).
      hf_name: a parameter's name in the transformers model (default: the same).

    Returns:
      The directory.

    Example:
      >>> save_peft("runs/lora/hf-peft", template, spec, lora.split(params)[0], "runs/base/hf")
    """
    out = Path(directory)
    rank, _ = rank_and_world()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    save_safetensors(lora.peft_tensors({hf_name(n): t for n, t in adapters.items()}), out / "adapter_model.safetensors")
    if rank == 0:
        config = lora.peft_config(model, spec, base_model, hf_name)
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


@overload
def exporter(
    export: Callable,
    model: nn.Module,
    spec: lora.LoraSpec | None,
    *,
    hf_name: Callable[[str], str] | None,
    base_model: str = "",
) -> Callable: ...


@overload
def exporter(
    export: None,
    model: nn.Module,
    spec: lora.LoraSpec | None,
    *,
    hf_name: Callable[[str], str] | None,
    base_model: str = "",
) -> None: ...


def exporter(
    export: Callable | None,
    model: nn.Module,
    spec: lora.LoraSpec | None,
    *,
    hf_name: Callable[[str], str] | None,
    base_model: str = "",
) -> Callable | None:
    """The family's `export(params, out)` for a LoRA run: the merged model to `out` (the family's own
    format) and, where each linear layer is one of the transformers model's (`hf_name`), the adapters
    alone as a PEFT directory beside it (`peft_directory(out)`).

    Args:
      export: the family's export (None: the family has none).
      model: the wrapped template.
      spec: the LoRA spec (None: `export` is returned as it is).
      hf_name: a parameter's name in the exported transformers model (the hf family: the same name);
        None: no PEFT directory (GPT, whose q, k and v are one layer in transformers' GPT-2).
      base_model: the base's directory, for the PEFT config.

    Returns:
      `export(params, out) -> out` over base and adapter params together.

    Example:
      >>> task_export = exporter(export, template, spec, hf_name=str, base_model="runs/base/hf")
    """
    if export is None or spec is None:
        return export

    def export_lora(params, out):
        if hf_name is not None:
            save_peft(peft_directory(out), model, spec, lora.split(params)[0], base_model, hf_name)
        return export(lora.merge(model, params), out)  # (DTensors merge as DTensors: still sharded)

    return export_lora
