"""Host memory: keep freed blocks in the process instead of handing them back to the OS.

Internals: docs/internals.md "functrain.trainer.memory".

Example:
    >>> from functrain import memory
    >>> memory.keep_freed_memory()   # True where glibc malloc is in use
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 1 << 40  # never give freed heap memory back


@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Makes glibc malloc keep freed memory in the process (see the module docstring).

    Returns:
      True if glibc's `mallopt` accepted both settings, False where there is no glibc (macOS,
      musl) or it refused: nothing changes then.

    Example:
      >>> keep_freed_memory()
      True
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_MAX, 0) == 1
    threshold = min(_TRIM_THRESHOLD, 2**31 - 1)  # mallopt takes an int
    return ok and mallopt(_M_TRIM_THRESHOLD, threshold) == 1
