"""The data side every decoder-LM family shares: the run's data from its config (text windows or supervised
examples), the tokenizer and chat template it names, what a run prints at its end, and the packing check.

Example:
    >>> tok = lm_data.tokenizer_of(config, None, "runs/llama/data", fresh_vocab=2048, key="init_from")
    >>> data = lm_data.load_data(config, ctx, "runs/llama/data", block_size=256, vocab_size=None, tokenizer=tok)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from functrain import config_checks
from functrain import data as data_lib

__all__ = [
    "chat_template",
    "check_packing",
    "finish_text",
    "load_data",
    "supervised_format",
    "tokenizer_of",
    "validation_text",
]


def load_data(config, ctx, cache_dir: str, *, block_size: int, vocab_size: int | None, tokenizer=None, model_dir=None):
    """The run's data (`config.data`: one source, a mixture, or supervised examples) on this process's place in `ctx`.

    Args:
      config: the run config (data.*, batch_size, seed, eval_batches are read).
      ctx: the parallel context (data-parallel rank/world for the batches; every rank shares the
        tokenizing of shard sources; rank 0 prints the progress).
      cache_dir: where text and shards are tokenized to.
      block_size: the window length.
      vocab_size: the vocabulary of `.bin` sources without a meta.json (None: theirs).
      tokenizer: an `HFTokenizer` for text (None: bytes, or a token cache's own).
      model_dir: the model's directory: its chat template renders `messages` examples.

    Returns:
      A `functrain.data.LMData`, or for supervised examples (`data.format`, or records with
      prompt/completion, messages or instruction fields) a `functrain.data.SFTData`.

    Example:
      >>> data = lm_data.load_data(config, ctx, "runs/gpt/data", block_size=128, vocab_size=None)
    """
    log = print if ctx.is_main_process else (lambda line: None)
    if supervised_format(config.data) != "text":
        tok = tokenizer if tokenizer is not None else data_lib.ByteTokenizer()
        return data_lib.sft_data(
            config.data,
            cache_dir=cache_dir,
            tokenizer=tok,
            template=chat_template(config, model_dir, tok),
            batch_size=config.batch_size,
            block_size=block_size,
            seed=config.seed,
            eval_batches=config.eval_batches,
            dp_rank=ctx.dp_rank,
            dp_world=ctx.dp_world,
            device=ctx.device,
            rank=ctx.rank,
            log=log,
        )
    return data_lib.lm_data(
        config.data,
        cache_dir=cache_dir,
        batch_size=config.batch_size,
        block_size=block_size,
        seed=config.seed,
        eval_batches=config.eval_batches,
        dp_rank=ctx.dp_rank,
        dp_world=ctx.dp_world,
        device=ctx.device,
        rank=ctx.rank,
        world=ctx.world_size,
        vocab_size=vocab_size,
        tokenizer=tokenizer,
        log=log,
    )


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
      >>> lm_data.finish_text(dataset, config.sample, lambda p, n: lm.generate(template, params, p, n, key=key), "cpu")
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


def supervised_format(data) -> str:
    """`data.format`, or (auto) the format of the first record of a jsonl/parquet `data.path` ("text" otherwise).

    Example:
      >>> supervised_format(config.data)        # data.path = "sft.jsonl" of prompt/completion records
      'prompt_completion'
    """
    fmt = data.get("format", "auto")
    if fmt != "auto":
        return fmt
    builtin = data_lib.builtin_format(str(data.path))
    if builtin:  # "stdlib:messages", "stdlib:prompt_completion"
        return builtin
    if data.get("sources") or not data_lib.is_shard_source(str(data.path)):
        return "text"
    record = data_lib.first_record(str(data.path))
    if record is None:
        raise data_lib.DataError(
            f"data.path {data.path!r} holds no record (empty files); add examples, one JSON object per line "
            "(prompt/completion, messages, instruction/output or text)"
        )
    if data.get("text_field", "text") in record:
        return "text"
    return data_lib.detect_format(record, dict(data.get("fields") or {}))


def chat_template(config, model_dir, tokenizer) -> data_lib.ChatTemplate:
    """The chat template `data.chat_template` names: "auto": the model directory's, else the tokenizer file's
    directory's, else the default; "default"; a .jinja file; a directory with a tokenizer_config.json. It
    renders with the tokenizer's special tokens (`bos_token`, `eos_token`, ...), as transformers renders it."""
    spec = config.data.chat_template
    special = (tokenizer.special.template_vars() or None) if tokenizer is not None else None
    if spec == "default":
        return data_lib.chat_template_of(None, special)
    if spec != "auto":
        path = Path(spec).expanduser()
        if path.is_file():
            return data_lib.ChatTemplate(path.read_text(), special, name=str(path))
        if not path.is_dir():
            raise config_checks.ConfigError(
                f"data.chat_template={spec!r} is neither a .jinja file nor a directory; give one, or 'auto' / 'default'"
            )
        return data_lib.chat_template_of(path, special)
    for d in (model_dir, getattr(tokenizer, "path", None) and Path(tokenizer.path).parent):
        if d is not None and data_lib.has_chat_template(d):
            return data_lib.chat_template_of(d, special)
    return data_lib.chat_template_of(None, special)


def tokenizer_of(config, hf, cache_dir: str, *, fresh_vocab: int, key: str):
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
      ConfigError: a directory with no tokenizer.json whose model is not byte-level, or "bpe:N" over
      a mixture (one line).

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


def validation_text(config) -> Callable[[], list[str]]:
    """`() -> texts`: the validation documents of the run's text sources (`Task.validation_text`).

    Args:
      config: the run config (data.path or data.sources, text_field, val_fraction are read).

    Returns:
      The function (it reads the files when called): every source's held-out documents, in order.

    Raises:
      DataError (when called): a source that is token files (train.bin / val.bin, a token cache): their
        documents' text is not kept; one line.

    Example:
      >>> docs = lm_data.validation_text(config)()
    """

    def read() -> list[str]:
        """The held-out documents of every text source."""
        out: list[str] = []
        for _, path, _ in data_lib.parse_mixture(config.data):
            here = Path(path).expanduser()
            if path != "stdlib" and (here.is_dir() and ((here / "val.bin").exists() or (here / "meta.json").exists())):
                raise data_lib.DataError(
                    f"data.path {path}: token files keep no document text, so the built-in "
                    "next_lines task cannot be made from them; evaluate on a multiple-choice file "
                    "(--config.eval.tasks=<file.jsonl>) or train on text"
                )
            out += data_lib.validation_documents(
                path,
                text_field=config.data.text_field,
                val_fraction=config.data.val_fraction,
            )
        return out

    return read
