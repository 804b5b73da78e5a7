"""Data: corpora to cached token files, and stateless batches keyed by (seed, step, rank)."""

from functrain.data.batches import eval_batches, get_batch
from functrain.data.corpus import DEFAULT_VAL_FRACTION, SEPARATOR, Dataset, load_dataset, stdlib_files, train_tokenizer
from functrain.data.errors import DataError
from functrain.data.tokenizer import END_OF_TEXT, ByteTokenizer, HFTokenizer, IdTokenizer, VocabTokenizer, train_bpe

__all__ = [
    "ByteTokenizer",
    "DEFAULT_VAL_FRACTION",
    "DataError",
    "END_OF_TEXT",
    "HFTokenizer",
    "Dataset",
    "IdTokenizer",
    "SEPARATOR",
    "VocabTokenizer",
    "eval_batches",
    "get_batch",
    "load_dataset",
    "stdlib_files",
    "train_bpe",
    "train_tokenizer",
]
