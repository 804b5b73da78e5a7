"""Supervised examples: the formats users bring, rendered to tokens with a per-token target mask.

Internals: docs/internals.md "functrain.data.supervised".

Example:
    >>> fmt = detect_format({"prompt": "2+2=", "completion": "4"}, {})
    >>> ex = render({"prompt": "2+2=", "completion": "4"}, fmt, ByteTokenizer(), train_on="completion")
    >>> ex.tokens[ex.targets]          # the bytes of "4" and the end-of-text separator
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import gzip
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from functrain.data.errors import DataError
from functrain.data.shards import BadLines, shard_files, shard_kind
from functrain.data.tokenizer import separator_ids

__all__ = [
    "ALPACA_PROMPT",
    "DEFAULT_CHAT_TEMPLATE",
    "FORMATS",
    "TRAIN_ON",
    "ChatTemplate",
    "Example",
    "TemplateError",
    "chat_template_of",
    "detect_format",
    "first_record",
    "has_chat_template",
    "read_records",
    "render",
    "resolve_train_on",
]

FORMATS = ("prompt_completion", "messages", "alpaca", "text")
"""The supervised formats (`data.format`; "auto" finds one from a record's fields)."""

TRAIN_ON = ("completion", "assistant", "last", "all")
"""What `data.train_on` can learn ("auto": completion, or assistant for messages)."""

_FIELDS = {
    "prompt_completion": ("prompt", "completion"),
    "messages": ("messages",),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
}
_ALLOWED = {
    "prompt_completion": ("completion", "all"),
    "alpaca": ("completion", "all"),
    "messages": ("assistant", "last", "all"),
    "text": ("all",),
}

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The chat template of a model directory that has none: ChatML (`<|im_start|>role\\n...<|im_end|>\\n`)."""

ALPACA_PROMPT = (
    "Below is an instruction that describes a task{context}. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n{input}### Response:\n"
)
"""The alpaca format's prompt (`{input}` is `### Input:\\n<input>\\n\\n` when the record has one)."""


class TemplateError(DataError):
    """A chat template that cannot give the spans of a conversation (one line naming the example)."""


@dataclasses.dataclass
class Example:
    """One rendered example.

    Attributes:
      tokens: int64 (L,) token ids.
      targets: bool (L,): whether token i is learned (predicted from tokens[:i]).
    """

    tokens: np.ndarray
    targets: np.ndarray


def detect_format(record: Mapping, fields: Mapping[str, str]) -> str:
    """The format a record is in, from its fields (after `fields` renames).

    Args:
      record: one example.
      fields: {format field: the record's field}, e.g. {"prompt": "question", "completion": "answer"}.

    Returns:
      One of `FORMATS`.

    Raises:
      DataError: no format has all its fields in the record (one line listing them).

    Example:
      >>> detect_format({"question": "q", "answer": "a"}, {"prompt": "question", "completion": "answer"})
      'prompt_completion'
    """
    have = set(record)
    for fmt in ("messages", "prompt_completion", "alpaca", "text"):
        if all(fields.get(f, f) in have for f in _FIELDS[fmt]):
            return fmt
    raise DataError(
        f"a record with fields {sorted(have)[:12]} is in no supervised format (prompt/completion, "
        "messages, instruction/input/output, text); set --config.data.format and map the names with "
        "--config.data.fields (e.g. {'prompt': 'question', 'completion': 'answer'})"
    )


def resolve_train_on(train_on: str, fmt: str) -> str:
    """`data.train_on` for format `fmt` ("auto": completion, assistant for messages, all for text).

    Raises:
      DataError: a choice the format has no spans for (one line naming the ones it has).
    """
    if train_on == "auto":
        return _ALLOWED[fmt][0]
    if train_on not in _ALLOWED[fmt]:
        raise DataError(
            f"data.train_on={train_on!r} does not apply to the {fmt} format; use one of {', '.join(_ALLOWED[fmt])}"
        )
    return train_on


class ChatTemplate:
    """A Hugging Face chat template (Jinja), rendered as transformers renders it.

    Args:
      source: the template text.
      special: the variables templates read besides `messages`: `bos_token`, `eos_token`.

    Example:
      >>> t = ChatTemplate(DEFAULT_CHAT_TEMPLATE)
      >>> t.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
      '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'
    """

    def __init__(self, source: str, special: Mapping[str, str] | None = None):
        self.source = source
        self.special = dict(special or {})
        self._template = _jinja_env().from_string(source)

    def render(self, messages: list, *, add_generation_prompt: bool = False) -> str:
        """The conversation as text.

        Args:
          messages: [{"role", "content"}, ...].
          add_generation_prompt: end with the template's assistant header (what generation continues).

        Returns:
          The rendered text.
        """
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)


