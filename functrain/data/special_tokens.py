"""A tokenizer directory's special tokens, read as transformers reads them: BOS, EOS and PAD from
`tokenizer_config.json` (else `special_tokens_map.json`), what the tokenizer adds around a text (its
`tokenizer.json` post-processor: Llama-3's BOS), and the ids generation stops at (`generation_config.json`).

Example:
    >>> d = Path("Qwen2.5-0.5B-Instruct")
    >>> st = read_special_tokens(Tokenizer.from_file(str(d / "tokenizer.json")), d)
    >>> st.eos, st.prefix, st.stop_ids         # '<|im_end|>', (), (151645, 151643)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from functrain.data.errors import DataError

__all__ = ["END_OF_TEXT_NAMES", "SpecialTokens", "read_special_tokens"]

END_OF_TEXT_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>", "<eos>")
"""The end-of-text tokens looked for in a bare tokenizer.json (one with no tokenizer_config.json beside it)."""

_PROBE = "a b"  # a text every byte-level or SentencePiece vocabulary encodes to ordinary tokens


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """What a tokenizer's special tokens are and where they go.

    Attributes:
      bos, eos, pad, unk: the tokens' text (None where the tokenizer has none).
      bos_id, eos_id, pad_id: their ids.
      prefix, suffix: the ids the tokenizer adds before and after a text (`add_special_tokens=True`).
      stop_ids: the ids generation stops at: EOS, then generation_config.json's eos_token_id.
      eos_from: where EOS was read ("tokenizer_config.json", "data.eos_token", ...), for the log line.
    """

    bos: str | None = None
    eos: str | None = None
    pad: str | None = None
    unk: str | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    stop_ids: tuple[int, ...] = ()
    eos_from: str = ""

    def template_vars(self) -> dict[str, str]:
        """The variables a chat template reads besides `messages` (transformers passes its special tokens map)."""
        named = {"bos_token": self.bos, "eos_token": self.eos, "pad_token": self.pad, "unk_token": self.unk}
        return {k: v for k, v in named.items() if v is not None}


def _json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when absent."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not JSON ({exc}); fix or remove the file") from None
    return value if isinstance(value, dict) else {}


def _content(token) -> str | None:
    """A config's token entry as text (a string, or an AddedToken object's `content`)."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def _ids(value) -> list[int]:
    """An `eos_token_id` entry (an int, a list of ints or None) as a list."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    return [int(v) for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _added(tokenizer) -> tuple[list[int], list[int]]:
    """(prefix, suffix): the ids the post-processor puts around a text's own."""
    plain = tokenizer.encode(_PROBE, add_special_tokens=False).ids
    full = tokenizer.encode(_PROBE, add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return [], []  # a post-processor that rewrites the text's ids: nothing added that can be told apart


def read_special_tokens(tokenizer, directory: Path | None, eos_override: str | None = None) -> SpecialTokens:
    """The special tokens of a `tokenizers.Tokenizer` and the configs in its directory.

    Args:
      tokenizer: the `tokenizers.Tokenizer` (its vocabulary and post-processor).
      directory: the directory holding it (tokenizer_config.json, special_tokens_map.json,
        generation_config.json, config.json are read where present), or None.
      eos_override: `data.eos_token`: the end-of-text token to use instead of the configs' (None: theirs).

    Returns:
      The `SpecialTokens`. EOS comes from `eos_override`, else tokenizer_config.json's `eos_token` (else
      special_tokens_map.json's), else, for a tokenizer.json with neither file, the first of
      `END_OF_TEXT_NAMES` in its vocabulary; None when none of these names one.

    Raises:
      DataError: a config or `eos_override` that names a token the vocabulary lacks (one line).

    Example:
      >>> read_special_tokens(tok, Path("Meta-Llama-3-8B-Instruct")).prefix    # (128000,): its BOS
    """
    d = directory
    config = _json(d / "tokenizer_config.json") if d is not None else {}
    smap = _json(d / "special_tokens_map.json") if d is not None else {}
    configured = bool(config or smap)

    def named(key: str) -> str | None:
        return _content(config.get(key)) if key in config else _content(smap.get(key))

    def id_of(token: str | None, where: str) -> int | None:
        if token is None:
            return None
        i = tokenizer.token_to_id(token)
        if i is None:
            raise DataError(
                f"{where} names {token!r}, which the tokenizer's vocabulary does not hold; "
                "set --config.data.eos_token to a token it has"
            )
        return int(i)

    eos, eos_from = named("eos_token"), "tokenizer_config.json" if "eos_token" in config else "special_tokens_map.json"
    if eos_override:
        eos, eos_from = eos_override, "data.eos_token"
    elif eos is None and not configured:
        eos = next((t for t in END_OF_TEXT_NAMES if tokenizer.token_to_id(t) is not None), None)
        eos_from = f"the vocabulary's {eos} (no tokenizer_config.json)"
    where = f"{d / 'tokenizer_config.json'}" if d is not None else "the tokenizer"
    eos_id = id_of(eos, "data.eos_token" if eos_override else where)
    bos, pad, unk = named("bos_token"), named("pad_token"), named("unk_token")
    prefix, suffix = _added(tokenizer)
    generation = _json(d / "generation_config.json") if d is not None else {}
    model = _json(d / "config.json") if d is not None and not generation else {}
    stops = [eos_id] if eos_id is not None else []
    for i in _ids((generation or model).get("eos_token_id")):
        if i not in stops:
            stops.append(i)
    return SpecialTokens(
        bos=bos,
        eos=eos,
        pad=pad,
        unk=unk,
        bos_id=id_of(bos, where),
        eos_id=eos_id,
        pad_id=id_of(pad, where),
        prefix=tuple(prefix),
        suffix=tuple(suffix),
        stop_ids=tuple(stops),
        eos_from=eos_from if eos is not None else "",
    )
