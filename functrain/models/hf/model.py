"""Any transformers causal LM as a functrain model: built on meta from its config, initialized from a
key by transformers' own `_init_weights` a module at a time, and cut into stages at its decoder layers.

Internals: docs/internals.md "functrain.models.hf.model".

Example:
    >>> config = load_config("dirs/qwen2-tiny")
    >>> template = build_template(config, device="cpu")          # params on meta, buffers real
    >>> params = init_params(template, rng.key(0), device="cpu")
    >>> st = stages(template)
"""

from __future__ import annotations

import copy
import os
import re
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from functrain import functional, rng
from functrain.config_checks import ConfigError
from functrain.models.stages import LMStages
from functrain.nn import randomness
from functrain.step.staged import Stage

HFModel = Any  # a transformers PreTrainedModel (or a part of one); transformers is optional

__all__ = [
    "HFModelError",
    "StagingError",
    "build_template",
    "decoder_layers",
    "eval_logits",
    "final_norm",
    "head_name",
    "init_params",
    "layer_view",
    "load_config",
    "stages",
    "tp_rules",
]

_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


class HFModelError(ConfigError):
    """A transformers model this family cannot train: one line naming the model and why (a config error:
    the trainer prints it as its one `functrain: error:` line)."""


class StagingError(HFModelError):
    """A model the family cannot cut into stages (it may still train unstaged): one line naming why; the
    caller adds what to change (`hf.make_loss_fn`'s arguments, the trainer's flags)."""


def load_config(path: str | os.PathLike):
    """The `transformers` config of the model directory `path` (its config.json), checked.

    Args:
      path: a directory holding `config.json` (weights and tokenizer optional).

    Returns:
      A `transformers.PretrainedConfig`.

    Raises:
      HFModelError: no config.json, an unknown model type, an encoder-decoder or a mixture of experts.

    Example:
      >>> load_config("dirs/llama-tiny").model_type
      'llama'
    """
    import transformers

    where = Path(path).expanduser() / "config.json"
    if not where.is_file():
        raise HFModelError(f"{where}: no such file; point --config.model.path at a transformers model directory")
    try:
        config = transformers.AutoConfig.from_pretrained(str(where.parent))
    except (ValueError, KeyError, OSError) as exc:
        raise HFModelError(f"{where}: transformers cannot read it ({str(exc).splitlines()[0]})") from None
    if getattr(config, "is_encoder_decoder", False):
        raise HFModelError(
            f"{where}: {config.model_type} is an encoder-decoder; this family trains decoder-only causal LMs"
        )
    if _experts(config):
        raise HFModelError(
            f"{where}: {config.model_type} is a mixture of experts; its routed layers are not "
            "supported yet: train a dense model"
        )
    if not any(
        a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in (config.architectures or ["ForCausalLM"])
    ):
        raise HFModelError(
            f"{where}: architectures {config.architectures} has no causal LM; this family trains *ForCausalLM models"
        )
    return config


