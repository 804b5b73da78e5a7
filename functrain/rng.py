"""Explicit, counter-based random keys that live in the training state.

Internals: docs/internals.md "functrain.rng".

Example:
    >>> k = rng.key(0)
    >>> k_step = rng.fold_in(k, state.step)      # one key per step
    >>> k_drop, k_other = rng.split(k_step)      # independent streams
    >>> y = rng.dropout(x, 0.1, k_drop)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["key", "fold_in", "split", "uniform", "gaussian", "bernoulli", "dropout", "key_data", "normal"]

_MASK = 0xFFFFFFFF
# Odd multipliers below 2**31 keep every product of a 32-bit word below 2**63 (no int64 overflow).
_M1, _M2, _M3 = 0x7FEB352D, 0x5BD1E995, 0x2C1B3C6D
_GOLDEN = 0x1E3779B9


def _mix(x: Any) -> Any:
    """32-bit avalanche mix of int64 values holding 32-bit words."""
    x = x & _MASK
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK
    x = x ^ (x >> 16)
    x = (x * _M3) & _MASK
    return x ^ (x >> 15)


def key(seed: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Makes a root key from an integer seed.

    Args:
      seed: any Python int (only its low 64 bits matter).
      device: where the key tensor lives (default: CPU).

    Returns:
      An int64 tensor of shape (2,) with two 32-bit words.

    Example:
      >>> rng.key(0)
      tensor([..., ...])
    """
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    hi, lo = seed >> 32, seed & _MASK
    k0 = _mix(lo ^ _mix(hi + _GOLDEN))
    k1 = _mix(hi ^ _mix(k0 + 2 * _GOLDEN))
    return torch.tensor([k0, k1], dtype=torch.int64, device=device)


def fold_in(key: torch.Tensor, data: torch.Tensor | int) -> torch.Tensor:
    """Derives a new key from `key` and an integer (e.g. the step counter); pure and traceable.

    Args:
      key: an int64 key of shape (2,).
      data: a Python int or an integer tensor scalar (such as `state.step`); only its low 32 bits
        count.

    Returns:
      A new key of shape (2,); different `data` give statistically independent keys.

    Example:
      >>> k_step = rng.fold_in(state.rng, state.step)
    """
    if not isinstance(data, torch.Tensor):
        data = torch.tensor(int(data) & _MASK, dtype=torch.int64, device=key.device)
    return _fold_in_op(key, data.to(torch.int64))


def split(key: torch.Tensor, num: int = 2) -> torch.Tensor:
    """Splits a key into `num` independent keys.

    Args:
      key: an int64 key of shape (2,).
      num: how many keys to make.

    Returns:
      An int64 tensor of shape (num, 2); unpack it as `k1, k2 = rng.split(k)`.

    Example:
      >>> k_dropout, k_noise = rng.split(k)
    """
    return _split_op(key, int(num))


