"""The three values every data loader takes: where this process stands (`Placement`), how its sources
are read (`TextOptions`) and how its batches are cut (`Batching`).

Example:
    >>> place = Placement("runs/x/data", dp_rank=1, dp_world=2)
    >>> ds = load_dataset("stdlib", place, TextOptions(val_fraction=0.1))
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from functrain.data.token_files import DEFAULT_VAL_FRACTION

__all__ = ["Batching", "Placement", "TextOptions"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where this process's data is made and where its batches go.

    Attributes:
      cache_dir: where sources are tokenized and examples rendered to (created if needed).
      rank: this process's rank among the `world` processes that share the tokenizing (each calls the loader).
      world: the number of those processes.
      dp_rank: this process's data-parallel rank (which rows of a batch it takes).
      dp_world: the number of data-parallel ranks.
      device: where batches go (None: the CPU).
      log: where progress lines go (a no-op on ranks that should not print).

    Example:
      >>> Placement("/tmp/data", log=lambda line: None)
    """

    cache_dir: str | os.PathLike
    rank: int = 0
    world: int = 1
    dp_rank: int = 0
    dp_world: int = 1
    device: Any = None
    log: Callable[[str], None] = print

    @classmethod
    def of(cls, ctx: Any, cache_dir: str | os.PathLike) -> Placement:
        """This process's placement in a `functrain.parallel.ParallelContext`; only the main process prints.

        Args:
          ctx: the parallel context (rank, world_size, dp_rank, dp_world, device, is_main_process).
          cache_dir: the run's data cache.

        Returns:
          A `Placement`.

        Example:
          >>> place = Placement.of(ctx, "runs/x/data")
        """
        return cls(
            cache_dir,
            rank=ctx.rank,
            world=ctx.world_size,
            dp_rank=ctx.dp_rank,
            dp_world=ctx.dp_world,
            device=ctx.device,
            log=print if ctx.is_main_process else _silent,
        )

    @property
    def dp(self) -> dict:
        """{"rank", "world", "device"}: the keyword arguments of the batch functions."""
        return {"rank": self.dp_rank, "world": self.dp_world, "device": self.device}


@dataclasses.dataclass(frozen=True)
class TextOptions:
    """How text sources are read and split.

    Attributes:
      text_field: parquet/jsonl shards: the column or key holding each document's text.
      val_fraction: the share of files (text), documents (shards) or bytes (one file) held out.
      max_bad_line_fraction: jsonl lines that are not JSON objects a shard may have (skipped, and
        reported); above it loading stops with a `DataError`.
      workers: tokenizing processes on this rank; 0 = its share of the cores, or this process alone for
        less than 64 MiB of files.

    Example:
      >>> TextOptions(text_field="content", val_fraction=0.01)
    """

    text_field: str = "text"
    val_fraction: float = DEFAULT_VAL_FRACTION
    max_bad_line_fraction: float = 0.0
    workers: int = 0

    @classmethod
    def of(cls, data: Any) -> TextOptions:
        """The options a run config's `data` sets (`functrain.trainer.defaults.data_config()`'s keys).

        Example:
          >>> TextOptions.of(config.data)
        """
        return cls(data.text_field, data.val_fraction, data.max_bad_line_fraction, data.tokenize_workers)


@dataclasses.dataclass(frozen=True)
class Batching:
    """How batches are cut.

    Attributes:
      batch_size: the global batch size (rows per step over every data-parallel rank).
      block_size: the row length T.
      seed: the data seed (a batch is a pure function of seed and step).
      eval_batches: validation batches per source.

    Example:
      >>> Batching(batch_size=32, block_size=256, seed=0, eval_batches=20)
    """

    batch_size: int
    block_size: int
    seed: int = 0
    eval_batches: int = 0

    @classmethod
    def of(cls, config: Any, block_size: int) -> Batching:
        """A run config's batching (`batch_size`, `seed`, `eval_batches`) with the family's row length.

        Example:
          >>> Batching.of(config, block_size=256)
        """
        return cls(config.batch_size, block_size, config.seed, config.eval_batches)


def _silent(line: str) -> None:
    """A log that prints nothing."""