def _experts(config) -> int:
    """The expert count of a mixture of experts anywhere in its config (DBRX keeps it in `ffn_config`), else 0."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    found = [v for k, v in values.items() if k in _MOE_KEYS and isinstance(v, int) and v > 1]
    found += [_experts(v) for v in values.values() if isinstance(v, dict)]
    return max(found, default=0)


def build_template(config, device: torch.device | str = "cpu") -> nn.Module:
    """The causal LM of `config` with its parameters on meta and its buffers real on `device`.

    The model is built for real, as `from_config` builds it, except that no write into a parameter
    runs: each is recorded instead (the constructor's `nn.init` calls, transformers' `_init_weights`
    over every module, in their order), for `init_params` to replay one parameter at a time. So no
    memory is touched for the parameters, which then move to meta, and every buffer is exactly what a
    real build makes (rotary tables, activation constants such as xIELU's `beta`).

    Args:
      config: a transformers config (`load_config`).
      device: where the buffers go.

    Returns:
      The `*ForCausalLM` module (scaled-dot-product attention where the architecture has it, else
      its own; no cache), in train mode.

    Raises:
      HFModelError: transformers cannot build the model from its config (one line).

    Example:
      >>> template = build_template(load_config("dirs/gpt2-tiny"))
    """
    import transformers

    config = copy.deepcopy(config)
    config.use_cache = False
    with _ParamWrites() as writes:
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        except ValueError:  # an architecture without an SDPA path (e.g. Gemma 2): its own attention
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        except (AttributeError, TypeError, RuntimeError, ImportError) as exc:
            raise HFModelError(
                f"{config.model_type}: transformers {transformers.__version__} cannot build it from "
                f"its config ({str(exc).splitlines()[0]})"
            ) from None
    _INITS[model] = writes.by_name(model)
    _params_to_meta(model)
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)
    return model.train()


class _Write(NamedTuple):
    """One recorded write into a parameter: `func` on its view (offset, size, stride), with the other arguments."""

    func: Callable
    view: tuple
    args: tuple
    kwargs: dict


class _ParamWrites(TorchFunctionMode):
    """While a model is built: every in-place write into a parameter is recorded and skipped."""

    def __init__(self):
        super().__init__()
        self.params: dict[int, torch.Tensor] = {}  # storage -> the parameter on it (kept alive)
        self.writes: dict[int, list[_Write]] = {}  # id(parameter) -> its writes, in order
        self.empty: dict[int, torch.Tensor] = {}  # storages made uninitialized (torch.empty and the like)

    def __enter__(self):
        self._hook = nn.modules.module.register_module_parameter_registration_hook(self._registered)
        return super().__enter__()

    def __exit__(self, *exc):
        self._hook.remove()
        return super().__exit__(*exc)

    def _registered(self, module, name, param):
        if param is not None:
            self.params[param.untyped_storage()._cdata] = param

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (name.endswith("_") and not name.endswith("__")) or name == "__setitem__":
            target = args[0] if args else kwargs.get("tensor")  # (torch.nn.init's functions take it by keyword too)
            if isinstance(target, torch.Tensor):
                storage = target.untyped_storage()._cdata
                if isinstance(target, nn.Parameter) or storage in self.params:
                    param = self.params.setdefault(storage, target)
                    view = (target.storage_offset(), tuple(target.shape), target.stride())
                    rest = (args[1:], kwargs) if args else ((), {k: a for k, a in kwargs.items() if k != "tensor"})
                    self.writes.setdefault(id(param), []).append(_Write(func, view, *rest))
                    return target
        out = func(*args, **kwargs)
        if func is torch.empty or func is torch.empty_like or func is torch.Tensor.new_empty:
            self.empty[out.untyped_storage()._cdata] = out  # (kept alive: its storage's id stays its own)
        return out

    def by_name(self, model: HFModel) -> dict[str, list[_Write] | torch.Tensor]:
        """Each parameter's recorded writes, or, for one never written, its value as built."""
        out = {}
        for n, p in model.named_parameters():
            writes = self.writes.get(id(p))  # (by the parameter: `.data = ...` may have given it another storage)
            if not writes and p.untyped_storage()._cdata in self.empty:
                raise HFModelError(
                    f"{model.config.model_type}: nothing initializes {n} (neither its constructor nor "
                    "transformers' _init_weights writes it); this family cannot make it: start from the "
                    "directory's weights"
                )
            out[n] = (
                [w._replace(view=(w.view[0] - p.storage_offset(), *w.view[1:])) for w in writes]
                if writes
                else p.detach().clone()
            )
        return out


_INITS: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()  # template -> its parameters' writes


def _params_to_meta(model: HFModel) -> None:
    """Moves every parameter to meta in place, tied ones staying one object."""
    moved: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in moved:
                    moved[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                module._parameters[name] = moved[id(p)]


def decoder_layers(model: HFModel) -> str:
    """The dotted name of the model's decoder layer list (e.g. "model.layers", "transformer.h").

    Args:
      model: a transformers causal LM.

    Returns:
      The name of the `nn.ModuleList` whose items are of the model's `_no_split_modules` class.

    Raises:
      HFModelError: none found (one line).

    Example:
      >>> decoder_layers(template)
      'model.layers'
    """
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(type(m).__name__ in kinds for m in module):
            return name
    raise StagingError(
        f"{type(model).__name__}: no list of decoder layers ({sorted(kinds) or 'no _no_split_modules'}) "
        "found to cut its stages at"
    )


def tp_rules(model: HFModel) -> list[tuple[str, str]]:
    """Tensor-parallel rules from the model's own plan (`config.base_model_tp_plan`), for `parallel.default_rules`.

    Args:
      model: a transformers causal LM.

    Returns:
      [(regex of full parameter names, "colwise" | "rowwise"), ..., (".*", "replicate")]: its
      attention and MLP projections split as transformers' plan says, every other parameter replicated.

    Raises:
      HFModelError: no plan (e.g. GPT-2), or a plan with other kinds than colwise and rowwise (e.g.
        Phi-3's fused projections), in one line.

    Example:
      >>> tp_rules(template)[0]
      ('^model\\.layers\\.\\d+\\.self_attn\\.q_proj\\.(weight|bias)$', 'colwise')
    """
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    kind = model.config.model_type
    if not plan:
        raise HFModelError(f"{kind} has no tensor-parallel plan in its transformers config; set mesh.tp=1")
    other = sorted({v for v in plan.values() if v not in ("colwise", "rowwise")})
    if other:
        raise HFModelError(
            f"{kind}'s tensor-parallel plan uses {', '.join(other)} (fused projections); only colwise "
            "and rowwise splits are supported: set mesh.tp=1"
        )
    prefix = re.escape(f"{model.base_model_prefix}.")
    layer = r"\d+"
    rules = [("^" + prefix + re.escape(k).replace(r"\*", layer) + r"\.(weight|bias)$", v) for k, v in plan.items()]
    return rules + [(r".*", "replicate")]


def refuse_axes(ctx: Any, model_type: str) -> None:
    """Refuses, in one line, a mesh axis this family cannot split (the sequence: the attention is transformers').

    Args:
      ctx: the parallel context (`cp_world` is read).
      model_type: the config's `model_type`, for the message.

    Raises:
      ConfigError: a context-parallel axis (`mesh.cp > 1`).

    Example:
      >>> refuse_axes(ctx, "qwen2")
    """
    if ctx.cp_world > 1:
        raise ConfigError(
            f"mesh.cp={ctx.cp_world}: the hf family ({model_type}) has no context parallelism yet; "
            "shard it with FSDP (--config.mesh.dp_shard) and set mesh.cp=1"
        )


def head_name(model: HFModel) -> str:
    """The output projection's weight: `lm_head.weight`, or the input embedding's when they are tied."""
    names = {id(p): n for n, p in model.named_parameters()}
    return names[id(model.get_output_embeddings().weight)]


def init_params(
    template: HFModel,
    key: torch.Tensor,
    *,
    device=None,
    dtype: torch.dtype = torch.float32,
    where: Callable | None = None,
    only: set[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Fresh parameters from `key`, as transformers' `from_config` makes them, one parameter at a time.

    Each parameter's writes recorded by `build_template` (its constructor's init, then every
    `_init_weights` that touches it, in order: GPT-2's depth-scaled `c_proj` overwrites the plain
    one) are replayed on a real CPU tensor under a seed drawn from (key, its name)
    (`torch.random.fork_rng`: the global generator is left as it was); a parameter never written
    keeps its built value. With `where` only this rank's block of each is kept, so no rank holds more
    than one parameter whole.

    Args:
      template: `build_template`'s model.
      key: an `rng` key.
      device: where the tensors go.
      dtype: their dtype.
      where: optional `where(name, shape) -> (offset, local_shape)` (this rank's block).
      only: optional names: just these parameters (each as in the whole init).

    Returns:
      {name: tensor} in `named_parameters()` order (a tied weight once).

    Example:
      >>> params = init_params(template, rng.key(0))
    """
    inits = _INITS[template]
    out = {}
    for name, p in template.named_parameters():
        if only is not None and name not in only:
            continue
        writes = inits[name]
        if isinstance(writes, torch.Tensor):
            t = writes.clone()
        else:
            t = torch.empty(p.shape, dtype=torch.float32)
            seed = rng.key_data(rng.fold_in(key, _name_hash(name)))
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(seed % (1 << 63))
                for w in writes:
                    offset, size, stride = w.view
                    w.func(t.as_strided(size, stride, offset), *w.args, **w.kwargs)
        if where is not None:
            offset, local = where(name, t.shape)
            t = t[tuple(slice(o, o + s) for o, s in zip(offset, local))]
        out[name] = t.to(device=device, dtype=dtype).contiguous()
    return out


def eval_logits(template: HFModel) -> Callable:
    """`(params, idx) -> (B, T, V)`: the transformers model's logits in eval mode.

    Example:
      >>> logits = eval_logits(template)(params, x)
    """
    return lambda p, idx: functional.apply(template, p, input_ids=idx, train=False).logits


def _name_hash(name: str) -> int:
    """A stable 31-bit number of a module's name (its seed's fold-in)."""
    import hashlib

    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") >> 1


class _Zero(nn.Module):
    """An embedding turned off in a block's view: adds nothing."""

    def forward(self, *args, **kwargs):
        return torch.zeros(())


def _has_params(module: nn.Module) -> bool:
    """Whether a module holds any parameter."""
    return any(True for _ in module.parameters())


def layer_view(base: HFModel, layers: str, norm_name: str, keep: list[int], side: bool, norm: bool) -> nn.Module:
    """A shallow copy of a base model that runs only some of its decoder layers (it shares their modules).

    Args:
      base: the base model (e.g. `LlamaModel`), whose forward runs the layers.
      layers: the name of its layer list in it (e.g. "layers").
      norm_name: the name of its final norm (`final_norm`).
      keep: the layers the view runs, in order.
      side: keep the embeddings (False: they add nothing).
      norm: keep the final norm (False: the identity).

    Returns:
      The view: the base model's own forward over those layers.

    Example:
      >>> first_two = layer_view(base, "layers", final_norm(base, "layers"), [0, 1], side=True, norm=True)
    """
    view = copy.copy(base)
    view._modules = dict(base._modules)
    layer_list = base.get_submodule(layers)
    view._modules[layers] = nn.ModuleList([layer_list[i] for i in keep])
    for name, child in base._modules.items():
        if name == layers or child is None or (not _has_params(child) and not isinstance(child, nn.Dropout)):
            continue  # (parameter-free children, the rotary tables among them, stay)
        if name == norm_name:
            view._modules[name] = child if norm else nn.Identity()
        elif not side:
            view._modules[name] = _Zero() if isinstance(child, nn.Embedding) else nn.Identity()
    return view


def final_norm(base: HFModel, layers: str) -> str:
    """The name of a base model's final norm: its last child with parameters whose class is a norm.

    Args:
      base: the base model (e.g. `LlamaModel`).
      layers: the name of its layer list (skipped).

    Returns:
      The child's name (e.g. "norm").

    Raises:
      StagingError: the base model has none (one line).

    Example:
      >>> final_norm(template.model, "layers")
      'norm'
    """
    norms = [
        n
        for n, m in base._modules.items()
        if n != layers and m is not None and _has_params(m) and "norm" in type(m).__name__.lower()
    ]
    if not norms:
        raise StagingError(f"{type(base).__name__}: no final norm with parameters beside {layers} to end its stages")
    return norms[-1]


def stages(model: HFModel, share: bool = True) -> LMStages:
    """The model's forward cut into stages at its decoder layers (see the module docstring).

    Args:
      model: `build_template`'s model.
      share: let layers alike share one function (`check_stages` says whether that is exact).

    Returns:
      `LMStages(embed, blocks, final)`: embed `(p, idx, key) -> h`, block `(p, h, key) -> h`, final
      `(p, h, key) -> hidden`, each reading only its own parameters (full names).

    Example:
      >>> st = stages(template)
      >>> h = st.embed.fn(st.embed.params(params), x, None)   # (B, T, C)
    """
    path, _, layers = decoder_layers(model).rpartition(".")  # e.g. "model", "layers"; "model.decoder", "layers"
    base = model.get_submodule(path)  # the module whose forward runs the layers
    n = len(base.get_submodule(layers))
    norm = final_norm(base, layers)
    names = [nm for nm, _ in model.named_parameters()]
    prefix = f"{path}."
    layer_prefix = f"{prefix}{layers}."
    embed_names = tuple(
        nm
        for nm in names
        if nm.startswith(prefix) and not nm.startswith(layer_prefix) and not nm.startswith(f"{prefix}{norm}.")
    )
    norm_names = tuple(nm for nm in names if nm.startswith(f"{prefix}{norm}."))
    head = head_name(model)
    other = [
        n
        for n, m in base._modules.items()
        if n not in (layers, norm) and m is not None and _has_params(m) and not isinstance(m, nn.Embedding)
    ]
    if other:  # (where they run, before the layers or after the norm, is not known from outside)
        raise StagingError(
            f"{type(model).__name__}: {path} holds {', '.join(other)} beside its embeddings, layers and "
            "final norm, which no stage can place"
        )
    left = [nm for nm in names if not nm.startswith(prefix) and nm != head]
    if left:
        raise StagingError(
            f"{type(model).__name__}: parameters outside {path} and the head ({', '.join(left[:3])}) belong to no stage"
        )

    def run(view, own, key, salt, **inputs):
        """The view's base forward on `own` (names under the base), its dropout keyed by (key, salt): its last
        hidden state. A stage's draws are its own, so a block recomputed in the backward draws the same masks."""
        with randomness.keyed(None if key is None else rng.fold_in(key, salt)):  # no key: evaluating, no dropout
            return functional.apply(view, own, train=None if key is not None else False, **inputs).last_hidden_state

    def under_base(p):
        """The params of the base model, named as in it."""
        return {nm[len(prefix) :]: t for nm, t in p.items() if nm.startswith(prefix)}

    embed_view = layer_view(base, layers, norm, [], side=True, norm=False)
    final_view = layer_view(base, layers, norm, [], side=False, norm=True)
    any_layer = layer_view(base, layers, norm, [0], side=False, norm=False)  # any layer, as layer 0 of a view

    def shared(own, h, key, index, packed=None):
        """Any decoder layer, when they are alike (the same parameters and attention kind), on `own` (its params
        without its prefix), at position `index`: one compiled graph for all (`compile_unit="blocks"`)."""
        return run(
            any_layer,
            {f"{layers}.0.{nm}": t for nm, t in own.items()},
            key,
            1 + index,
            inputs_embeds=h,
            **_positions(packed),
        )

    def signature(module: nn.Module):
        """A layer's parameter names, shapes and classes, and the attention kind it asks the base's masks for."""
        kinds = [
            (nm, getattr(m, "attention_type", None), getattr(m, "sliding_window", None), getattr(m, "is_sliding", None))
            for nm, m in module.named_modules()
        ]
        return [
            (nm, tuple(t.shape), type(module.get_submodule(nm.rpartition(".")[0])))
            for nm, t in module.named_parameters()
        ], kinds

    layer_list = base.get_submodule(layers)
    alike = share and n > 0 and all(signature(m) == signature(layer_list[0]) for m in layer_list)
    embed = Stage(
        embed_names,
        lambda p, idx, key, packed=None: run(embed_view, under_base(p), key, 0, input_ids=idx, **_positions(packed)),
    )
    blocks = []
    for i in range(n):
        own_prefix = f"{layer_prefix}{i}."
        block_names = tuple(nm for nm in names if nm.startswith(own_prefix))
        view = layer_view(base, layers, norm, [i], side=False, norm=False)

        def block(p, h, key, packed=None, view=view, own_prefix=own_prefix, i=i):
            """Layer i (its own module: its index, its attention kind) on `inputs_embeds=h` (packed rows: at their
            `position_ids`, from which transformers builds the documents' masks)."""
            own = {f"{layers}.0.{nm[len(own_prefix) :]}": t for nm, t in p.items() if nm.startswith(own_prefix)}
            return run(view, own, key, 1 + i, inputs_embeds=h, **_positions(packed))

        blocks.append(Stage(block_names, block, shared if alike else None, own_prefix, i))
    final = Stage(norm_names, lambda p, h, key: run(final_view, under_base(p), key, 1 + n, inputs_embeds=h))
    return LMStages(embed, blocks, final)


def _positions(packed) -> dict:
    """The base forward's `position_ids` of packed rows (`models.lm.Packed`), and its KV cache's inputs through a
    cache (`cache.CacheInputs`: a padding mask, the cache), or nothing."""
    if packed is None:
        return {}
    return {"position_ids": packed.positions, **getattr(packed, "inputs", {})}
