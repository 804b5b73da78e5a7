"""The data side every decoder-LM family shares: where its data goes, the tokenizer it names, what a run
prints at its end, and the packing check (the data itself: `functrain.data.run_data`).

Example:
    >>> text = lm_data.text_of(config, ctx, "runs/llama", None, fresh_vocab=2048, key="init_from")
    >>> dataset = text.dataset(config, cfg.vocab_size, None, "use a larger --config.model.vocab_size")
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from functrain import config_checks
from functrain import data as data_lib

__all__ = [
    "Text",
    "check_packing",
    "check_vocab",
    "finish_text",
    "placement",
    "text_of",
    "tokenizer_of",
]


def placement(config, ctx, workdir) -> data_lib.Placement:
    """This process's `functrain.data.Placement` in `ctx`, its cache `data.cache_dir` or `<workdir>/data`.

    Example:
      >>> place = lm_data.placement(config, ctx, "runs/llama")
    """
    return data_lib.Placement.of(ctx, config.data.cache_dir or str(Path(workdir) / "data"))


class Text(NamedTuple):
    """A run's tokenizer and where its data goes: what a family reads before it sizes its model.

    Attributes:
      place: this process's `functrain.data.Placement`.
      tokenizer: the tokenizer `config.data.tokenizer` names (`tokenizer_of`), None for bytes.

    Example:
      >>> text = lm_data.text_of(config, ctx, "runs/llama", None, fresh_vocab=2048, key="init_from")
      >>> text.vocab, text.file
      (2048, PosixPath('runs/llama/data/tokenizer-2048.json'))
    """

    place: data_lib.Placement
    tokenizer: Any

    @property
    def vocab(self) -> int:
        """The tokenizer's vocabulary size (256: bytes)."""
        return self.tokenizer.vocab_size if self.tokenizer is not None else 256

    @property
    def file(self) -> Path | None:
        """The tokenizer.json an export carries (None: bytes)."""
        return getattr(self.tokenizer, "path", None)

    def summary(self, vocab: int) -> str:
        """`vocab N (tokenizer)`, the end of a run's model line."""
        return f"vocab {vocab} ({getattr(self.tokenizer, 'name', 'bytes')})"

    def dataset(self, config, vocab_size: int, model_dir: Path | None, fix: str):
        """The run's data (`functrain.data.run_data`) for a model of `vocab_size` ids, refused in one line (naming
        `fix`) where the tokenizer has more; `model_dir`'s chat template renders `messages` examples."""
        check_vocab(self.tokenizer, vocab_size, fix)
        batching = data_lib.Batching.of(config, config.model.block_size)
        return data_lib.run_data(
            config.data, self.place, batching, tokenizer=self.tokenizer, vocab_size=vocab_size, model_dir=model_dir
        )


def text_of(config, ctx, workdir, directory, *, fresh_vocab: int, key: str) -> Text:
    """The run's `Text`: its placement (`placement`) and the tokenizer the config names (`tokenizer_of`).

    Args:
      config: the run config.
      ctx: the parallel context.
      workdir: the run directory (data and a trained tokenizer in `<workdir>/data` unless `data.cache_dir`).
      directory: the model's `functrain.interop.hf.HFDirectory`, or None for a fresh model.
      fresh_vocab: the BPE size "auto" trains for a fresh model.
      key: the config key that named the directory (a refusal's first word).

    Returns:
      A `Text`.

    Example:
      >>> text = lm_data.text_of(config, ctx, "runs/hf", HFDirectory(path), fresh_vocab=151936, key="model.path")
    """
    place = placement(config, ctx, workdir)
    return Text(place, tokenizer_of(config, directory, place.cache_dir, fresh_vocab=fresh_vocab, key=key))


def finish_text(dataset, sample, generate: Callable, device) -> dict:
    """What a run prints at its end: a text sample from `sample.prompt`, or for supervised examples the
    answer to the first held-out prompt (as the chat template renders it) beside the expected one.

    Args:
      dataset: the task's `LMData` or `SFTData`.
      sample: the config's `sample` (prompt, max_new_tokens).
      generate: `(prompt ids (1, T), max_new_tokens) -> ids (1, T + n)` (the family's `generate` with its
        temperature, top_k, key and stages).
      device: where the prompt goes.

    Returns:
      {"sample": text}, or {"prompt", "answer", "expected"}.

    Example:
      >>> sample = lambda p, n: inference.generate(template, params, p, n, key=key)
      >>> lm_data.finish_text(dataset, config.sample, sample, "cpu")
    """
    if isinstance(dataset, data_lib.SFTData):
        prompt, expected = dataset.held_out()
        out = generate(torch.as_tensor(prompt, dtype=torch.long, device=device)[None], sample.max_new_tokens)
        return {
            "prompt": dataset.decode(prompt),
            "answer": dataset.answer(out[0, len(prompt) :].tolist()),
            "expected": expected,
        }
    ids = torch.as_tensor(dataset.encode(sample.prompt), dtype=torch.long, device=device)[None]  # (1, T)
    return {"sample": dataset.decode(generate(ids, sample.max_new_tokens)[0].tolist())}


