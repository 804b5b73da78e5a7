"""Prompts to sample completions from (`data.format=prompts`): jsonl/parquet records whose `prompt` is a text or
messages, their other fields passed on to the reward functions, or the built-in `additions` task. A step's prompts
are a pure function of the seed and the step (epochs over a keyed permutation), split over the data-parallel ranks.

Example:
    >>> d = prompt_data(config.data, place, Batching(8, 64), tokenizer=ByteTokenizer(), template=None)
    >>> share = d.prompts_at(0)             # this rank's prompts of step 0
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from functrain.data import additions
from functrain.data.documents import source_content
from functrain.data.errors import DataError
from functrain.data.placement import Batching, Placement
from functrain.data.record import source_record
from functrain.data.sampling import permute, stream_hash
from functrain.data.shards import is_shard_source
from functrain.data.supervised import ChatTemplate, read_records

__all__ = ["PromptData", "Share", "prompt_data"]


class Share(NamedTuple):
    """A rank's prompts of one step.

    Attributes:
      places: each prompt's place in the step's global batch (the generator's request index: its draws).
      ids: each prompt's token ids.
      prompts: each prompt as its record holds it (a text, or messages): what reward functions are given.
      fields: the records' other fields, {name: one value per prompt}.
    """

    places: list[int]
    ids: list[list[int]]
    prompts: list[Any]
    fields: dict[str, list]


@dataclasses.dataclass
class PromptData:
    """A run's prompts (`prompt_data`): every record's ids, prompt and fields; the batches' split over ranks.

    Attributes:
      ids: each record's prompt ids.
      prompts: each record's prompt (text or messages).
      fields: each record's other fields.
      batching: the global batch (prompts per step) and the seed.
      place: this process's data-parallel rank and world.
      tokenizer: the tokenizer the ids come from.
      info: the format ("prompts"), the source's files (`record`) and the source name.
    """

    ids: list[list[int]]
    prompts: list[Any]
    fields: list[dict]
    batching: Batching
    place: Placement
    tokenizer: Any
    info: dict

    def prompts_at(self, step: int, whole: bool = False) -> Share:
        """This rank's prompts of `step` (`whole`: every rank's): the step's `batch_size` prompts (each once per
        epoch, in an order keyed by the seed and the epoch), the rank's contiguous share of them."""
        b, n = self.batching.batch_size, len(self.ids)
        per = b if whole else b // self.place.dp_world
        first = 0 if whole else self.place.dp_rank * per
        places = list(range(first, first + per))
        pos = np.asarray([step * b + i for i in places], np.int64)  # place in the stream of prompts
        rows = [int(permute(np.asarray([p % n]), n, stream_hash(self.batching.seed, p // n))[0]) for p in pos]
        names = sorted({k for r in rows for k in self.fields[r]})
        fields = {k: [self.fields[r].get(k) for r in rows] for k in names}
        return Share(places, [self.ids[r] for r in rows], [self.prompts[r] for r in rows], fields)

    @property
    def steps_per_epoch(self) -> float:
        """Steps per pass over the prompts."""
        return len(self.ids) / self.batching.batch_size

    def eval_sets(self) -> list:
        """No held-out loss: a GRPO run reports its rewards."""
        return []

    def position(self, step: int) -> dict[str, float]:
        """The epoch after `step` steps."""
        return {"epoch": step / self.steps_per_epoch}

    def validation_text(self) -> None:
        """No validation documents."""
        return None

    def record(self) -> dict:
        """What the run samples from (checkpoints carry it, a resume compares it)."""
        identity = getattr(self.tokenizer, "identity", getattr(self.tokenizer, "name", "bytes"))
        return {
            "sources": {"data": source_record("prompts", identity, self.info["content"])},
            "batch_size": self.batching.batch_size,
        }

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary (256: bytes)."""
        return int(getattr(self.tokenizer, "vocab_size", 256))

    def describe(self) -> str:
        """E.g. '5,000 prompts (additions), 625.0 steps per epoch'."""
        return f"{len(self.ids):,} prompts ({self.info['source']}), {self.steps_per_epoch:.1f} steps per epoch"

    def encode(self, text: str):
        """The tokenizer's ids of `text`."""
        return self.tokenizer.encode(text)

    def decode(self, tokens) -> str:
        """The text of token ids."""
        return self.tokenizer.decode(tokens)


def prompt_data(data: Any, place: Placement, batching: Batching, *, tokenizer, template: ChatTemplate | None):
    """The run's prompts: `data.path` jsonl/parquet records (`data.fields` maps `prompt` to another name), or
    "additions" (the built-in task: `functrain.data.additions`).

    Args:
      data: the run config's `data`.
      place: this process's place (its data-parallel rank and world split each step's prompts).
      batching: `batch_size` prompts per step (a multiple of the data-parallel ranks), the seed.
      tokenizer: the run's tokenizer.
      template: the chat template messages prompts are rendered with (a generation prompt added).

    Returns:
      A `PromptData`.

    Raises:
      DataError: no records, a record without the prompt field, a batch the ranks cannot split (one line).

    Example:
      >>> d = prompt_data(config.data, place, Batching(8, 64), tokenizer=tok, template=template)
    """
    if batching.batch_size % place.dp_world:
        raise DataError(
            f"batch_size={batching.batch_size} prompts do not split over {place.dp_world} data-parallel ranks; give "
            "a multiple of them"
        )
    key = dict(data.fields).get("prompt", "prompt")
    source = str(data.path)
    if source == additions.SOURCE:
        records, content = additions.records(), [[additions.SOURCE, 0, additions.SOURCE]]
    elif is_shard_source(source):
        records = [r for _, _, r in read_records(source, data.max_bad_line_fraction)]
        content = source_content(source, place.cache_dir, place.log)[3]
    else:
        raise DataError(
            f"data.path {source!r}: prompts are jsonl/parquet records with a {key!r} field, or {additions.SOURCE!r}"
        )
    if not records:
        raise DataError(f"data.path {source!r} holds no record; add prompts, one JSON object per line")
    ids, prompts, fields = [], [], []
    for i, record in enumerate(records):
        if key not in record:
            raise DataError(
                f"record {i} of {source!r} has no {key!r} field (it has {sorted(record)[:8]}); add it, or map the name "
                "with --config.data.fields (e.g. {'prompt': 'question'})"
            )
        prompt = record[key]
        ids.append(_prompt_ids(prompt, tokenizer, template, i))
        prompts.append(prompt)
        fields.append({k: v for k, v in record.items() if k != key})
    info = {"fmt": "prompts", "content": content, "source": source}
    return PromptData(ids, prompts, fields, batching, place, tokenizer, info)


def _prompt_ids(prompt: Any, tokenizer, template: ChatTemplate | None, i: int) -> list[int]:
    """A prompt's ids: a text with what the tokenizer adds before it (BOS), messages as the template renders them."""
    if isinstance(prompt, str):
        return [*tokenizer.special.prefix, *(int(t) for t in tokenizer.encode(prompt))]
    if isinstance(prompt, list) and template is not None:
        return [int(t) for t in tokenizer.encode(template.render(prompt, add_generation_prompt=True))]
    raise DataError(f"prompt {i} is a {type(prompt).__name__}; give a text or a list of messages")
