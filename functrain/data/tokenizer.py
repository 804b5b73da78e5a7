"""Tokenizers that turn text into token ids and back: bytes, a vocabulary table, bare ids, or a
Hugging Face `tokenizers` tokenizer (a `tokenizer.json`: a model's own, or a byte-level BPE trained
offline on the user's text by `train_bpe`).

Example:
    >>> tok = train_bpe(["def f(x):\n    return x\n"] * 100, 300, "runs/llama/data/bpe.json")
    >>> tok.decode(tok.encode("def f"))
    'def f'
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from functrain.data.errors import DataError
from functrain.data.special_tokens import END_OF_TEXT_NAMES, SpecialTokens, read_special_tokens

__all__ = ["ByteTokenizer", "VocabTokenizer", "IdTokenizer", "HFTokenizer", "train_bpe", "END_OF_TEXT", "SEPARATOR"]

SEPARATOR = b"\n"
"""What joins documents in byte-level token files (a tokenizer with an end-of-text id uses that)."""


def separator_ids(tokenizer) -> list[int]:
    """The ids joining documents: the tokenizer's end-of-text token, else its encoding of SEPARATOR."""
    eos = getattr(tokenizer, "eos_id", None)
    return [eos] if eos is not None else [int(t) for t in tokenizer.encode(SEPARATOR.decode())]


END_OF_TEXT = "<|endoftext|>"
"""The document separator token `train_bpe` adds (GPT-2's name for it)."""


def _as_ids(tokens) -> list[int]:
    """Token ids from a list, numpy array or torch tensor, as Python ints."""
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    return [int(t) for t in tokens]


class ByteTokenizer:
    """Byte-level tokens: the UTF-8 bytes of the text, vocabulary 256.

    Example:
      >>> tok = ByteTokenizer()
      >>> tok.decode(tok.encode("héllo"))
      'héllo'
    """

    name = "bytes"
    vocab_size = 256
    special = SpecialTokens()  # no special tokens: examples and documents end with SEPARATOR
    eos_id = None

    def encode(self, text: str) -> np.ndarray:
        """Encodes text.

        Args:
          text: any string.

        Returns:
          An int64 array of its UTF-8 bytes.

        Example:
          >>> ByteTokenizer().encode("ab")
          array([97, 98])
        """
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """The ids of `text` and, for each, the (start, end) characters it comes from (`HFTokenizer`'s form).

        Example:
          >>> ByteTokenizer().encode_with_offsets("é")
          (array([195, 169]), [(0, 1), (0, 1)])
        """
        spans = [(i, i + 1) for i, c in enumerate(text) for _ in range(len(c.encode("utf-8")))]
        return self.encode(text), spans

    def decode(self, tokens) -> str:
        """Decodes token ids to text (invalid UTF-8, e.g. a cut multi-byte character, becomes U+FFFD).

        Args:
          tokens: ids in [0, 256): a list, numpy array or torch tensor.

        Returns:
          The decoded string.

        Example:
          >>> ByteTokenizer().decode([104, 105])
          'hi'
        """
        return bytes(t & 0xFF for t in _as_ids(tokens)).decode("utf-8", errors="replace")


class VocabTokenizer:
    """A fixed table of strings (nanoGPT `meta.pkl`'s `itos`/`stoi`, e.g. character-level text).

    Args:
      itos: id -> string, as a mapping or a sequence indexed by id.
      stoi: string -> id; built from `itos` when not given.

    Example:
      >>> tok = VocabTokenizer(itos={0: "a", 1: "b"})
      >>> tok.decode(tok.encode("abba"))
      'abba'
    """

    name = "vocab"
    special = SpecialTokens()
    eos_id = None

    def __init__(self, itos: Mapping[int, str] | Iterable[str], stoi: Mapping[str, int] | None = None):
        items = itos.items() if isinstance(itos, Mapping) else enumerate(itos)
        self.itos = {int(i): str(s) for i, s in items}
        self.stoi = dict(stoi) if stoi is not None else {s: i for i, s in self.itos.items()}
        self.vocab_size = max(self.itos) + 1 if self.itos else 0

    def encode(self, text: str) -> np.ndarray:
        """Encodes text one character at a time (every character must be in the table).

        Args:
          text: a string over the vocabulary.

        Returns:
          An int64 array of ids.

        Example:
          >>> VocabTokenizer(["a", "b"]).encode("ba")
          array([1, 0])
        """
        missing = sorted(set(text) - set(self.stoi))
        if missing:
            raise DataError(f"characters {missing[:10]!r} are not in the dataset's vocabulary")
        return np.array([self.stoi[c] for c in text], dtype=np.int64)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """The ids of `text` and the (start, end) character of each (one character a token)."""
        return self.encode(text), [(i, i + 1) for i in range(len(text))]

    def decode(self, tokens) -> str:
        """Decodes ids by table lookup (unknown ids become U+FFFD).

        Args:
          tokens: a list, numpy array or torch tensor of ids.

        Returns:
          The decoded string.

        Example:
          >>> VocabTokenizer(["a", "b"]).decode([1, 0])
          'ba'
        """
        return "".join(self.itos.get(t, "\ufffd") for t in _as_ids(tokens))


