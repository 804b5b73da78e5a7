"""The hf family's decoding through a KV cache: transformers' own attention code writes into a
`generation.KVCache`, through a `transformers.Cache` of static layers that write at the forward's slots.

The model builds its own masks (causal, sliding window, soft-capping untouched) from the cache's full length,
a 2-D padding mask and the slots' offset, so every type whose attention updates a `Cache` decodes as
transformers decodes it. A probe decides at build time: a type whose cached forward differs from its plain one
(or cannot run) is refused in one line, and the caller recomputes. Internals: docs/internals.md
"functrain.models.hf.cache".

Example:
    >>> gen = generation.Generator(cached_model(template), batch_size=8)
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functrain import functional, parallel, rng
from functrain.generation import CachedModel
from functrain.generation.kv_cache import KVCache, cached
from functrain.models.hf.model import HFModel, HFModelError, decoder_layers, head_name, init_params
from functrain.models.hf.model import stages as hf_stages
from functrain.models.hf.probe import PROBE_RTOL, probe_subject, relative_error
from functrain.models.inference import staged_forward
from functrain.models.stages import LMStages

__all__ = ["CacheInputs", "cached_model", "run_cache"]


def run_cache(ctx: Any, template: HFModel, base: HFModel, stages: LMStages | None, tp_model: HFModel | None):
    """A run's `cached_model` of `template`, or None with one note line where its probe refuses the type (the run
    then generates by recomputing: never silently).

    Args:
      ctx: the parallel context (`tp_world`; the main process prints the note).
      template: the run's template (with its adapters); base: the plain model it was made from (the probe's).
      stages: `template`'s stages where the loss is staged (sharded params decode a stage at a time), else None.
      tp_model: its tensor-parallel copy on a tp axis (each rank decodes its own heads), else None.

    Returns:
      The `CachedModel`, or None.

    Example:
      >>> cached = run_cache(ctx, template, base, hf.stages(template), None)
    """
    head = head_name(template)
    try:
        return cached_model(template, probe=base, stages=stages, head=head, tp_model=tp_model, tp_size=ctx.tp_world)
    except HFModelError as exc:
        if ctx.is_main_process:
            print(f"functrain: note: {exc}; it generates without a KV cache", file=sys.stderr, flush=True)
        return None


def cached_model(
    model: HFModel,
    *,
    probe: HFModel | None = None,
    stages: LMStages | None = None,
    head: str | None = None,
    tp_model: HFModel | None = None,
    tp_size: int = 1,
) -> CachedModel:
    """`model` (a transformers causal LM) as a `generation.CachedModel`, once a probe shows its cache is exact.

    The probe runs `probe` (default `model`; a LoRA-wrapped model's base) on params from `init_params` on the
    CPU, in eval mode: a batch of 2 prompts (one left-padded) prefilled, then decoded a token at a time through
    the cache, each step's hidden states against the plain forward of the same tokens; on the whole base model,
    or its first two layers when it has over 2**26 parameters (`probe.probe_subject`).

    Args:
      model: `build_template`'s model (or its LoRA-wrapped copy).
      probe: the plain model `model` was made from.
      stages: `model`'s stages (`hf.stages`), to decode from sharded params a stage at a time; None: from plain
        params only.
      head: the output projection's weight name, with `stages`.
      tp_model: its tensor-parallel copy (`parallel.tensor_parallel` with `tp_rules`, with its buffers) on a tp
        axis of `tp_size` > 1: sharded params then decode on each rank's own heads through the copy's stages (or
        its whole forward, without `stages`), gathered over the data-parallel axes only, the cache holding the
        rank's kv heads.
      tp_size: the tp axis' size, with `tp_model`.

    Returns:
      The `CachedModel`: `forward(params, idx, view)` is the model's own forward with a `transformers.Cache` over
      the view's `KVCache`; its block is the config's `max_position_embeddings` (or `n_positions`); with `stages`,
      its `sharded_forward` runs them on that cache, each gathered just before it runs (with `tp_model`: its own).

    Raises:
      HFModelError: the model's attention does not go through a `Cache` of one key/value shape per layer, or its
        cached forward differs from the plain one on the probe (one line).

    Example:
      >>> cached = cached_model(template)
      >>> [[done]] = Generator(cached, batch_size=1)(params, [[1, 2, 3]], 16)
    """
    probe = model if probe is None else probe
    config = probe.config.get_text_config(decoder=True)
    try:
        shape = _check(probe)
    except HFModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model's own code cannot run through a cache
        line = str(exc).splitlines()[0] if str(exc) else ""
        raise HFModelError(
            f"{config.model_type}: its forward cannot run through a KV cache ({type(exc).__name__}: {line})"
        ) from None
    layers = int(config.num_hidden_layers)
    block = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not block:
        raise HFModelError(f"{config.model_type}: its config names no longest sequence (max_position_embeddings)")
    out = CachedModel(_forward(model, layers, logits=True), (layers, *shape), int(block))
    if tp_model is not None:  # each rank its own heads, and its own kv heads in its cache
        heads = shape[0] // tp_size
        return out._replace(sharded_forward=_on_heads(tp_model, layers, stages, head), sharded_kv_heads=heads)
    if stages is None or head is None:
        return out
    staged, slot_layer = staged_forward(stages, head), _slot_layer()
    return out._replace(sharded_forward=lambda p, idx, view: staged(p, idx, CacheInputs.of(view, layers, slot_layer)))


def _on_heads(tp_model: HFModel, layers: int, stages: LMStages | None, head: str | None) -> Callable:
    """The sharded forward of the tensor-parallel copy `tp_model`: its stages (where the model has `stages`) or its
    whole forward, on params gathered over the data-parallel axes only (`Layout.gather`: this rank's heads)."""
    slot_layer = _slot_layer()
    if stages is None or head is None:
        whole = _forward(tp_model, layers, logits=True)
        return lambda p, idx, view: whole(parallel.layout_of(p).gather(p), idx, view)
    staged = staged_forward(hf_stages(tp_model), head, tp=True)
    return lambda p, idx, view: staged(p, idx, CacheInputs.of(view, layers, slot_layer))


class CacheInputs(NamedTuple):
    """What the hf stages hand the base model's forward through a cache, where packed rows hand it positions.

    Attributes:
      positions: int64 (B, T): the new tokens' positions.
      inputs: the forward's other keyword arguments: the 2-D padding mask, the `transformers.Cache`.
    """

    positions: torch.Tensor
    inputs: dict

    @classmethod
    def of(cls, view, layers: int, slot_layer: type) -> CacheInputs:
        """The inputs of a `kv_cache.Cached` view over `layers` layers (`slot_layer`: `_slot_layer()`)."""
        from transformers.cache_utils import Cache

        kv = view.cache
        cache = Cache(layers=[slot_layer(kv.keys[i], kv.values[i], view.slots) for i in range(layers)])
        mask = view.mask[:, 0, -1]  # (B, L): the slots the last new token sees (the padding cut)
        return cls(view.positions, {"attention_mask": mask, "cache": cache, "use_cache": True})

    def layer(self, i: int) -> CacheInputs:
        """Every layer's (the cache holds them all: a layer writes at its own index)."""
        return self


@functools.cache
def _slot_layer() -> type:
    """The transformers `StaticLayer` that writes at a view's slots (made on first use: transformers is optional)."""
    from transformers.cache_utils import StaticLayer

    class SlotLayer(StaticLayer):
        """One layer's `KVCache` tensors: new keys and values written at `slots`; the whole cache read."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor):
            super().__init__(max_cache_len=keys.shape[2])
            self.keys, self.values, self.slots, self.device = keys, values, slots, keys.device
            self.kv = (keys, values)  # (typed: transformers' attributes may be None)
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states) -> None:
            raise AssertionError("a slot layer is made initialized")

        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = self.kv
            keys.index_copy_(2, self.slots, key_states.to(keys.dtype))
            values.index_copy_(2, self.slots, value_states.to(values.dtype))
            return keys, values

        def get_seq_length(self):
            return self.slots[0]  # the first new token's slot: the query offset of the model's masks

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.max_cache_len, 0  # every slot (the model's masks cut the window and the padding)

    return SlotLayer


def _forward(module: HFModel, layers: int, *, logits: bool):
    """`forward(params, idx, view)` of `module` through the view's cache: its logits, or its last hidden states."""
    slot_layer = _slot_layer()  # (made here, eagerly: the forward is compiled)

    def forward(params: dict[str, torch.Tensor], idx: torch.Tensor, view) -> torch.Tensor:
        given = CacheInputs.of(view, layers, slot_layer)
        out = functional.apply(module, params, input_ids=idx, position_ids=given.positions, train=False, **given.inputs)
        return out.logits if logits else out.last_hidden_state

    return forward


def _check(model: HFModel) -> tuple[int, int]:
    """(kv heads, head dim) of every layer's cache, once the probe's cached outputs equal the plain forward's."""
    subject, p, layers = _probe_subject(model)
    device = next(iter(p.values())).device
    x = torch.randint(1, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        heads, dim = _shape(subject, p, x, model.config.model_type)
        cache = KVCache.empty(layers=layers, batch=2, kv_heads=heads, length=8, head_dim=dim, device=device)
        pads = torch.tensor([3, 0], device=device)  # row 0 left-padded by 3
        forward, got = _forward(subject, layers, logits=False), []
        for lo, hi in ((0, 5), (5, 6), (6, 7), (7, 8)):  # a prefill of 5 slots, then a token at a time
            slots = torch.arange(lo, hi, device=device)
            got.append(forward(p, x[:, lo:hi], cached(cache, pads, slots))[:, -1])  # (2, C)
        for b in range(2):
            for out, end in zip(got, (5, 6, 7, 8)):
                plain = functional.apply(subject, p, input_ids=x[b : b + 1, int(pads[b]) : end], train=False)
                off = relative_error(out[b], plain.last_hidden_state[0, -1])
                if not off <= PROBE_RTOL:
                    raise HFModelError(
                        f"{model.config.model_type}: its forward through a KV cache differs from its plain forward "
                        f"by {off:.2g} (relative, on a probe batch)"
                    )
    return heads, dim


def _probe_subject(model: HFModel) -> tuple[HFModel, dict[str, torch.Tensor], int]:
    """(`probe_subject(model)`'s module, its params from `init_params`, the decoder layers it runs)."""
    subject, path, keep = probe_subject(model)
    names = {n for n, _ in model.named_parameters() if n.startswith(f"{path}.")}
    if keep is not None:
        layers = decoder_layers(model)[len(path) + 1 :]
        names -= {n for n in names if _in_layers(n, f"{path}.{layers}.", keep)}
    device = next((b.device for b in model.buffers()), torch.device("cpu"))
    p = init_params(model, rng.key(0), device=device, only=names)
    count = int(model.config.get_text_config(decoder=True).num_hidden_layers) if keep is None else len(keep)
    return subject, {n[len(path) + 1 :]: t for n, t in p.items()}, count


def _in_layers(name: str, prefix: str, keep: list[int]) -> bool:
    """Whether `name` is a parameter of a decoder layer outside `keep`."""
    return name.startswith(prefix) and int(name[len(prefix) :].split(".")[0]) not in keep


def _shape(subject: HFModel, p: dict, x: torch.Tensor, model_type: str) -> tuple[int, int]:
    """The (kv heads, head dim) every layer caches, read from a dynamic cache after a forward of `x`."""
    from transformers import DynamicCache

    cache = DynamicCache(config=subject.config)
    functional.apply(subject, p, input_ids=x, cache=cache, use_cache=True, train=False)
    layers: list[Any] = list(cache.layers)
    if not layers:
        raise HFModelError(f"{model_type}: its forward keeps no keys and values in a transformers Cache")
    if any(getattr(layer, "keys", None) is None for layer in layers):
        raise HFModelError(f"{model_type}: its layers keep a recurrent state, not only keys and values")
    shapes = {(*layer.keys.shape[1:2], *layer.keys.shape[3:], *layer.values.shape[3:]) for layer in layers}
    if len(shapes) != 1:
        raise HFModelError(f"{model_type}: its layers cache keys and values of shapes {sorted(shapes)}, not one")
    [(heads, k_dim, v_dim)] = shapes
    if k_dim != v_dim:
        raise HFModelError(f"{model_type}: its keys ({k_dim}) and values ({v_dim}) differ in head dim")
    return int(heads), int(k_dim)
