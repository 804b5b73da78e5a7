"""Counts the reads of tensor values into Python (`.item()`, `float(t)`, `bool(t)`, ...) a block of
code makes: on an accelerator each one is a host sync. Used by the no-host-sync tests."""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import traceback

import torch

# The Tensor methods through which a value reaches Python (each waits for the device on a GPU).
READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


class Reads:
    """Per-label counts of the main thread's value reads (`label` is set by the caller, e.g. the
    running step), and where the first read of each label came from. Other threads (the batch
    prefetcher, the checkpoint writer) work on host copies and never hold up a step."""

    def __init__(self):
        self.label = None
        self.counts = collections.Counter()
        self.where: dict = {}

    def record(self, name, t):
        if self.label is None or threading.current_thread() is not threading.main_thread() or _in_compiled_cpu_code():
            return
        self.counts[self.label] += 1
        self.where.setdefault(self.label, f"Tensor.{name} at " + "".join(traceback.format_stack(limit=4)[:-2]).strip())


def _in_compiled_cpu_code() -> bool:
    """Whether the read comes from a compiled graph's generated code: on the CPU, inductor passes a
    0-d value of a host buffer to a C++ kernel as a scalar argument (`.item()` of host memory, no
    device to wait for). CUDA code is checked on a GPU with `torch.cuda.set_sync_debug_mode`."""
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        if "torch/_inductor/" in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def counting(reads: Reads):
    """Patches the `READS` methods of torch.Tensor to count into `reads` while the block runs."""
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, method):
        def counted(self, *args, **kwargs):
            reads.record(name, self)
            return method(self, *args, **kwargs)

        return counted

    try:
        for name, method in saved.items():
            setattr(torch.Tensor, name, wrap(name, method))
        yield reads
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
