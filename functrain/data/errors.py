"""The one exception the data package raises for unusable sources."""

from functrain.errors import FunctrainError

__all__ = ["DataError", "SOURCE_HINT"]

SOURCE_HINT = (
    "point --config.data.path at a text file, a directory of text files, parquet/jsonl shards, "
    "a directory with train.bin/val.bin, or 'stdlib'"
)
"""The fix named by a data error about the source itself."""


class DataError(FunctrainError, ValueError):
    """A data source cannot be used; the message is one line naming the path and the fix.

    Example:
      >>> raise DataError("data.path '/nope' does not exist; point --config.data.path at ...")
    """
