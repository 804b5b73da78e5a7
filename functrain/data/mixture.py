"""A language model's data, as the run config describes it: one source or a weighted mixture,
sampled by random windows or by epochs, with a validation set per source.

Internals: docs/internals.md "functrain.data.mixture".

Example:
    >>> d = lm_data(config.data, Placement("runs/x/data"), Batching(32, 256, seed=0, eval_batches=20))
    >>> x, y = d.train_batch(0)
    >>> d.position(500)         # {"epoch": 1, "epoch_fraction": 0.2} with data.sampling="epochs"
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from functrain.data.batches import eval_batches as eval_windows
from functrain.data.corpus import Dataset, load_dataset
from functrain.data.documents import validation_documents
from functrain.data.errors import DataError
from functrain.data.placement import Batching, Placement, TextOptions
from functrain.data.record import source_record
from functrain.data.sampling import Sampler

__all__ = ["LMData", "lm_data", "parse_mixture"]


def parse_mixture(data: Any) -> list[tuple[str, str, float]]:
    """The (name, path, weight) of each source `data` (a run config's `data`) names.

    Args:
      data: with `path`, and optionally `sources` ({name: path}) and `mixture` ({name: weight}).

    Returns:
      `[("data", data.path, 1.0)]` without sources; else one entry per source, in name order,
      weights normalized to sum 1.

    Raises:
      DataError: sources and mixture name different sets, or a weight is not positive (one line).

    Example:
      >>> parse_mixture(config.data)
      [('web', '/data/web', 0.7), ('code', '/data/code', 0.3)]
    """
    sources, mixture = dict(data.sources), dict(data.mixture)
    if not sources and not mixture:
        return [("data", data.path, 1.0)]
    if set(sources) != set(mixture):
        raise DataError(
            f"data.sources names {sorted(sources)} but data.mixture weighs {sorted(mixture)}; give every "
            "source one weight"
        )
    for name, w in mixture.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (w > 0 and math.isfinite(w)):
            raise DataError(f"data.mixture[{name!r}]={w!r}: weights must be positive numbers")
    total = float(sum(mixture.values()))
    return [(name, str(sources[name]), mixture[name] / total) for name in sorted(mixture)]


@dataclasses.dataclass
class LMData:
    """A run's training and validation data (one source, or a mixture), for a `Task`.

    Attributes:
      datasets: {source name: `Dataset`}.
      sampler: the `Sampler` of the training batches.
      tokenizer: the tokenizer every source shares.
      vocab_size: the largest vocabulary among the sources.
      eval_batches: evaluation batches per source.
      dp: {"rank", "world", "device"}: this process's data-parallel place.
      options: how the sources' text was read and split (their validation text is read alike).
    """

    datasets: dict[str, Dataset]
    sampler: Sampler
    tokenizer: Any
    vocab_size: int
    eval_batches: int
    dp: dict
    options: TextOptions = TextOptions()

    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the training batch of `step` (a pure function of seed and step).

        Args:
          step: the training step.

        Returns:
          (x, y) int64 tensors (batch_size // dp_world, block_size).

        Example:
          >>> x, y = data.train_batch(0)
        """
        return self.sampler.batch(step, **self.dp)

    def eval_sets(self) -> list | dict[str, list]:
        """This rank's rows of the fixed validation batches: a list, or {source: list} for a mixture.

        Returns:
          The batches (the loop logs `val_loss`, and `val_loss/<source>` for a mixture).

        Example:
          >>> sets = data.eval_sets()
        """
        sets = {
            name: list(
                eval_windows(
                    ds.val,
                    Batching(self.sampler.batch_size, self.sampler.block_size, eval_batches=self.eval_batches),
                    **self.dp,
                )
            )
            for name, ds in self.datasets.items()
        }
        return next(iter(sets.values())) if len(sets) == 1 else sets

    def position(self, step: int) -> dict[str, float]:
        """The epoch and the fraction of it consumed after `step` steps (`Sampler.position`)."""
        return self.sampler.position(step)

    def validation_text(self) -> list[str]:
        """Every source's held-out documents, in order (the built-in `next_lines` task is made of them).

        Raises:
          DataError: a source that is token files (train.bin / val.bin, a token cache): their documents'
            text is not kept; one line.

        Example:
          >>> docs = data.validation_text()
        """
        out: list[str] = []
        for ds in self.datasets.values():
            source = str(ds.info.get("requested", ds.info.get("source")))  # (the path as given: maybe a cache)
            here = Path(source).expanduser()
            if source != "stdlib" and here.is_dir() and ((here / "val.bin").exists() or (here / "meta.json").exists()):
                raise DataError(
                    f"data.path {source}: token files keep no document text, so the built-in "
                    "next_lines task cannot be made from them; evaluate on a multiple-choice file "
                    "(--config.eval.tasks=<file.jsonl>) or train on text"
                )
            opts = self.options
            out += validation_documents(source, text_field=opts.text_field, val_fraction=opts.val_fraction)
        return out

    @property
    def steps_per_epoch(self) -> float | None:
        """Steps per epoch of one source sampled by epochs (its windows over the batch); None otherwise."""
        if self.sampler.sampling != "epochs" or len(self.datasets) > 1:
            return None
        return self.sampler.windows[0] / self.sampler.batch_size

    def encode(self, text: str):
        """The tokenizer's ids of `text`."""
        return self.tokenizer.encode(text)

    def decode(self, tokens) -> str:
        """The text of token ids."""
        return self.tokenizer.decode(tokens)

    def record(self) -> dict:
        """What the run trains on: per source its kind, tokenizer and files with their sizes and sha256
        (`functrain.data.record`; checkpoints carry it, a resume compares it).

        Returns:
          `{"sources": {name: {"kind", "tokenizer", "files"}}, "batch_size": rows per step}`, JSON-serializable.

        Example:
          >>> data.record()["sources"]["data"]["files"][0]
          ['a.jsonl', 1204, '5f1d...']
        """
        sources = {}
        for name, ds in self.datasets.items():
            identity = getattr(ds.tokenizer, "identity", ds.tokenizer.name)
            sources[name] = source_record(ds.info.get("kind", "text"), identity, ds.info.get("content", []))
        return {"sources": sources, "batch_size": self.sampler.batch_size}

    def describe(self) -> str:
        """E.g. '1,234,567 train tokens' or 'mixture web 70% / code 30%, 9,876,543 train tokens'."""
        n = sum(len(ds.train) for ds in self.datasets.values())
        how = ", epochs" if self.sampler.sampling == "epochs" else ""
        if len(self.datasets) == 1:
            return f"{n:,} train tokens{how}"
        parts = " / ".join(f"{name} {100 * w:.0f}%" for name, w in zip(self.sampler.names, self.sampler.weights))
        return f"mixture {parts}, {n:,} train tokens{how}"


def lm_data(
    data: Any, place: Placement, batching: Batching, *, tokenizer: Any = None, vocab_size: int | None = None
) -> LMData:
    """Loads the sources `data` names and builds their training sampler.

    Args:
      data: the run config's `data` (`functrain.trainer.defaults.data_config()`'s keys).
      place: where sources are tokenized to, this process's ranks (every process shares the
        tokenizing; the data-parallel ones take their rows), where batches go and progress lines.
      batching: the global batch size, window length, seed and validation batches per source.
      tokenizer: an `HFTokenizer` to tokenize text with (None: bytes, or the cache's own).
      vocab_size: the vocabulary of `.bin` sources without a meta.json.

    Returns:
      An `LMData`.

    Raises:
      DataError: a missing or bad source, sources with different tokenizers (one line).

    Example:
      >>> d = lm_data(config.data, Placement("runs/x/data"), Batching(32, 128, seed=0, eval_batches=5))
    """
    sources = parse_mixture(data)
    options = TextOptions.of(data)
    datasets = {
        name: load_dataset(
            path, place, options, tokenizer=tokenizer, vocab_size=vocab_size, block_size=batching.block_size
        )
        for name, path, _ in sources
    }
    first = next(iter(datasets.values()))
    names = {getattr(ds.tokenizer, "name", "?") for ds in datasets.values()}
    if len(names) > 1:
        raise DataError(
            f"data.sources are tokenized differently ({', '.join(sorted(names))}); one run needs one "
            "tokenizer: tokenize them alike"
        )
    sampler = Sampler(
        [(name, datasets[name].train, w) for name, _, w in sources],
        batch_size=batching.batch_size,
        block_size=batching.block_size,
        seed=batching.seed,
        sampling=data.sampling,
    )
    tokens = max(ds.vocab_size for ds in datasets.values())
    return LMData(datasets, sampler, first.tokenizer, tokens, batching.eval_batches, place.dp, options)