# Key derivation is one opaque op per call in a compiled graph. Written as plain int64 ops, each
# `_mix` is 14 elementwise ops whose input is read twice (`x ^ (x >> 16)`); inductor inlines such
# chains into every consumer and re-traces them per read, so compile time grows with the chain's
# depth (minutes for a few draws: docs/results.md). As ops they compile in milliseconds and run once
# per call (a few microseconds on tensors of 2 words).
@torch.library.custom_op("functrain::fold_in", mutates_args=())
def _fold_in_op(key: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """Keys (..., 2) folded with int64 data broadcastable to (...,): the words of `fold_in`."""
    k0, k1 = key[..., 0], key[..., 1]
    d = _mix(data)
    n0 = _mix(k0 ^ _mix(d + k1))
    n1 = _mix(k1 ^ _mix(n0 + d + _GOLDEN))
    return torch.stack([n0, n1], dim=-1)


@_fold_in_op.register_fake
def _(key: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    return key.new_empty(torch.broadcast_shapes(key.shape[:-1], data.shape) + (2,))


def _fold_in_vmap(info: Any, in_dims: tuple, key: torch.Tensor, data: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Batched keys and/or data: batch dims moved first, the op broadcasts over them."""
    key_dim, data_dim = in_dims
    key = key if key_dim is None else key.movedim(key_dim, 0)
    data = data if data_dim is None else data.movedim(data_dim, 0).reshape(-1, *[1] * (key.dim() - 2))
    if key_dim is None:  # data (K, ...) against one key
        key = key.expand(info.batch_size, *key.shape)
    return _fold_in_op(key, data), 0


_fold_in_op.register_vmap(_fold_in_vmap)


@torch.library.custom_op("functrain::split", mutates_args=())
def _split_op(key: torch.Tensor, num: int) -> torch.Tensor:
    """Keys (..., 2) -> (..., num, 2): the words of `split`."""
    counter = torch.arange(num, dtype=torch.int64, device=key.device)  # (num,)
    n0, n1 = _split_words(key[..., 0, None], key[..., 1, None], counter)  # (..., num) each
    return torch.stack([n0, n1], dim=-1)


@_split_op.register_fake
def _(key: torch.Tensor, num: int) -> torch.Tensor:
    return key.new_empty(*key.shape[:-1], num, 2)


def _split_vmap(info: Any, in_dims: tuple, key: torch.Tensor, num: int) -> tuple[torch.Tensor, int]:
    """A batch of keys: split each (the op broadcasts over leading dims)."""
    return _split_op(key.movedim(in_dims[0], 0), num), 0


_split_op.register_vmap(_split_vmap)


def _split_words(k0: Any, k1: Any, counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two words of the keys `split` derives from key (k0, k1) for each counter value."""
    c = _mix(counter * 2 + 1)
    n0 = _mix(k0 ^ _mix(c + k1))
    n1 = _mix(k1 ^ _mix(n0 + c + 3 * _GOLDEN))
    return n0, n1


def key_data(key: torch.Tensor) -> int:
    """The 64-bit integer a key stands for (eager only: it reads the tensor).

    Args:
      key: an int64 key of shape (2,).

    Returns:
      A Python int in [0, 2**64): the high word, then the low word.

    Example:
      >>> print(hex(rng.key_data(state.rng)))   # log which stream a run is on
    """
    k0, k1 = (int(v) for v in key.tolist())
    return ((k0 & _MASK) << 32) | (k1 & _MASK)


def _seed_of_words(k0: Any, k1: Any) -> Any:
    """A generator seed of the key words (k0, k1) (ints or int64 tensors of 32-bit words) that depends on both
    words even where a generator keeps only 32 seed bits: torch's CPU generator (mt19937) uses only the low 32
    bits of its seed, so both words are mixed into the low word (CUDA's Philox keeps all 64 bits)."""
    return (k0 << 32) | _mix(k1 ^ _mix(k0 + _GOLDEN))


def _draws(key: torch.Tensor, shape: list[int], dtype: torch.dtype, draw: Callable) -> torch.Tensor:
    """`draw(shape)` for each key of `key` (..., 2), by one generator seeded from each in turn: (..., *shape)."""
    keys = key.reshape(-1, 2).cpu() & _MASK  # (K, 2)
    seeds = _seed_of_words(keys[:, 0], keys[:, 1]).tolist()
    out = torch.empty(len(seeds), *shape, dtype=dtype, device=key.device)  # (K, *shape)
    gen = torch.Generator(device=key.device)
    for i, seed in enumerate(seeds):
        gen.manual_seed(seed)
        draw(shape, generator=gen, dtype=dtype, out=out[i])
    return out.reshape([*key.shape[:-1], *shape])


@torch.library.custom_op("functrain::uniform", mutates_args=())
def _uniform_op(key: torch.Tensor, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Uniform [0, 1) numbers (..., *shape) drawn for each key (..., 2) by a generator seeded from it (opaque to
    the compiler)."""
    return _draws(key, shape, dtype, torch.rand)


@torch.library.custom_op("functrain::gaussian", mutates_args=())
def _gaussian_op(key: torch.Tensor, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Standard-normal numbers (..., *shape) drawn for each key (..., 2) by a generator seeded from it (opaque to
    the compiler)."""
    return _draws(key, shape, dtype, torch.randn)


def _fake_draw(key: torch.Tensor, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return key.new_empty([*key.shape[:-1], *shape], dtype=dtype)


def _draw_vmap(op: Callable) -> Callable:
    """A vmap rule for a draw op: a batch of keys (a population's members, a batch's rows) draws once per key, in
    one call of the op."""

    def rule(info: Any, in_dims: tuple, key: torch.Tensor, shape: list[int], dtype: torch.dtype) -> tuple:
        if in_dims[0] is None:
            return op(key, shape, dtype), None
        return op(key.movedim(in_dims[0], 0), shape, dtype), 0

    return rule


for _op in (_uniform_op, _gaussian_op):
    _op.register_fake(_fake_draw)
    _op.register_vmap(_draw_vmap(_op))


def uniform(key: torch.Tensor, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Draws uniform [0, 1) numbers that depend only on `key` (same key, same numbers).

    Args:
      key: an int64 key of shape (2,); the result lives on its device. A batch of keys (..., 2), given or made by
        `torch.func.vmap`, draws each key's numbers in one call: (..., *shape).
      shape: the output shape.
      dtype: a floating dtype.

    Returns:
      A tensor of `shape`. Works inside `torch.compile(fullgraph=True)` as a single opaque op.

    Example:
      >>> u = rng.uniform(rng.key(0), (4, 8))
    """
    return _uniform_op(key, [int(s) for s in shape], dtype)


def gaussian(key: torch.Tensor, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Draws standard-normal numbers that depend only on `key`, inside a step (traceable).

    The step-time counterpart of `normal` (which draws parameters row by row, eagerly, so a shard
    can be drawn alone): one opaque op, compiled or not, e.g. for DP-SGD's noise.

    Args:
      key: an int64 key of shape (2,); the result lives on its device (a batch of keys (..., 2): each key's
        numbers, (..., *shape), as `uniform`).
      shape: the output shape.
      dtype: a floating dtype.

    Returns:
      A tensor of `shape`.

    Example:
      >>> noise = sigma * rng.gaussian(rng.fold_in(state.rng, state.step), g.shape)
    """
    return _gaussian_op(key, [int(s) for s in shape], dtype)


def _row_seeds(key: torch.Tensor, start: int, stop: int) -> list[int]:
    """Generator seeds for rows start..stop-1: the `_seed_of_words` of `split`'s keys for those counters."""
    k0, k1 = (int(v) & _MASK for v in key.tolist())
    n0, n1 = _split_words(k0, k1, torch.arange(start, stop, dtype=torch.int64))
    return _seed_of_words(n0, n1).tolist()


def normal(
    key: torch.Tensor,
    shape: Sequence[int],
    *,
    offset: Sequence[int] | None = None,
    local_shape: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Standard-normal numbers drawn row by row from `key`: any block can be drawn alone.

    Row `i` (along dim 0; a 0-d or 1-d tensor is one row) is drawn by a CPU generator seeded from
    (key, i), so the block at `offset` of size `local_shape` equals that block of the whole tensor,
    bit for bit, on any device and process: a rank draws only its rows of a parameter
    (`functrain.parallel.init_sharded`) and still gets what a single process draws. A block narrower
    than a row draws its rows whole and keeps its columns. Eager only (it reads the key).

    Args:
      key: an int64 key of shape (2,).
      shape: the shape of the whole (global) tensor.
      offset: where the block starts in each dim (default: zeros).
      local_shape: the block's shape (default: `shape`).
      dtype: floating dtype of the result.
      device: where to put it (default CPU).

    Returns:
      A tensor of `local_shape`.

    Example:
      >>> w = rng.normal(k, (1024, 512))
      >>> torch.equal(rng.normal(k, (1024, 512), offset=(512, 0), local_shape=(512, 512)), w[512:])
      True
    """
    shape = [int(s) for s in shape]
    local_shape = shape if local_shape is None else [int(s) for s in local_shape]
    offset = [0] * len(shape) if offset is None else [int(o) for o in offset]
    if len(shape) <= 1:  # one row
        row = normal(key, [1, *shape], offset=[0, *offset], local_shape=[1, *local_shape], dtype=dtype, device=device)
        return row.reshape(local_shape)
    width = math.prod(shape[1:])
    out = torch.empty([local_shape[0], width], dtype=torch.float32)  # (rows, row numel)
    gen = torch.Generator(device="cpu")
    for i, seed in enumerate(_row_seeds(key, offset[0], offset[0] + local_shape[0])):
        gen.manual_seed(seed)
        torch.randn(width, generator=gen, out=out[i])
    out = out.view(local_shape[:1] + shape[1:])
    for d in range(1, len(shape)):  # the block's columns
        if (offset[d], local_shape[d]) != (0, shape[d]):
            out = out.narrow(d, offset[d], local_shape[d])
    return out.contiguous().to(device=device, dtype=dtype)


def bernoulli(key: torch.Tensor, p: float, shape: Sequence[int]) -> torch.Tensor:
    """Boolean mask that is True with probability `p`, a pure function of `key`.

    Args:
      key: an int64 key of shape (2,).
      p: probability of True.
      shape: the mask shape.

    Returns:
      A bool tensor of `shape`.

    Example:
      >>> keep = rng.bernoulli(k, 0.9, x.shape)
    """
    return uniform(key, shape) < p


def dropout(x: torch.Tensor, p: float, key: torch.Tensor | None) -> torch.Tensor:
    """Inverted dropout with an explicit key; identity when `p == 0` or `key is None` (eval).

    Args:
      x: activations.
      p: drop probability, a Python float fixed for the model.
      key: an int64 key of shape (2,), or None to disable dropout.

    Returns:
      `x` with a fraction `p` of entries zeroed and the rest scaled by 1 / (1 - p).

    Example:
      >>> h = rng.dropout(h, 0.1, rng.fold_in(k, layer_index))
    """
    if key is None or p == 0.0:
        return x
    keep = bernoulli(key, 1.0 - p, x.shape)
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))