def _raise(message: str):
    """The templates' `raise_exception`."""
    raise TemplateError(f"the chat template refused a conversation: {message}")


@functools.lru_cache(maxsize=1)
def _jinja_env():
    """A sandboxed Jinja environment with what chat templates use (as transformers sets it up)."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError("the messages format renders a chat template with jinja2: pip install jinja2") from None

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        """Jinja's tojson as transformers defines it (no HTML escaping)."""
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def has_chat_template(directory: str | Path) -> bool:
    """Whether a directory holds a chat template (`chat_template.jinja`, or one in `tokenizer_config.json`)."""
    d = Path(directory)
    if (d / "chat_template.jinja").is_file():
        return True
    config = d / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def chat_template_of(directory: str | Path | None) -> ChatTemplate:
    """The chat template of a model (or tokenizer) directory, or `DEFAULT_CHAT_TEMPLATE`.

    Reads `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string, or a list of
    {name, template}: the one named "default"), with its `bos_token` / `eos_token`.

    Args:
      directory: the directory, or None (the default template).

    Returns:
      A `ChatTemplate`.

    Example:
      >>> chat_template_of("runs/hf/export").render([{"role": "user", "content": "hi"}])
    """
    source, special = None, {}
    d = Path(directory) if directory is not None else None
    config = d / "tokenizer_config.json" if d is not None else None
    if config is not None and config.is_file():
        cfg = json.loads(config.read_text())
        source = cfg.get("chat_template")
        if isinstance(source, list):
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        for name in ("bos_token", "eos_token"):
            tok = cfg.get(name)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            if isinstance(tok, str):
                special[name] = tok
    if d is not None and (d / "chat_template.jinja").is_file():
        source = (d / "chat_template.jinja").read_text()
    return ChatTemplate(source or DEFAULT_CHAT_TEMPLATE, special)


def _field(record: Mapping, fields: Mapping[str, str], name: str, where: str, default=None):
    """`record`'s value for format field `name` (renamed by `fields`)."""
    key = fields.get(name, name)
    value = record.get(key, default)
    if value is None and default is None:
        raise DataError(
            f"{where}: no field {key!r} (fields: {', '.join(list(record)[:12])}); map it with --config.data.fields"
        )
    return value


def _text(value, where: str, key: str) -> str:
    """A field's value, which must be a string."""
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} is a {type(value).__name__}, not text")
    return value


def _message_pieces(messages, template: ChatTemplate, train_on: str, where: str) -> list[tuple[str, bool]]:
    """(text, learned) pieces of a conversation, from rendering it one message at a time."""
    if not isinstance(messages, list) or not all(
        isinstance(m, Mapping) and "role" in m and "content" in m for m in messages
    ):
        raise DataError(f"{where}: messages must be a list of {{'role', 'content'}} objects")
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    learned = set(turns[-1:]) if train_on == "last" else set(turns)
    pieces, done, done_n = [], "", 0

    def extend(text: str, target: bool, n: int) -> None:
        nonlocal done, done_n
        if not text.startswith(done):
            raise TemplateError(
                f"{where}: the chat template renders the first {done_n} message(s) differently inside the first {n}, "
                "so the turns' spans are unknown (e.g. a template that rewrites earlier turns); use a template that "
                "renders each prefix as the start of the next (--config.data.chat_template), or "
                "--config.data.train_on=all"
            )
        pieces.append((text[len(done) :], target))
        done, done_n = text, n

    try:
        for i, m in enumerate(messages):
            if m["role"] == "assistant":  # its header is prompt, its content and end of turn are learned
                extend(template.render(messages[:i], add_generation_prompt=True), train_on == "all", i)
            extend(template.render(messages[: i + 1]), train_on == "all" or i in learned, i + 1)
    except TemplateError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template's own error, named with the example
        raise TemplateError(
            f"{where}: the chat template failed ({type(exc).__name__}: {exc}); fix the record or "
            "the template (--config.data.chat_template)"
        ) from None
    return pieces


def _pieces(
    record: Mapping, fmt: str, fields: Mapping[str, str], template: ChatTemplate | None, train_on: str, where: str
) -> list[tuple[str, bool]]:
    """The (text, learned) pieces of one example (the end-of-text ids are the caller's)."""
    completion = train_on in ("completion", "all")
    if fmt == "messages":
        if template is None:
            raise DataError(f"{where}: a messages record is rendered by a chat template, and none was given")
        return _message_pieces(_field(record, fields, "messages", where), template, train_on, where)
    if fmt == "text":
        return [(_text(_field(record, fields, "text", where), where, "text"), True)]
    if fmt == "prompt_completion":
        prompt = _text(_field(record, fields, "prompt", where), where, "prompt")
        answer = _text(_field(record, fields, "completion", where), where, "completion")
    else:  # alpaca
        instruction = _text(_field(record, fields, "instruction", where), where, "instruction")
        extra = _text(_field(record, fields, "input", where, ""), where, "input")
        answer = _text(_field(record, fields, "output", where), where, "output")
        prompt = ALPACA_PROMPT.format(
            context=", paired with an input that provides further context" if extra else "",
            instruction=instruction,
            input=f"### Input:\n{extra}\n\n" if extra else "",
        )
    return [(prompt, train_on == "all"), (answer, completion)]


