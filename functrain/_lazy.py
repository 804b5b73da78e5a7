"""Lazy re-exports for package `__init__`s (PEP 562): a public name is imported on first use.

So `import functrain` (which every config file does, for `functrain.defaults`) does not import torch,
and `python -m functrain.main` checks the config and flags first, in ~0.3 s instead of ~3 s: a bad
value is reported before the heavy modules load.

Example (a package's `__init__.py`):
    >>> __getattr__, __dir__ = lazy_exports(__name__, {"chain": "functrain.optim.base:chain",
    ...                                                 "config": "functrain.optim.config"})
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, table: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list]]:
    """The module-level `__getattr__` and `__dir__` of a package whose public names load on first use.

    Args:
      package: the package's `__name__`.
      table: public name -> "module" (a submodule, e.g. "functrain.optim.config") or "module:attribute".

    Returns:
      `(__getattr__, __dir__)`, to assign at the package's top level. A name is imported once and then
      cached in the package's namespace.

    Example:
      >>> __getattr__, __dir__ = lazy_exports(__name__, {"TrainState": "functrain.state:TrainState"})
    """

    def __getattr__(name: str) -> object:
        try:
            module, _, attribute = table[name].partition(":")
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = importlib.import_module(module)
        if attribute:
            value = getattr(value, attribute)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list:
        return sorted(set(table) | set(vars(sys.modules[package])))

    return __getattr__, __dir__
