"""Whether code runs inside a `torch.func` transform, for routes that differ in and out of one.

Internals: docs/internals.md "functrain.compiler.transforms".

Example:
    >>> from functrain import compiler
    >>> compiler.eager_autograd_ok()  # True: no transform, not compiling
"""

from __future__ import annotations

import torch

__all__ = ["eager_autograd_ok", "inside_transform"]


def inside_transform() -> bool:
    """Whether a `torch.func` transform (grad, vjp, vmap, jvp, functionalize) is active around the caller.

    Returns:
      True inside one (its interpreter stack is not empty).

    Example:
      >>> torch.func.vmap(lambda x: torch.tensor(inside_transform()))(torch.ones(2))  # tensor([True, True])
    """
    return torch._C._functorch.peek_interpreter_stack() is not None


def eager_autograd_ok() -> bool:
    """Whether plain autograd may differentiate here: not under Dynamo's trace and not inside a transform.

    Returns:
      A Python bool.

    Example:
      >>> if eager_autograd_ok(): grads = torch.autograd.grad(loss, leaves)
    """
    return not torch.compiler.is_compiling() and not inside_transform()
