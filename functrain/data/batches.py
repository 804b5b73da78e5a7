"""Stateless batch sampling: a batch is a pure function of (tokens, seed, step, rank, world).

Internals: docs/internals.md "functrain.data.batches".

Example:
    >>> x, y = get_batch(ds.train, Batching(batch_size=32, block_size=256, seed=0), step=state_step)
    >>> x.shape, y.shape        # (32, 256) int64; y[:, :-1] == x[:, 1:]
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from functrain.data.errors import DataError
from functrain.data.placement import Batching
from functrain.data.tokens import ConcatTokens

__all__ = ["get_batch", "eval_batches"]

TRAIN_STREAM, EVAL_STREAM = 0, 1
_U64 = (1 << 64) - 1


def window_starts(n_tokens: int, batch_size: int, block_size: int, stream: int, seed: int, step: int) -> np.ndarray:
    """Start offsets of the global batch's windows, a pure function of the arguments."""
    if n_tokens < block_size + 1:
        raise DataError(
            f"token array has {n_tokens} tokens, fewer than block_size + 1 = {block_size + 1}; "
            "use more data or a smaller block_size"
        )
    gen = np.random.default_rng([stream, int(seed) & _U64, int(step) & _U64])
    return gen.integers(0, n_tokens - block_size, size=batch_size)  # start + block_size + 1 <= n


def window_rows(tokens, starts, block_size, rank, world, device):
    """This rank's rows of the global windows as (x, y) int64 tensors of shape (B_local, T)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
    if len(starts) % world:
        raise ValueError(f"batch_size {len(starts)} must be divisible by the data-parallel world size {world}")
    b = len(starts) // world
    local = starts[rank * b : (rank + 1) * b]
    windows = np.stack([np.asarray(tokens[s : s + block_size + 1]) for s in local])  # (B_local, T+1)
    return inputs_targets(windows.astype(np.int64), device)


def inputs_targets(windows: np.ndarray, device):
    """(x, y) of int64 windows (B, T + 1): x = all but the last token, y = all but the first, on
    `device` (from pinned memory with non-blocking copies off the CPU)."""
    xy = torch.from_numpy(windows)
    x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()  # (B, T) each
    if device is not None and torch.device(device).type != "cpu":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y


def get_batch(
    tokens: np.ndarray | ConcatTokens,
    batching: Batching,
    step: int,
    *,
    rank: int = 0,
    world: int = 1,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the training batch of step `step`: inputs and next-token targets.

    Args:
      tokens: a 1-D token array (e.g. `Dataset.train`, a memmap: only the windows are read).
      batching: the GLOBAL batch size (divisible by `world`), the window length T and the data seed.
      step: the training step (an int or a 0-d tensor).
      rank: this data-parallel rank.
      world: number of data-parallel ranks.
      device: where to put the tensors (default CPU).

    Returns:
      (x, y), int64 tensors of shape (batch_size // world, block_size) with y = x shifted left by
      one token (y[:, t] is the token after x[:, t]).

    Example:
      >>> x, y = get_batch(ds.train, Batching(batch_size=8, block_size=64), step=10, rank=1, world=2)
      >>> x.shape
      torch.Size([4, 64])
    """
    starts = window_starts(len(tokens), batching.batch_size, batching.block_size, TRAIN_STREAM, batching.seed, step)
    return window_rows(tokens, starts, batching.block_size, rank, world, device)


def eval_batches(
    tokens: np.ndarray | ConcatTokens,
    batching: Batching,
    *,
    seed: int = 0,
    rank: int = 0,
    world: int = 1,
    device: torch.device | str | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of evaluation batches: the same windows on every call (and any world size).

    Drawn like `get_batch` but from a separate random stream, so they never coincide with the
    training batches of the same seed.

    Args:
      tokens: a 1-D token array (e.g. `Dataset.val`).
      batching: the GLOBAL batch size (divisible by `world`), the window length T and how many
        batches to yield (`eval_batches`); its training seed is not read.
      seed: fixes the set of windows (0 by default whatever the training seed, so validation losses
        of runs with different seeds compare).
      rank: this data-parallel rank.
      world: number of data-parallel ranks.
      device: where to put the tensors.

    Returns:
      An iterator of (x, y) int64 tensors of shape (batch_size // world, block_size).

    Example:
      >>> losses = [eval_step(params, x, y)
      ...           for x, y in eval_batches(ds.val, Batching(batch_size=8, block_size=64, eval_batches=20))]
    """
    for i in range(batching.eval_batches):
        starts = window_starts(len(tokens), batching.batch_size, batching.block_size, EVAL_STREAM, seed, i)
        yield window_rows(tokens, starts, batching.block_size, rank, world, device)
