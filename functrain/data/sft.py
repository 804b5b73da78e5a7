"""Fine-tuning data: supervised examples in epochs, as the batches of a language model's `Task`.

Internals: docs/internals.md "functrain.data.sft".

Example:
    >>> d = sft_data(config.data, Placement("runs/sft/data"), Batching(8, 512, seed=0, eval_batches=4),
    ...              tokenizer=tok, template=t)
    >>> x, y, pos = d.train_batch(0)        # with data.packing=True
    >>> d.steps_per_epoch
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from functrain.data.errors import DataError
from functrain.data.examples import ExampleSet, ExampleSpec, load_examples
from functrain.data.packing import assemble, best_fit_decreasing, efficiency
from functrain.data.placement import Batching, Placement
from functrain.data.record import source_record
from functrain.data.sampling import permute, stream_hash
from functrain.data.stdlib_sft import builtin_format, builtin_source
from functrain.data.supervised import ChatTemplate
from functrain.data.tokenizer import separator_ids
from functrain.eval.scorer import default_buckets

__all__ = ["END_MARKS", "ExampleSampler", "SFTData", "padded_length", "row_lengths", "sft_data"]

_ROWS_STREAM, _ORDER_STREAM = 5, 6
SMALLEST_ROW = 32  # the shortest padded row length (`row_lengths`)


def row_lengths(block_size: int) -> tuple[int, ...]:
    """The lengths padded rows come in: powers of two from `SMALLEST_ROW` below `block_size`, then `block_size`
    (a compiled step makes one graph per length: docs/compiler.md).

    Example:
      >>> row_lengths(256)
      (32, 64, 128, 256)
    """
    return default_buckets(block_size, SMALLEST_ROW)  # (the evaluation's buckets: the same rule)


def padded_length(lengths, block_size: int) -> int:
    """The row length of a batch of padded examples: its longest example's (pairs), rounded up to `row_lengths`."""
    longest = max((int(n) for n in lengths), default=1)
    return next(n for n in row_lengths(block_size) if n >= longest)


END_MARKS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "</s>")
"""Where a generated answer ends (ChatML's end of turn, common end-of-text tokens)."""


