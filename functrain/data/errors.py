"""The one exception the data package raises for unusable sources."""

__all__ = ["DataError"]


class DataError(ValueError):
    """A data source cannot be used; the message is one line naming the path and the fix.

    Example:
      >>> raise DataError("data.path '/nope' does not exist; point --config.data.path at ...")
    """
