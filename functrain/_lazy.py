"""Lazy re-exports for package `__init__`s (PEP 562; the idea of Scientific Python's SPEC 1).

Internals: docs/internals.md "functrain._lazy".

Example (a package's `__init__.py`):
    >>> from typing import TYPE_CHECKING
    >>> if TYPE_CHECKING:
    ...     from functrain.optim.base import chain
    >>> __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
"""

from __future__ import annotations

import ast
import functools
import importlib
import pkgutil
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["lazy_exports"]


def _static_imports(path: str) -> dict[str, str]:
    """name -> "module:attribute" for each `from module import name` under `if TYPE_CHECKING:`."""
    tree = ast.parse(Path(path).read_text())
    table = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                if not isinstance(statement, ast.ImportFrom) or statement.level:
                    raise SyntaxError(f"{path}: only absolute `from X import a, b` under TYPE_CHECKING")
                for alias in statement.names:
                    table[alias.asname or alias.name] = f"{statement.module}:{alias.name}"
    return table


def lazy_exports(package: str, path: str) -> tuple[Callable[[str], object], Callable[[], list], list[str]]:
    """The `__getattr__`, `__dir__` and `__all__` of a package whose public names load on first use.

    Args:
      package: the package's `__name__`.
      path: its `__file__`; the public names are the `from X import a, b` statements under its
        top-level `if TYPE_CHECKING:` (a name may be a submodule: `from functrain import optim`).

    Returns:
      `(__getattr__, __dir__, __all__)`, to assign at the package's top level. A name is imported on
      first access and then cached in the package's namespace.

    Example:
      >>> __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
    """
    table = _static_imports(path)

    @functools.cache
    def submodules() -> frozenset:
        """The package's own modules and subpackages (listed once, from its directory); a module has none."""
        if Path(path).name != "__init__.py":
            return frozenset()
        return frozenset(m.name for m in pkgutil.iter_modules([str(Path(path).parent)]))

    def __getattr__(name: str) -> object:
        if name not in table and name in submodules():
            return importlib.import_module(f"{package}.{name}")  # a submodule, reached as an attribute
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module_name, _, attribute = table[name].partition(":")
        module = importlib.import_module(module_name)
        if attribute not in vars(module):  # a submodule not imported yet (or a lazy package's name)
            try:
                importlib.import_module(f"{module_name}.{attribute}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{module_name}.{attribute}":
                    raise
        value = getattr(module, attribute)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list:
        return sorted(set(table) | set(vars(sys.modules[package])))

    return __getattr__, __dir__, list(table)
