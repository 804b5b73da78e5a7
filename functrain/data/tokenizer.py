"""Tokenizers that turn text into token ids and back: bytes, a vocabulary table, or bare ids."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from functrain.data.errors import DataError

__all__ = ["ByteTokenizer", "VocabTokenizer", "IdTokenizer"]


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
