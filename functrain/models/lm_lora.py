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

from functrain import config_checks, rng
from functrain.interop.safetensors import load_safetensors, rank_and_world, save_safetensors
from functrain.nn import lora

__all__ = [
    "ADAPTER_STREAM",
    "exporter",
    "flops_per_token",
    "frozen",
    "read_peft",
    "save_peft",
    "spec_of",
    "with_adapters",
    "wrap",
]

ADAPTER_STREAM = 0x10AA
"""The adapters are drawn from `fold_in(key, ADAPTER_STREAM)`: the base's draws from `key` stay as without LoRA."""


def spec_of(config: Any) -> lora.LoraSpec | None:
    """The run's `LoraSpec` (`config.lora`), or None when `lora.rank` is 0."""
    c = config.lora
    if not c.rank:
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
        raise config_checks.ConfigError(f"{exc} (--config.lora.*)") from None


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
        raise config_checks.ConfigError(f"{exc} (--config.lora.targets)") from None


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


def with_adapters(
    init: Callable,
    model: nn.Module,
    spec: lora.LoraSpec | None,
    *,
    init_from: str = "",
    hf_name: Callable[[str], str] | None = None,
    base_model: str = "",
) -> Callable:
    """The family's `init_params(key, device, where=None)` followed by the adapters: fresh, or a PEFT adapter
    directory's (`lora.init_from`, read and checked now: `read_peft`); none without `spec`.

    Args:
      init: the family's base init.
      model: the wrapped template.
      spec: the LoRA spec (None: `init` as it is).
      init_from: a PEFT adapter directory to start the adapters from ("" for fresh ones).
      hf_name: a parameter's name in the transformers model the adapters were made for (None: the family
        has no PEFT format, and `init_from` is refused).
      base_model: this run's base directory (checked against the adapters' `base_model_name_or_path`).

    Returns:
      `init_params(key, device, where=None)` of base and adapters.

    Raises:
      ConfigError: `init_from` that does not fit the run (one line; `read_peft`).

    Example:
      >>> init = with_adapters(base_init, template, spec)
      >>> params = init(rng.key(0), torch.device("cpu"))   # base, then adapters
    """
    if spec is None:
        return init
    start = read_peft(init_from, model, spec, hf_name, base_model) if init_from else None

    def init_with_adapters(key, device, where=None):
        base = init(key, device, where=where) if where is not None else init(key, device)
        if start is None:
            adapters = lora.init_adapters(model, rng.fold_in(key, ADAPTER_STREAM), device=device, where=where)
        else:
            adapters = {n: _block(t, n, where).to(device) for n, t in start.items()}
        return {**base, **adapters}

    return init_with_adapters


def _block(t, name: str, where):
    """This rank's block of a whole tensor (`where(name, shape) -> (offset, local shape)`), or the tensor."""
    if where is None:
        return t
    offset, local = where(name, tuple(t.shape))
    return t[tuple(slice(o, o + n) for o, n in zip(offset, local))].clone()


def read_peft(
    directory: str, model: nn.Module, spec: lora.LoraSpec, hf_name: Callable[[str], str] | None, base_model: str
) -> dict:
    """The adapters of a PEFT LoRA directory (`adapter_config.json`, `adapter_model.safetensors`) by the wrapped
    model's names, float32, after checking they fit: PEFT's rank, alpha and rslora are the run's, its layers
    are the ones `lora.targets` adapts, every shape fits, and its base (`base_model_name_or_path`, where that is
    a directory here) has this run's config.json.

    Raises:
      ConfigError: a missing or unreadable directory, a family without a PEFT format, or any of the above that
        does not fit (one line naming it and the key to set).

    Example:
      >>> adapters = read_peft("runs/sft/hf-peft", template, spec, str, "runs/base")
    """
    key = f"lora.init_from={directory}"
    if hf_name is None:
        raise config_checks.ConfigError(
            f"{key}: this family's layers are not transformers' one for one (GPT-2 fuses q, k and v), so it "
            "reads no PEFT directory; drop --config.lora.init_from (start from a checkpoint: checkpoint.init_from)"
        )
    d = Path(directory).expanduser()
    try:
        cfg = json.loads((d / "adapter_config.json").read_text())
        stored = load_safetensors(d / "adapter_model.safetensors")
    except (OSError, ValueError) as exc:
        raise config_checks.ConfigError(
            f"{key}: not a PEFT adapter directory ({exc}); give the directory PEFT's save_pretrained wrote"
        ) from None
    want = {"r": spec.rank, "lora_alpha": spec.alpha, "use_rslora": spec.rslora}
    flags = {"r": "lora.rank", "lora_alpha": "lora.alpha", "use_rslora": "lora.rslora"}
    off = [f"{k} {cfg.get(k)!r} (set --config.{flags[k]}={cfg.get(k)})" for k, v in want.items() if cfg.get(k, v) != v]
    if cfg.get("peft_type", "LORA") != "LORA" or off:
        raise config_checks.ConfigError(f"{key}: the adapters were made with {'; '.join(off) or cfg.get('peft_type')}")
    ours = {hf_name(n): n for n in lora.adapter_names(model)}
    theirs = {n.removeprefix(lora.PEFT_PREFIX).replace(".default.", "."): t for n, t in stored.items()}
    if set(theirs) != set(ours):
        only = sorted(set(theirs) - set(ours))[:2] + sorted(set(ours) - set(theirs))[:2]
        raise config_checks.ConfigError(
            f"{key}: its {len(theirs) // 2} adapted layers are not the {len(ours) // 2} lora.targets picks here (e.g. "
            f"{', '.join(only)}); set --config.lora.targets to the layers of its adapter_config.json"
        )
    for name, t in theirs.items():
        shape = tuple(model.get_parameter(ours[name]).shape)
        if tuple(t.shape) != shape:
            raise config_checks.ConfigError(f"{key}: {name} is {tuple(t.shape)}, this model's adapter is {shape}")
    _check_base(key, cfg.get("base_model_name_or_path") or "", base_model)
    return {ours[name]: t.float() for name, t in theirs.items()}


def _check_base(key: str, theirs: str, ours: str) -> None:
    """Refuses adapters whose base directory (where it is one here) has another config.json than this run's base."""
    there, here = Path(theirs).expanduser(), Path(ours).expanduser()
    if not ours or not (there / "config.json").is_file() or there.resolve() == here.resolve():
        return
    volatile = ("transformers_version", "dtype", "torch_dtype", "_name_or_path", "use_cache")
    a, b = (
        {k: v for k, v in json.loads((p / "config.json").read_text()).items() if k not in volatile}
        for p in (there, here)
    )
    if a != b:
        differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))[:4]
        raise config_checks.ConfigError(
            f"{key}: its base {theirs} is another model than this run's {ours} (config.json differs in "
            f"{', '.join(differ)}); point model.path at the adapters' base"
        )


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
    alone as a PEFT directory beside it (`lora.peft_directory(out)`).

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
            save_peft(lora.peft_directory(out), model, spec, lora.split(params)[0], base_model, hf_name)
        return export(lora.merge(model, params), out)  # (DTensors merge as DTensors: still sharded)

    return export_lora
