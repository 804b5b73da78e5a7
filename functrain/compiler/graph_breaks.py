"""A graph break in a user's module, told in one line with the two ways on.

Internals: docs/internals.md "functrain.compiler.graph_breaks".

Example:
    >>> with graph_breaks.explained():
    ...     state, metrics = compiled_step(state, batch)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
import torch._dynamo.exc as dynamo_exc

from functrain.errors import FunctrainError

__all__ = ["GraphBreakError", "explained", "describe"]

_SKIP = (os.path.dirname(torch.__file__ or "") + os.sep,) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)


class GraphBreakError(FunctrainError, RuntimeError):
    """A graph break under `fullgraph=True`, as one line (see the module docstring)."""


def _where(exc: BaseException) -> str:
    """'file:line (in function)' of the innermost frame of `exc`'s user stack outside torch and functrain."""
    frames = list(getattr(exc, "real_stack", None) or [])
    inner = getattr(exc, "innermost_user_frame_summary", None)
    if inner is not None and not frames:
        frames = [inner]
    if not frames:
        return "an unknown place (set TORCHDYNAMO_VERBOSE=1 for the stack)"
    outside = [f for f in frames if not os.path.abspath(f.filename).startswith(_SKIP)]
    f = (outside or frames)[-1]
    return f"{f.filename}:{f.lineno} (in {f.name})"


def describe(exc: BaseException) -> str:
    """The one line for a Dynamo `Unsupported` error: the reason, the place, the two ways on.

    Args:
      exc: the exception torch.compile raised.

    Returns:
      One line.

    Example:
      >>> describe(exc)
      'the step breaks torch.compile's graph at model.py:12 (in forward): Failed to trace builtin ...'
    """
    reason = getattr(exc, "gb_type", None) or str(exc).split("\n", 1)[0]
    if "RNN, GRU, or LSTM" in reason:
        return (
            f"the step cannot compile as one graph: torch.compile does not trace nn.RNN, nn.GRU or nn.LSTM "
            f"(at {_where(exc)}); build the step with fullgraph=False (--config.fullgraph=False): the recurrent "
            "module then runs between compiled graphs, with the same numbers"
        )
    return (
        f"the step cannot compile as one graph: {reason}, at {_where(exc)}; change the module there "
        "(no print, logging or branch on a tensor's value inside the forward), or build the step with "
        "fullgraph=False (--config.fullgraph=False) to compile around the break (several graphs)"
    )


@contextlib.contextmanager
def explained(rerun: Callable[[], object] | None = None) -> Iterator[None]:
    """Re-raises a Dynamo graph-break error inside the block as a one-line `GraphBreakError`.

    Args:
      rerun: the block's computation uncompiled. When Dynamo stops on an exception the traced code
        raised (a check's refusal, say), `rerun()` raises that exception itself, with its own message
        and traceback, in place of the graph-break line.

    Example:
      >>> with explained(lambda: fn(*args)):
      ...     out = compiled(*args)
    """
    try:
        yield
    except dynamo_exc.TorchRuntimeError:  # an op that failed on fake tensors: the eager run says which and why
        if rerun is not None:
            rerun()
        raise
    except dynamo_exc.Unsupported as exc:
        if rerun is not None and getattr(exc, "gb_type", "").startswith("Observed exception"):
            rerun()  # (raises the code's own exception; tracing failed before anything ran)
        raise GraphBreakError(describe(exc)) from None