class IdTokenizer:
    """Fallback for token files with no known tokenizer: text is space-separated ids.

    Args:
      vocab_size: the number of ids.

    Example:
      >>> IdTokenizer(50304).decode([15496, 995])
      '15496 995'
    """

    name = "ids"
    special = SpecialTokens()
    eos_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)

    def encode(self, text: str) -> np.ndarray:
        """Parses space-separated integer ids.

        Args:
          text: e.g. "15496 995".

        Returns:
          An int64 array of ids.

        Example:
          >>> IdTokenizer(100).encode("1 2")
          array([1, 2])
        """
        try:
            return np.array([int(t) for t in text.split()], dtype=np.int64)
        except ValueError:
            raise DataError(
                "this token dataset has no tokenizer (no itos in meta.json/meta.pkl); "
                "give the prompt as space-separated token ids"
            ) from None

    def decode(self, tokens) -> str:
        """Renders ids as space-separated integers.

        Args:
          tokens: a list, numpy array or torch tensor of ids.

        Returns:
          A string such as "15496 995".

        Example:
          >>> IdTokenizer(100).decode([1, 2])
          '1 2'
        """
        return " ".join(str(t) for t in _as_ids(tokens))


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer read from a `tokenizer.json`, with the special tokens of the
    configs beside it as transformers reads them (`functrain.data.special_tokens`).

    Args:
      path: the `tokenizer.json` (or a directory holding one).
      eos_token: the end-of-text token to use instead of the directory's (`data.eos_token`), or None.

    Attributes:
      vocab_size: number of ids (special tokens included).
      special: the `SpecialTokens` (BOS, EOS, PAD, what the tokenizer adds around a text, stop ids).
      eos_id: the end-of-text id (tokenizer_config.json's `eos_token`; for a bare tokenizer.json the first
        of `special_tokens.END_OF_TEXT_NAMES` it holds), or None. Examples end with it, documents of
        token files are joined with it.
      sha256: the file's hash.
      identity: "tokenizers:<sha256>[:<special tokens' digest>]": token caches and data records are keyed by it.

    Raises:
      DataError: the file is missing or not a tokenizer, or a config names a token it lacks (one line).

    Example:
      >>> tok = HFTokenizer("SmolLM-135M/tokenizer.json")
      >>> tok.decode(tok.encode("def main():"))
      'def main():'
    """

    def __init__(self, path: str | os.PathLike, eos_token: str | None = None):
        from tokenizers import Tokenizer

        path = Path(path).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        try:
            raw = path.read_bytes()
            self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        except FileNotFoundError:
            raise DataError(
                f"{path}: no such tokenizer file; give a tokenizer.json or a directory holding one"
            ) from None
        except Exception as exc:  # noqa: BLE001 - tokenizers raises its own Exception type
            raise DataError(f"{path}: not a tokenizers file ({str(exc).splitlines()[0]})") from None
        self.path = path
        self.eos_token = eos_token or None
        self.name = f"tokenizers:{path.name}"
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special = read_special_tokens(self._tok, path.parent, self.eos_token)
        self.eos_id = self.special.eos_id
        marks = [self.special.eos_id, list(self.special.prefix), list(self.special.suffix)]
        guess = (self._tok.token_to_id(t) for t in END_OF_TEXT_NAMES)  # what the identity held before configs
        default: list = [next((i for i in guess if i is not None), None), [], []]
        digest = hashlib.sha256(json.dumps(marks).encode()).hexdigest()[:8]
        self.identity = f"tokenizers:{self.sha256}" + ("" if marks == default else f":{digest}")

    def encode(self, text: str) -> np.ndarray:
        """Encodes text (no special tokens added).

        Args:
          text: a string.

        Returns:
          An int64 array of ids.

        Example:
          >>> tok.encode("hello")
        """
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """The ids of `text` (no special tokens added) and the (start, end) characters each comes from.

        Example:
          >>> ids, offsets = tok.encode_with_offsets("hello world")
        """
        enc = self._tok.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, dtype=np.int64), [(int(a), int(b)) for a, b in enc.offsets]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encodes many texts at once (in parallel threads).

        Args:
          texts: strings.

        Returns:
          One id list per text.

        Example:
          >>> tok.encode_batch(["a", "b"])
        """
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, tokens) -> str:
        """Decodes ids to text (special tokens kept, so document breaks stay visible).

        Args:
          tokens: a list, numpy array or torch tensor of ids.

        Returns:
          The text.

        Example:
          >>> tok.decode([15496, 995])
        """
        return self._tok.decode(_as_ids(tokens), skip_special_tokens=False)


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | os.PathLike) -> HFTokenizer:
    """Trains a byte-level BPE tokenizer (GPT-2 style, `tokenizers`) and saves it as `path`.

    Every byte is in the initial alphabet, so any text encodes; `<|endoftext|>` is its one special
    token (id 0). Training is deterministic: the same texts give the same file.

    Args:
      texts: the training text, e.g. one string per file.
      vocab_size: ids in the result (256 bytes + 1 special + merges); at least 257.
      path: where to write the `tokenizer.json` (atomically).

    Returns:
      The trained `HFTokenizer`.

    Example:
      >>> tok = train_bpe((p.read_text() for p in files), 4096, "runs/llama/data/bpe-4096.json")
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise DataError(f"a byte-level BPE needs vocab_size >= 257 (256 bytes + {END_OF_TEXT}), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(
            f"tokenizer cache {path.parent}: cannot be created ({exc.strerror or exc}); pass a writable "
            "--workdir or --config.data.cache_dir"
        ) from None
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(tok.to_str())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return HFTokenizer(path)
