"""Memory readings shared by the benchmarks (Linux RSS on CPU).

On CPU, torch's allocations show only in the kernel's accounting of the process: the resident set
size (`VmRSS`) and its high-water mark (`VmHWM`), which writing "5" to /proc/self/clear_refs resets
to the current RSS (Linux >= 4.0). `trim()` first hands freed heap back to the OS, so that a step's
allocations grow RSS instead of reusing memory malloc kept from earlier work.

Example:
    >>> trim(); base = status_mib("VmRSS"); reset_peak()
    >>> run_step()
    >>> growth = status_mib("VmHWM") - base
"""

from __future__ import annotations

import ctypes
import gc


def status_mib(field: str) -> float:
    """A /proc/self/status field (`VmRSS`, `VmHWM`) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(f"{field} not in /proc/self/status")


def trim() -> None:
    """Frees what Python and malloc hold but do not use, so RSS is the live memory."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def keep_freed() -> bool:
    """Makes malloc keep freed memory for reuse (as CUDA's caching allocator does); False where it cannot.

    glibc otherwise hands large freed blocks back to the OS, and a step whose activations grow
    page-faults its way through fresh memory every time (later microbatches of a GPipe step computed
    30-45% slower than the first). `trim()` still hands everything free back when asked."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt parameters (malloc.h)
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 40))
    except (OSError, AttributeError):
        return False


def exact() -> bool:
    """Makes the resident set follow live memory: every block of 64 KiB or more mapped on its own and
    handed back when freed (glibc otherwise raises that threshold as blocks are freed, and then keeps
    them: the high-water mark grows with what the step freed, not what it held). Slower; False where
    it cannot."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10))  # M_MMAP_THRESHOLD (malloc.h)
    except (OSError, AttributeError):
        return False


def reset_peak() -> bool:
    """Resets the RSS high-water mark to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
