"""A decoder's keys and values kept between forwards: a batch of prompts prefilled once, then a token at a time.

The cache is state: `KVCache` is a pytree of preallocated tensors, (B, kv heads, L, head dim) per layer. A
forward reads it through `Cached`, which stands where training passes `lm.Packed` (the rows' positions and
attention mask): each attention layer writes its new keys and values at `slots` and attends over the whole
cache under `mask`. Prompts are left-padded, so every row writes the same slots and the decode step's shapes
never change from token to token (`slots` is a tensor). Internals: docs/internals.md "functrain.generation.kv_cache".

Example:
    >>> cache = KVCache.empty(layers=2, batch=8, kv_heads=4, length=256, head_dim=16)
    >>> view = cached(cache, pads, torch.arange(32))          # the prefill of 32 left-padded tokens
    >>> logits = model(idx, packed=view)                       # (B, 32, V); the cache now holds them
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Cached", "KVCache", "LayerCache", "cached"]


class KVCache(NamedTuple):
    """Every layer's keys and values: `keys[i]`, `values[i]` of shape (B, kv heads, L, head dim).

    Example:
      >>> cache = KVCache.empty(layers=2, batch=1, kv_heads=2, length=64, head_dim=8)
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def empty(  # noqa: PLR0913 (the cache's shape, dtype and device)
        cls,
        *,
        layers: int,
        batch: int,
        kv_heads: int,
        length: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """A zero cache of `length` slots per row (zeros: a masked slot never holds a NaN).

        Example:
          >>> KVCache.empty(layers=2, batch=1, kv_heads=2, length=64, head_dim=8).keys[0].shape
          torch.Size([1, 2, 64, 8])
        """
        shape = (batch, kv_heads, length, head_dim)
        new = lambda: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        return cls([new() for _ in range(layers)], [new() for _ in range(layers)])

    @property
    def length(self) -> int:
        """The slots per row (L)."""
        return self.keys[0].shape[2]


class LayerCache(NamedTuple):
    """One layer's view of a `Cached` forward: what its attention reads in place of `lm.Packed`.

    Attributes:
      positions: int64 (B, T): each new token's position in its own sequence (its slot minus the row's padding).
      mask: bool (B, 1, T, L): new token t may attend to slot j.
      slots: int64 (T,): the slots the new tokens are written at (the same for every row).
      keys, values: this layer's cache (B, kv heads, L, head dim), written in place.
    """

    positions: torch.Tensor
    mask: torch.Tensor
    slots: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor

    def keys_values(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new keys and values (B, kv heads, T, D) written at `slots`; the whole cache (B, kv heads, L, D)."""
        self.keys.index_copy_(2, self.slots, k.to(self.keys.dtype))
        self.values.index_copy_(2, self.slots, v.to(self.values.dtype))
        return self.keys, self.values


class Cached(NamedTuple):
    """A forward through a `KVCache`: the rows' positions and mask, and every layer's cache (`layer(i)`)."""

    positions: torch.Tensor
    mask: torch.Tensor
    slots: torch.Tensor
    cache: KVCache

    def layer(self, i: int) -> LayerCache:
        """Layer `i`'s view."""
        return LayerCache(self.positions, self.mask, self.slots, self.cache.keys[i], self.cache.values[i])


def cached(cache: KVCache, pads: torch.Tensor, slots: torch.Tensor) -> Cached:
    """The view of a forward whose T new tokens go to `slots` of rows left-padded by `pads`.

    Slot j of row b holds a token when `pads[b] <= j`; token t (at slot s = slots[t]) attends to the row's
    tokens up to s, and a padding slot to itself alone (so no row of the softmax is empty).

    Args:
      cache: the `KVCache`.
      pads: int64 (B,): each row's left padding (its prompt starts at slot pads[b]).
      slots: int64 (T,): the slots of the new tokens, ascending (a prefill: 0..P-1; a decode step: one).

    Returns:
      The `Cached` view (positions (B, T), mask (B, 1, T, L)).

    Example:
      >>> view = cached(cache, torch.tensor([2, 0]), torch.tensor([5]))   # the token at slot 5 of both rows
    """
    j = torch.arange(cache.length, device=slots.device)  # (L,)
    before = j[None, None, :] <= slots[None, :, None]  # (1, T, L): causal
    own = (j[None, None, :] >= pads[:, None, None]) | (j[None, None, :] == slots[None, :, None])  # (B, T, L)
    positions = (slots[None, :] - pads[:, None]).clamp(min=0)  # (B, T)
    return Cached(positions, (before & own)[:, None], slots, cache)  # mask (B, 1, T, L)