def render(
    record: Mapping,
    fmt: str,
    tokenizer,
    *,
    train_on: str,
    fields: Mapping[str, str] | None = None,
    template: ChatTemplate | None = None,
    where: str = "example",
) -> Example:
    """One example's tokens and target mask.

    Args:
      record: the example (a parsed JSON object / parquet row).
      fmt: one of `FORMATS`.
      tokenizer: a functrain tokenizer (`encode(text) -> ids`, no special tokens added).
      train_on: a resolved `TRAIN_ON` choice (`resolve_train_on`).
      fields: {format field: the record's field}.
      template: the chat template (messages).
      where: names the example in errors (e.g. "data/a.jsonl:12").

    Returns:
      The `Example`. Every format but messages ends with the tokenizer's end-of-text id (its
      separator for one without), learned with the completion.

    Raises:
      DataError / TemplateError: a missing field or a template that gives no spans (one line).

    Example:
      >>> ex = render({"messages": msgs}, "messages", tok, train_on="assistant", template=chat_template_of(d))
    """
    fields = dict(fields or {})
    pieces = _pieces(record, fmt, fields, template, train_on, where)
    ids, mask = [], []
    for text, learned in pieces:
        t = np.asarray(tokenizer.encode(text), dtype=np.int64) if text else np.zeros(0, np.int64)
        ids.append(t)
        mask.append(np.full(len(t), learned, bool))
    if fmt != "messages":  # the end of the example is learned with its last piece (EOS is learned even when pad)
        end = np.asarray(separator_ids(tokenizer), np.int64)
        ids.append(end)
        mask.append(np.full(len(end), pieces[-1][1], bool))
    tokens, targets = np.concatenate(ids), np.concatenate(mask)
    targets[:1] = False  # the first token is predicted from nothing: never a target
    return Example(tokens, targets)


def read_records(source: str, bad_lines: float = 0.0) -> Iterator[tuple[str, str, dict]]:
    """Every record of a jsonl/parquet source, in order: (file relative path, key "<rel>:<index>", record).

    Args:
      source: a jsonl/parquet file, a directory of them or a glob (`shard_files`).
      bad_lines: the fraction of lines per file that may be skipped as not JSON objects.

    Returns:
      An iterator of (rel, key, record dict).

    Raises:
      DataError: an unreadable file, or more bad lines than allowed (one line).

    Example:
      >>> for rel, key, record in read_records("data/sft.jsonl"): ...
    """
    files, root = shard_files(source)
    for path in files:
        rel = path.relative_to(root).as_posix()
        records = _parquet_records(path) if shard_kind(path) == "parquet" else _jsonl_records(path, BadLines(bad_lines))
        for i, record in enumerate(records):
            yield rel, f"{rel}:{i}", record


def first_record(source: str) -> dict | None:
    """The first record of a jsonl/parquet source (a parquet file's first row only is read), or None.

    Example:
      >>> first_record("data/sft.jsonl")
      {'prompt': '...', 'completion': '...'}
    """
    files, _ = shard_files(source)
    for path in files:
        if shard_kind(path) == "parquet":
            rows = _parquet_records(path, batch_size=1)
        else:
            rows = _jsonl_records(path, BadLines(1.0))
        for record in rows:
            return record
    return None


def _jsonl_records(path: Path, bad: BadLines) -> Iterator[dict]:
    """The JSON objects of a jsonl file (bad lines counted against the policy)."""
    with open(path, "rb") as raw:
        f = gzip.GzipFile(fileobj=raw) if str(path).endswith(".gz") else raw
        try:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                bad.lines += 1
                try:
                    record = json.loads(line)
                except ValueError:
                    bad.bad(f"{path}:{number}")
                    continue
                if isinstance(record, dict):
                    yield record
                else:
                    bad.bad(f"{path}:{number}")
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise DataError(f"{path}: cannot be read ({exc}); replace the file") from None
    bad.check(path)


def _parquet_records(path: Path, batch_size: int = 4096) -> Iterator[dict]:
    """The rows of a parquet file as dicts, read `batch_size` rows at a time."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow: pip install pyarrow") from None
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
            yield from batch.to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow's own errors, named with the file
        raise DataError(f"{path}: cannot be read as parquet ({exc}); replace the file") from None