def check_vocab(tokenizer, model_vocab: int, fix: str) -> int:
    """The tokenizer's vocabulary size (256: bytes), refused in one line where the model has fewer ids.

    Args:
      tokenizer: a functrain tokenizer, or None for bytes.
      model_vocab: the model's vocabulary size.
      fix: what to change, e.g. "use the model's own tokenizer (--config.data.tokenizer)".

    Returns:
      The tokenizer's vocabulary size.

    Raises:
      DataError: it exceeds `model_vocab`.

    Example:
      >>> check_vocab(tokenizer, cfg.vocab_size, "use the model's own tokenizer (--config.data.tokenizer)")
    """
    vocab = tokenizer.vocab_size if tokenizer is not None else 256
    if vocab > model_vocab:
        where = getattr(tokenizer, "path", "the byte tokenizer")
        raise data_lib.DataError(f"{where}: the tokenizer has {vocab} ids but the model only {model_vocab}; {fix}")
    return vocab


def tokenizer_of(config, hf, cache_dir: str | os.PathLike, *, fresh_vocab: int, key: str):
    """The tokenizer `config.data.tokenizer` names (None: bytes, the data layer's default).

    Args:
      config: the run config (`data.tokenizer`, `data.path`/`data.sources`, `data.text_field`,
        `data.val_fraction` are read).
      hf: the model's `functrain.interop.hf.HFDirectory`, or None for a fresh model.
      cache_dir: where a trained BPE goes.
      fresh_vocab: the BPE size "auto" trains for a fresh model.
      key: the config key that named the directory (the refusal's first word).

    Returns:
      "auto": the directory's tokenizer.json (bytes for a directory without one whose model has 256
      ids), else a byte-level BPE of `fresh_vocab` ids trained on the train split; "bytes": None;
      "bpe:N": a BPE of N ids; a path: that tokenizer.json.

    Raises:
      ConfigError: a directory with no tokenizer.json whose model is not byte-level, "bpe:N" over a
      mixture or over supervised records (one line).

    Example:
      >>> tok = lm_data.tokenizer_of(config, HFDirectory("SmolLM-135M"), "runs/x/data", fresh_vocab=2048,
      key="init_from")
    """
    spec = config.data.tokenizer
    if spec == "auto" and hf is not None:
        if hf.tokenizer_file is not None:
            return data_lib.HFTokenizer(hf.tokenizer_file, config.data.eos_token or None)
        vocab = hf.config.get("vocab_size")
        if vocab == 256:  # a byte-level model (what functrain exports after a run on bytes)
            return None
        raise config_checks.ConfigError(
            f"{key}: {hf.path} has no tokenizer.json and its model has {vocab} ids; give the model's tokenizer "
            f"(--config.data.tokenizer=<path to tokenizer.json>) or train a new one of its size "
            f"(--config.data.tokenizer=bpe:{vocab})"
        )
    if spec == "auto":
        spec = f"bpe:{fresh_vocab}"
    if spec == "bytes":
        return None
    if spec.startswith("bpe:"):
        fmt = data_lib.supervised_format(config.data)
        if fmt != "text":
            raise config_checks.ConfigError(
                f"data.tokenizer={config.data.tokenizer}: a BPE trains on plain text, and {config.data.path} holds "
                f"{fmt} records; give the model's tokenizer (--config.data.tokenizer=<path to tokenizer.json>, or "
                "init_from a directory with one) or bytes (--config.data.tokenizer=bytes)"
            )
        paths = [path for _, path, _ in data_lib.parse_mixture(config.data)]
        if len(paths) > 1:
            raise config_checks.ConfigError(
                "data.tokenizer=bpe:N trains on one source; with data.sources give a "
                "tokenizer.json (--config.data.tokenizer=<path>) or train one on a single "
                "source first"
            )
        return data_lib.train_tokenizer(
            paths[0], cache_dir, int(spec[4:]), text_field=config.data.text_field, val_fraction=config.data.val_fraction
        )
    return data_lib.HFTokenizer(spec, config.data.eos_token or None)


def check_packing(config, ctx) -> None:
    """Refuses `data.packing=True` under context parallelism (one line): its attention has no document mask.

    Args:
      config: the run config.
      ctx: the parallel context (cp splits the sequences).

    Raises:
      ConfigError: packing with a cp axis.

    Example:
      >>> lm_data.check_packing(config, ctx)
    """
    if config.data.packing and ctx.cp_world > 1:
        raise config_checks.ConfigError(
            "data.packing=True: context parallelism splits each row over the cp ranks and its "
            "attention has no document mask; set --config.data.packing=False or mesh.cp=1"
        )
