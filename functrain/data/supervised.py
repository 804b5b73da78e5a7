"""Supervised examples: the formats users bring, rendered to tokens with a per-token target mask.

Internals: docs/internals.md "functrain.data.supervised".

Example:
    >>> fmt = detect_format({"prompt": "2+2=", "completion": "4"}, {})
    >>> ex = render({"prompt": "2+2=", "completion": "4"}, fmt, ByteTokenizer(), train_on="completion")
    >>> ex.tokens[ex.targets]          # the bytes of "4" and the end-of-text separator
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
import functools
import gzip
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from jinja2 import nodes
from jinja2.ext import Extension

from functrain.data.errors import DataError
from functrain.data.shards import BadLines, shard_files, shard_kind
from functrain.data.tokenizer import separator_ids

__all__ = [
    "IGNORE",
    "ALPACA_PROMPT",
    "DEFAULT_CHAT_TEMPLATE",
    "FORMATS",
    "TRAIN_ON",
    "ChatTemplate",
    "Example",
    "TemplateError",
    "chat_template_of",
    "detect_format",
    "example_end",
    "first_record",
    "has_chat_template",
    "read_records",
    "render",
    "resolve_train_on",
]

FORMATS = ("prompt_completion", "messages", "alpaca", "text", "preference", "prompts")
"""The supervised formats (`data.format`; "auto" finds one from a record's fields); "preference" records are
pairs (`functrain.data.pairs`), "prompts" records a prompt alone to sample from (`functrain.data.prompts`)."""

IGNORE = -1
"""The target id of a token that is not learned (the families' `ignore_index`)."""

TRAIN_ON = ("completion", "assistant", "last", "all")
"""What `data.train_on` can learn ("auto": completion, or assistant for messages)."""

_FIELDS = {
    "prompt_completion": ("prompt", "completion"),
    "messages": ("messages",),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
    "preference": ("chosen", "rejected"),
    "prompts": ("prompt",),
}
_ALLOWED = {
    "prompt_completion": ("completion", "all"),
    "alpaca": ("completion", "all"),
    "messages": ("assistant", "last", "all"),
    "text": ("all",),
    "preference": ("completion",),
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
    for fmt in ("preference", "messages", "prompt_completion", "alpaca", "text"):
        if all(fields.get(f, f) in have for f in _FIELDS[fmt]):
            return fmt
    pair = [fields.get(f, f) for f in _FIELDS["preference"]]
    if have & set(pair):
        raise DataError(
            f"a record with fields {sorted(have)[:12]} is half a preference pair: it needs both {pair[0]!r} and "
            f"{pair[1]!r}; add the missing one, or map the names with --config.data.fields"
        )
    if fields.get("prompt", "prompt") in have:  # a prompt alone: to sample completions of (GRPO)
        return "prompts"
    raise DataError(
        f"a record with fields {sorted(have)[:12]} is in no supervised format (prompt/completion, "
        "messages, instruction/input/output, text, chosen/rejected pairs, prompts alone); set --config.data.format and "
        "map the names with --config.data.fields (e.g. {'prompt': 'question', 'completion': 'answer'})"
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


_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


class ChatTemplate:
    """A Hugging Face chat template (Jinja), rendered as transformers renders it.

    Args:
      source: the template text.
      special: the variables templates read besides `messages`: `bos_token`, `eos_token`, `pad_token`,
        `unk_token` (the tokenizer's `SpecialTokens.template_vars()`).
      name: where the template comes from (a file, "<dir>/tokenizer_config.json"): errors name it and the line.

    Attributes:
      has_generation: the template marks the assistant's text with `{% generation %}` blocks; then
        those blocks are what `train_on="assistant"` learns (transformers' `return_assistant_tokens_mask`).

    Example:
      >>> t = ChatTemplate(DEFAULT_CHAT_TEMPLATE)
      >>> t.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
      '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'
    """

    def __init__(self, source: str, special: Mapping[str, str] | None = None, name: str = "the chat template"):
        self.source = source
        self.special = dict(special or {})
        self.name = name
        self.has_generation = bool(_GENERATION.search(source))
        try:
            self._template = _jinja_env().from_string(source)
        except Exception as exc:  # noqa: BLE001 - jinja2's syntax errors, named with the line
            raise TemplateError(
                f"{name}:{getattr(exc, 'lineno', '?')}: not a Jinja template ({exc}); fix it or pass another "
                "(--config.data.chat_template)"
            ) from None

    def render(self, messages: list, *, add_generation_prompt: bool = False) -> str:
        """The conversation as text.

        Args:
          messages: [{"role", "content"}, ...].
          add_generation_prompt: end with the template's assistant header (what generation continues).

        Returns:
          The rendered text.
        """
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)

    def render_spans(self, messages: list) -> tuple[str, list[tuple[int, int]]]:
        """The conversation as text and the (start, end) characters of each `{% generation %}` block in it.

        Example:
          >>> text, spans = template.render_spans(msgs)      # spans: the assistant turns' text
        """
        spans: list[tuple[int, int]] = []
        pieces: list[str] = []
        token = _TRACKER.set((pieces, spans))
        try:
            for piece in self._template.generate(messages=messages, add_generation_prompt=False, **self.special):
                pieces.append(piece)
        finally:
            _TRACKER.reset(token)
        return "".join(pieces), spans

    def where(self, exc: BaseException) -> str:
        """`name:line` of the template line an exception was raised at (the name alone when unknown)."""
        tb, line = exc.__traceback__, None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == "<template>":
                line = tb.tb_lineno
            tb = tb.tb_next
        return f"{self.name}:{line}" if line is not None else self.name


_TRACKER: contextvars.ContextVar = contextvars.ContextVar("functrain_generation_spans", default=None)


class _GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body and, while `render_spans` runs, records where."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

    def _track(self, caller) -> str:
        text = caller()
        tracking = _TRACKER.get()
        if tracking is not None:
            pieces, spans = tracking
            start = sum(len(p) for p in pieces)
            spans.append((start, start + len(text)))
        return text


def _raise(message: str):
    """The templates' `raise_exception`."""
    raise TemplateError(f"the chat template refused a conversation: {message}")


@functools.lru_cache(maxsize=1)
def _jinja_env():
    """A sandboxed Jinja environment with what chat templates use (as transformers sets it up)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        """Jinja's tojson as transformers defines it (no HTML escaping)."""
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, "jinja2.ext.loopcontrols"]
    )
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


def chat_template_of(directory: str | Path | None, special: Mapping[str, str] | None = None) -> ChatTemplate:
    """The chat template of a model (or tokenizer) directory, or `DEFAULT_CHAT_TEMPLATE`.

    Reads `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string, or a list of
    {name, template}: the one named "default").

    Args:
      directory: the directory, or None (the default template).
      special: the template's special-token variables (the tokenizer's `special.template_vars()`); default
        tokenizer_config.json's `bos_token` / `eos_token`.

    Returns:
      A `ChatTemplate`.

    Example:
      >>> chat_template_of("runs/hf/export").render([{"role": "user", "content": "hi"}])
    """
    source, name, found = None, "the default chat template", {}
    d = Path(directory) if directory is not None else None
    config = d / "tokenizer_config.json" if d is not None else None
    if config is not None and config.is_file():
        cfg = json.loads(config.read_text())
        source = cfg.get("chat_template")
        if isinstance(source, list):
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        name = f"{config} (chat_template)"
        for key in ("bos_token", "eos_token"):
            tok = cfg.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            if isinstance(tok, str):
                found[key] = tok
    if d is not None and (d / "chat_template.jinja").is_file():
        source, name = (d / "chat_template.jinja").read_text(), str(d / "chat_template.jinja")
    if not source:
        name = "the default chat template"
    return ChatTemplate(source or DEFAULT_CHAT_TEMPLATE, found if special is None else special, name)


def _field(record: Mapping, fields: Mapping[str, str], name: str, default=None):
    """`record`'s value for format field `name` (renamed by `fields`); `default` where it is optional."""
    key = fields.get(name, name)
    if key not in record:
        if default is not None:
            return default
        raise DataError(f"no field {key!r} (fields: {', '.join(list(record)[:12])}); map it with --config.data.fields")
    value = record[key]
    if value is None and default is None:
        raise DataError(f"field {key!r} is null; give it a value or leave the record out")
    return default if value is None else value


def _text(value, key: str) -> str:
    """A field's value, which must be a string."""
    if not isinstance(value, str):
        raise DataError(f"field {key!r} is a {type(value).__name__}, not text")
    return value


def _messages(messages) -> list[dict]:
    """A conversation as [{"role", "content"}] (other keys dropped)."""
    if not isinstance(messages, list) or not all(
        isinstance(m, Mapping) and "role" in m and "content" in m for m in messages
    ):
        raise DataError("messages must be a list of {'role', 'content'} objects")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _rendered(template: ChatTemplate, messages: list[dict], **options) -> Any:
    """`template.render(messages, **options)` (`spans=True`: `render_spans`), a template's own failure as one line
    naming the template's file:line."""
    try:
        return template.render_spans(messages) if options.pop("spans", False) else template.render(messages, **options)
    except TemplateError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template's own error, named with the template's line
        raise TemplateError(
            f"the chat template failed at {template.where(exc)} ({type(exc).__name__}: {exc}); fix the "
            "record or the template (--config.data.chat_template)"
        ) from None


def _message_pieces(messages: list[dict], template: ChatTemplate, train_on: str) -> list[tuple[str, bool]]:
    """(text, learned) pieces of a conversation, from rendering it one message at a time."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    learned = set(turns[-1:]) if train_on == "last" else set(turns)
    pieces, done, done_n = [], "", 0

    def extend(text: str, target: bool, n: int) -> None:
        nonlocal done, done_n
        if not text.startswith(done):
            raise TemplateError(
                f"the chat template renders the first {done_n} message(s) differently inside the first {n}, "
                "so the turns' spans are unknown (e.g. a template that rewrites earlier turns); use a template that "
                "renders each prefix as the start of the next, or marks the assistant's text with {% generation %} "
                "(--config.data.chat_template), or --config.data.train_on=all"
            )
        pieces.append((text[len(done) :], target))
        done, done_n = text, n

    for i, m in enumerate(messages):
        if m["role"] == "assistant":  # its header is prompt, its content and end of turn are learned
            extend(_rendered(template, messages[:i], add_generation_prompt=True), False, i)
        extend(_rendered(template, messages[: i + 1]), i in learned, i + 1)
    return pieces


def _whole_example(messages: list[dict], template: ChatTemplate, tokenizer, train_on: str) -> Example:
    """A conversation rendered once and tokenized whole (as transformers' `apply_chat_template`): every token learned
    with `train_on="all"`, else those overlapping its `{% generation %}` blocks (`return_assistant_tokens_mask`)."""
    text, spans = _rendered(template, messages, spans=True)
    if train_on == "last":
        spans = spans[-1:]
    ids, offsets = tokenizer.encode_with_offsets(text)
    targets = np.zeros(len(ids), bool)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        targets[i] = end > spans[k][0]
    if train_on == "all":
        targets[:] = True
    return Example(np.asarray(ids, np.int64), targets)


def _pieces(record: Mapping, fmt: str, fields: Mapping[str, str], train_on: str) -> list[tuple[str, bool]]:
    """The (text, learned) pieces of one example of a format other than messages."""
    completion = train_on in ("completion", "all")
    if fmt == "text":
        return [(_text(_field(record, fields, "text"), "text"), True)]
    if fmt == "prompt_completion":
        prompt = _text(_field(record, fields, "prompt"), "prompt")
        answer = _text(_field(record, fields, "completion"), "completion")
    else:  # alpaca
        instruction = _text(_field(record, fields, "instruction"), "instruction")
        extra = _text(_field(record, fields, "input", ""), "input")
        answer = _text(_field(record, fields, "output"), "output")
        prompt = ALPACA_PROMPT.format(
            context=", paired with an input that provides further context" if extra else "",
            instruction=instruction,
            input=f"### Input:\n{extra}\n\n" if extra else "",
        )
    return [(prompt, train_on == "all"), (answer, completion)]


def example_end(tokenizer) -> list[int]:
    """The ids every example of a format other than messages ends with: the tokenizer's EOS; for one with no
    special tokens at all (bytes), its separator.

    Raises:
      DataError: a `tokenizers` vocabulary in which no EOS was found (one line naming `data.eos_token`).

    Example:
      >>> example_end(HFTokenizer("Qwen2.5-0.5B-Instruct"))       # [151645]: <|im_end|>
    """
    if tokenizer.eos_id is not None:
        return [tokenizer.eos_id]
    if getattr(tokenizer, "path", None) is not None:
        raise DataError(
            f"{tokenizer.path}: no end-of-text token found (no eos_token in a tokenizer_config.json beside it, nor "
            "a known end-of-text name in its vocabulary), so examples could not end and the model would never "
            "learn to stop; name it with --config.data.eos_token=<token of its vocabulary>"
        )
    return separator_ids(tokenizer)


def render(
    record: Mapping,
    fmt: str,
    tokenizer,
    *,
    train_on: str,
    fields: Mapping[str, str] | None = None,
    template: ChatTemplate | None = None,
) -> Example:
    """One example's tokens and target mask.

    Args:
      record: the example (a parsed JSON object / parquet row).
      fmt: one of `FORMATS`.
      tokenizer: a functrain tokenizer (`encode(text) -> ids`, no special tokens added; `special`).
      train_on: a resolved `TRAIN_ON` choice (`resolve_train_on`).
      fields: {format field: the record's field}.
      template: the chat template (messages).

    Returns:
      The `Example`. A conversation is the template's text: tokenized whole where the template has
      `{% generation %}` blocks (what `assistant` learns) or `train_on="all"`, else one message at a time
      (the spans of the assistant turns: each prefix must render as the start of the next); every other
      format is the tokenizer's prefix (Llama-3's BOS), the text, EOS (`example_end`; not added again after a
      text that ends with it, as TRL) learned with the completion, and the tokenizer's suffix.

    Raises:
      DataError / TemplateError: a missing field or a template that gives no spans (one line; the caller
        names the record: `examples` prefixes its file and index).

    Example:
      >>> ex = render({"messages": msgs}, "messages", tok, train_on="assistant", template=chat_template_of(d))
    """
    fields = dict(fields or {})
    special = tokenizer.special
    if fmt == "preference":
        raise DataError("a preference record is a pair of examples: functrain.data.pairs.render_pair renders it")
    if fmt == "messages":
        if template is None:
            raise DataError("a messages record is rendered by a chat template, and none was given")
        messages = _messages(_field(record, fields, "messages"))
        if template.has_generation or train_on == "all":
            return _whole_example(messages, template, tokenizer, train_on)
        pieces, start, end = _message_pieces(messages, template, train_on), [], []
    else:
        pieces = _pieces(record, fmt, fields, train_on)
        ends_with_eos = special.eos is not None and pieces[-1][0].endswith(special.eos)
        start, end = list(special.prefix), ([] if ends_with_eos else example_end(tokenizer)) + list(special.suffix)
    ids, mask = [np.asarray(start, np.int64)], [np.zeros(len(start), bool)]
    for text, learned in pieces:
        t = np.asarray(tokenizer.encode(text), dtype=np.int64) if text else np.zeros(0, np.int64)
        ids.append(t)
        mask.append(np.full(len(t), learned, bool))
    ids.append(np.asarray(end, np.int64))  # the end of the example is learned with its last piece (EOS even when pad)
    mask.append(np.full(len(end), bool(pieces) and pieces[-1][1], bool))
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