class ExampleSampler:
    """The rows of every epoch over a set of examples, and the batches they make: packed rows are `block_size`
    long; padded ones (one example a row) as long as the batch's longest example, rounded up to `row_lengths`
    (as TRL pads each batch to its longest, in a few lengths that compiled steps share).

    Args:
      examples: the training examples.
      batch_size: the GLOBAL batch size (rows).
      block_size: the longest row.
      seed: the data seed.
      packing: pack whole examples into rows (best-fit-decreasing), else one per row.
      pad_id: the input id of padding.
      group: the examples of a record that go together: 1, or 2 for preference pairs (chosen, rejected: a batch
        of B pairs is x, y (B, 2, T), never packed).

    Example:
      >>> s = ExampleSampler(train, batch_size=8, block_size=512, seed=0, packing=True, pad_id=0)
      >>> x, y, pos = s.batch(3, rank=0, world=2)       # (4, 512) each
    """

    def __init__(  # noqa: PLR0913
        self,
        examples: ExampleSet,
        *,
        batch_size: int,
        block_size: int,
        seed: int,
        packing: bool,
        pad_id: int,
        group: int = 1,
    ):
        if packing and group > 1:
            raise ValueError("preference pairs are not packed")
        self.examples, self.batch_size, self.block_size = examples, batch_size, block_size
        self.seed, self.packing, self.pad_id, self.group = int(seed), packing, pad_id, group
        self._memo: dict[int, list] = {}  # the last epochs' rows
        self.rows_per_epoch = len(self._rows(0))

    def _order(self, epoch: int) -> np.ndarray:
        """The examples of `epoch`, permuted by (seed, epoch)."""
        n = len(self.examples) // self.group
        return permute(np.arange(n), n, stream_hash(_ORDER_STREAM, self.seed, epoch))

    def _rows(self, epoch: int) -> list[list[int]]:
        """The rows of `epoch`: lists of example ids, in the order the batches take them (the last 4 kept)."""
        if epoch not in self._memo:
            if len(self._memo) >= 4:
                self._memo.pop(next(iter(self._memo)))
            order = self._order(epoch)
            if not self.packing:
                rows = [[int(i)] for i in order]
            else:
                packed = best_fit_decreasing(self.examples.lengths, self.block_size, order)
                shuffled = permute(np.arange(len(packed)), len(packed), stream_hash(_ROWS_STREAM, self.seed, epoch))
                rows = [packed[int(j)] for j in shuffled]
            self._memo[epoch] = rows
        return self._memo[epoch]

    @property
    def steps_per_epoch(self) -> float:
        """Steps that make one epoch (a fraction when the rows do not divide by the batch)."""
        return self.rows_per_epoch / self.batch_size

    def batch(self, step: int, rank: int = 0, world: int = 1, device=None, reference=None) -> tuple:
        """This rank's rows of step `step`'s batch: (x, y) or, packed, (x, y, positions), each (B / world, T), T the
        same on every rank (from the whole batch's longest example when padded); pairs with a `reference` table
        (`tensors`) add its rows."""
        if world < 1 or not 0 <= rank < world or self.batch_size % world:
            raise ValueError(
                f"need 0 <= rank < world dividing batch_size {self.batch_size}, got rank={rank}, world={world}"
            )
        b = self.batch_size // world
        rows = []
        for g in int(step) * self.batch_size + np.arange(self.batch_size):
            epoch, j = divmod(int(g), self.rows_per_epoch)
            rows.append(self._rows(epoch)[j])
        length = self.row_length(rows)
        return self.tensors(self.examples, rows[rank * b : (rank + 1) * b], length, device, reference)

    def tensors(self, examples: ExampleSet, rows: list[list[int]], length: int, device=None, reference=None) -> tuple:
        """`rows` of `examples` as tensors: (x, y) or, packed, (x, y, positions), (R, length); pairs (R, 2, length),
        and with `reference` (float (pairs, 2): each pair's reference log-probs) their rows (R, 2) after them."""
        if self.group == 1:
            return _tensors(assemble(examples, rows, length, self.pad_id), self.packing, device)
        # a row of record i -> its examples' rows (an empty row, the validation's filler: `group` empty rows)
        each = [[self.group * i + k] if row else [] for row in rows for i in row or [0] for k in range(self.group)]
        x, y = _tensors(assemble(examples, each, length, self.pad_id), False, device)
        x, y = x.view(len(rows), self.group, length), y.view(len(rows), self.group, length)  # (R * 2, T) -> (R, 2, T)
        if reference is None:
            return x, y
        ref = torch.from_numpy(np.stack([reference[row[0]] if row else np.zeros(2) for row in rows]))  # (R, 2)
        return x, y, ref.to(x.device)

    def row_length(self, rows: list[list[int]], examples: ExampleSet | None = None) -> int:
        """The row length of a global batch of `rows`: the block packed, else `padded_length`."""
        if self.packing:
            return self.block_size
        lengths, g = (examples or self.examples).lengths, self.group
        return padded_length((lengths[g * i + k] for row in rows for i in row for k in range(g)), self.block_size)

    def eval_rows(self, examples: ExampleSet) -> list[list[int]]:
        """The validation rows: every validation record once, in order (packed, or one per row)."""
        if not self.packing:
            return [[i] for i in range(len(examples) // self.group)]
        return best_fit_decreasing(examples.lengths, self.block_size, np.arange(len(examples)))

    def epoch_tokens(self) -> int:
        """Every token (real and padding) of the first epoch's rows, each batch padded to its length."""
        rows = self._rows(0)
        batches = [rows[i : i + self.batch_size] for i in range(0, len(rows), self.batch_size)]
        return sum(len(batch) * self.group * self.row_length(batch) for batch in batches)

    def position(self, step: int) -> dict[str, float]:
        """{"epoch": e, "epoch_fraction": f} after `step` steps."""
        epoch, at = divmod(int(step) * self.batch_size, self.rows_per_epoch)
        return {"epoch": epoch, "epoch_fraction": at / self.rows_per_epoch}


def _tensors(arrays, packing: bool, device) -> tuple:
    """(x, y) or (x, y, positions) as int64 tensors on `device`."""
    out = [torch.from_numpy(a) for a in (arrays if packing else arrays[:2])]
    if device is not None and torch.device(device).type != "cpu":
        return tuple(t.pin_memory().to(device, non_blocking=True) for t in out)
    return tuple(out)


def _ends(tokenizer, fmt: str, template: ChatTemplate | None) -> str:
    """The line saying how examples start and end (which BOS and EOS, read from where)."""
    special = tokenizer.special
    if fmt == "messages" and template is not None:
        learned = "its {% generation %} blocks" if template.has_generation else "the assistant turns' spans"
        return f"examples: conversations rendered by {template.name}; train_on=assistant learns {learned}"
    if special.eos is None:
        return "examples: each ends with the separator (a byte-level vocabulary has no end-of-text token)"
    bos = f", start with {special.bos} (the tokenizer adds it)" if special.prefix else ""
    return f"examples: each ends with {special.eos} (id {special.eos_id}, from {special.eos_from}){bos}"


@dataclasses.dataclass
class SFTData:
    """A fine-tuning run's examples, for a `Task` (the surface of `LMData`).

    Attributes:
      train, val: the `ExampleSet`s.
      sampler: the `ExampleSampler` of the training batches.
      tokenizer: the tokenizer they were encoded with.
      vocab_size: its vocabulary.
      eval_batches: the most validation batches (every validation row when fewer).
      dp: {"rank", "world", "device"}.
      info: `load_examples`' info (format, counts, the files).
      template: the chat template (what the end-of-run answer is rendered with).
      reference: preference pairs' reference log-probs computed beforehand, {"train", "val"}: float (pairs, 2)
        each, added to every batch (None: none).
    """

    train: ExampleSet
    val: ExampleSet
    sampler: ExampleSampler
    tokenizer: Any
    vocab_size: int
    eval_batches: int
    dp: dict
    info: dict
    template: ChatTemplate | None
    reference: dict | None = None

    def train_batch(self, step: int) -> tuple:
        """This rank's rows of step `step`'s batch (a pure function of seed and step)."""
        return self.sampler.batch(step, **self.dp, reference=self.reference and self.reference["train"])

    def eval_sets(self) -> list:
        """This rank's rows of the fixed validation batches (every validation example, up to `eval_batches`)."""
        s = self.sampler
        rows = s.eval_rows(self.val)
        n = min(self.eval_batches, math.ceil(len(rows) / s.batch_size))
        rows = (rows + [[]] * (n * s.batch_size))[: n * s.batch_size]  # the last batch filled with empty rows
        world, rank = self.dp["world"], self.dp["rank"]
        b = s.batch_size // world
        out = []
        for k in range(n):
            batch = rows[k * s.batch_size : (k + 1) * s.batch_size]
            mine = batch[rank * b : (rank + 1) * b]
            ref = self.reference and self.reference["val"]
            out.append(s.tensors(self.val, mine, s.row_length(batch, self.val), self.dp["device"], ref))
        return out

    def position(self, step: int) -> dict[str, float]:
        """The epoch and the fraction of it consumed after `step` steps."""
        return self.sampler.position(step)

    @property
    def steps_per_epoch(self) -> float:
        """Steps per epoch over the training examples."""
        return self.sampler.steps_per_epoch

    def validation_text(self) -> None:
        """None: supervised examples give no validation documents (`next_lines` is made from text)."""
        return None

    def efficiency(self) -> tuple[float, float]:
        """(target tokens, real tokens) over all tokens of an epoch's rows."""
        return efficiency(self.train, self.sampler.epoch_tokens())

    def held_out(self) -> tuple[np.ndarray, str]:
        """The first validation example's prompt (its tokens before the first target: for a conversation,
        through the assistant header) and the text it is to learn (up to its end of turn).

        Example:
          >>> prompt, expected = data.held_out()
        """
        a, b = int(self.val.offsets[0]), int(self.val.offsets[1])
        tok, learn = self.val.tokens[a:b], self.val.targets[a:b]
        first = int(np.argmax(learn))
        return tok[:first], self.answer(tok[first:][learn[first:]])

    def answer(self, tokens) -> str:
        """Generated ids as text, cut at the first stop id (the tokenizer's EOS and generation_config.json's), then at
        the first end of turn or end of text written out (`END_MARKS`, the template's eos: byte-level vocabularies)."""
        tokens = [int(t) for t in tokens]
        stops = set(self.tokenizer.special.stop_ids)
        tokens = tokens[: next((i for i, t in enumerate(tokens) if t in stops), len(tokens))]
        text = self.decode(tokens)
        marks = END_MARKS + tuple(t for t in [(self.template.special if self.template else {}).get("eos_token")] if t)
        cut = min([text.find(m) for m in marks if m in text] or [len(text)])
        return text[:cut]

    def encode(self, text: str):
        """The tokenizer's ids of `text`."""
        return self.tokenizer.encode(text)

    def decode(self, tokens) -> str:
        """The text of token ids."""
        return self.tokenizer.decode(tokens)

    def record(self) -> dict:
        """What the run trains on (`LMData.record`'s form: checkpoints carry it, a resume compares it)."""
        kind = f"examples:{self.info['fmt']}:{self.info['train_on']}"
        identity = getattr(self.tokenizer, "identity", self.tokenizer.name)
        return {
            "sources": {"data": source_record(kind, identity, self.info["content"])},
            "batch_size": self.sampler.batch_size,
        }

    def describe(self) -> str:
        """E.g. '1,204 examples (messages, learning assistant), packed 3.1 per row, 150 steps per epoch'."""
        n_train, _ = self.info["examples"]
        how = f"packed {n_train / self.sampler.rows_per_epoch:.1f} per row" if self.sampler.packing else "padded"
        return (
            f"{n_train:,} examples ({self.info['fmt']}, learning {self.info['train_on']}), {how}, "
            f"{self.steps_per_epoch:.1f} steps per epoch"
        )


def sft_data(data: Any, place: Placement, batching: Batching, *, tokenizer, template: ChatTemplate | None) -> SFTData:
    """Loads `data.path`'s supervised examples and builds their sampler.

    Args:
      data: the run config's `data` (`format`, `train_on`, `fields`, `packing`, `too_long`, `val_fraction`,
        `max_bad_line_fraction` are read: `functrain.trainer.defaults.data_config()`'s keys).
      place: where the rendered examples are cached, this process's rank (0 renders the examples) and
        data-parallel place, and where the counts and the packing efficiency are logged.
      batching: the global batch size, the row length, the seed and the most validation batches.
      tokenizer: the functrain tokenizer.
      template: the chat template (the messages format).

    Returns:
      An `SFTData`.

    Raises:
      DataError: see `load_examples`; mixtures are not supported (one line).

    Example:
      >>> d = sft_data(config.data, Placement("runs/x/data"), Batching(8, 256, seed=0, eval_batches=4), tokenizer=tok,
      ...              template=t)
    """
    if data.sources:
        raise DataError("supervised examples come from one source (data.path); data.sources mixes text sources")
    spec = ExampleSpec(
        fmt=builtin_format(str(data.path)) or data.format,
        train_on=data.train_on,
        fields=tuple(sorted(dict(data.fields).items())),
        template=template,
        block_size=batching.block_size,
        too_long=data.too_long,
        val_fraction=data.val_fraction,
        max_bad_line_fraction=data.max_bad_line_fraction,
    )
    source = builtin_source(str(data.path), place.cache_dir)  # "stdlib:messages": the stdlib's functions
    train, val, info = load_examples(source, place.cache_dir, tokenizer, spec, rank=place.rank, log=place.log)
    if info["fmt"] == "preference" and data.packing:
        raise DataError(
            "data.packing=True: preference pairs are padded rows, each pair's chosen and rejected answers side by "
            "side; set --config.data.packing=False"
        )
    special = tokenizer.special
    pad = next((i for i in (special.pad_id, special.eos_id) if i is not None), separator_ids(tokenizer)[-1])
    place.log(_ends(tokenizer, info["fmt"], template))
    sampler = ExampleSampler(
        train,
        batch_size=batching.batch_size,
        block_size=batching.block_size,
        seed=batching.seed,
        packing=bool(data.packing),
        pad_id=pad,
        group=2 if info["fmt"] == "preference" else 1,
    )
    vocab = int(getattr(tokenizer, "vocab_size", 256))
    out = SFTData(train, val, sampler, tokenizer, vocab, batching.eval_batches, place.dp, info, template)
    targets, real = out.efficiency()
    place.log(
        f"examples: {info['examples'][0]:,} train, {info['examples'][1]:,} val; rows {100 * real:.0f}% tokens, "
        f"{100 * targets:.0f}% targets ({'packed' if sampler.packing else 'padded'}), "
        f"{out.steps_per_epoch:.1f} steps per epoch"
    )
    return out
