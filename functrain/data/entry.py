"""A run's data from its `data` config: text windows (one source or a mixture) or supervised examples,
the one entry point every model family calls.

Example:
    >>> d = run_data(config.data, Placement.of(ctx, "runs/x/data"), Batching.of(config, 256), tokenizer=tok)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from functrain.config_checks import ConfigError
from functrain.data import additions
from functrain.data.errors import DataError
from functrain.data.mixture import LMData, lm_data
from functrain.data.placement import Batching, Placement
from functrain.data.prompts import PromptData, prompt_data
from functrain.data.sft import SFTData, sft_data
from functrain.data.shards import is_shard_source
from functrain.data.stdlib_sft import builtin_format
from functrain.data.supervised import ChatTemplate, chat_template_of, detect_format, first_record, has_chat_template
from functrain.data.tokenizer import ByteTokenizer

__all__ = ["chat_template", "run_data", "supervised_format"]


def run_data(
    data: Any,
    place: Placement,
    batching: Batching,
    *,
    tokenizer: Any = None,
    vocab_size: int | None = None,
    model_dir=None,
) -> LMData | SFTData | PromptData:
    """The run's data (`data`: one source, a mixture, or supervised examples) on this process's `place`.

    Args:
      data: the run config's `data` (`functrain.trainer.defaults.data_config()`'s keys).
      place: where the data is cached, this process's ranks, where batches go and progress lines.
      batching: the global batch size, the row length, the seed and the validation batches.
      tokenizer: an `HFTokenizer` (None: bytes, or a token cache's own).
      vocab_size: the vocabulary of `.bin` sources without a meta.json (None: theirs).
      model_dir: the model's directory: its chat template renders `messages` examples.

    Returns:
      A `LMData`, or for supervised examples (`data.format`, or records with prompt/completion,
      messages or instruction fields) a `SFTData`, or for prompts alone (`data.format=prompts`, records with only
      a `prompt` field, or "additions") a `PromptData`.

    Raises:
      DataError, ConfigError: one line naming the problem and the fix.

    Example:
      >>> d = run_data(config.data, Placement("runs/gpt/data"), Batching(32, 128))
    """
    fmt = supervised_format(data)
    if fmt == "text":
        return lm_data(data, place, batching, tokenizer=tokenizer, vocab_size=vocab_size)
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    template = chat_template(data, model_dir, tok)
    if fmt == "prompts":
        return prompt_data(data, place, batching, tokenizer=tok, template=template)
    return sft_data(data, place, batching, tokenizer=tok, template=template)


def supervised_format(data: Any) -> str:
    """`data.format`, or (auto) the format of the first record of a jsonl/parquet `data.path` ("text" otherwise).

    Example:
      >>> supervised_format(config.data)        # data.path = "sft.jsonl" of prompt/completion records
      'prompt_completion'
    """
    if data.format != "auto":
        return data.format
    if str(data.path) == additions.SOURCE:
        return "prompts"
    builtin = builtin_format(str(data.path))
    if builtin:  # "stdlib:messages", "stdlib:prompt_completion"
        return builtin
    if data.sources or not is_shard_source(str(data.path)):
        return "text"
    record = first_record(str(data.path))
    if record is None:
        raise DataError(
            f"data.path {data.path!r} holds no record (empty files); add examples, one JSON object per line "
            "(prompt/completion, messages, instruction/output or text)"
        )
    if data.text_field in record:
        return "text"
    return detect_format(record, dict(data.fields))


def chat_template(data: Any, model_dir, tokenizer) -> ChatTemplate:
    """The chat template `data.chat_template` names: "auto": the model directory's, else the tokenizer file's
    directory's, else the default; "default"; a .jinja file; a directory with a tokenizer_config.json. It
    renders with the tokenizer's special tokens (`bos_token`, `eos_token`, ...), as transformers renders it.

    Example:
      >>> chat_template(config.data, "models/Qwen2.5-0.5B-Instruct", tok).name
    """
    spec = data.chat_template
    special = (tokenizer.special.template_vars() or None) if tokenizer is not None else None
    if spec == "default":
        return chat_template_of(None, special)
    if spec != "auto":
        path = Path(spec).expanduser()
        if path.is_file():
            return ChatTemplate(path.read_text(), special, name=str(path))
        if not path.is_dir():
            raise ConfigError(
                f"data.chat_template={spec!r} is neither a .jinja file nor a directory; give one, or 'auto' / 'default'"
            )
        return chat_template_of(path, special)
    for d in (model_dir, getattr(tokenizer, "path", None) and Path(tokenizer.path).parent):
        if d is not None and has_chat_template(d):
            return chat_template_of(d, special)
    return chat_template_of(None, special)
