"""Whether code runs inside a `torch.func` transform, for routes that differ in and out of one.

Eagerly, a step's gradients are cheaper through plain autograd (`torch.autograd.grad` on the params
made leaves) than through `torch.func.grad_and_value`, whose per-op wrapping costs ~20% of a small
model's forward and backward. Plain autograd cannot run inside a transform (`requires_grad_` under
`torch.func.vmap` raises), nor is it what Dynamo traces, so `functrain.step.value_and_grad` asks here.

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
