"""Tolerances derived from the dtype and the reduction length, never tuned to one CPU.

Two computations of the same float quantity that differ only in reduction order (compiled vs eager,
sharded vs one process, chunked vs plain, another SIMD width or thread count) differ by about
`eps * sqrt(n)` relative to its magnitude, where `n` is the number of terms summed; `rtol` adds a
safety factor of 16 (a real bug is off by O(1), so this still catches it). The comparison is
norm-wise over the whole tree (`max|a - b| <= tol * max|b|`, the max over every leaf): rounding
noise scales with the magnitudes the computation went through, so elementwise or per-tensor relative
checks on near-zero entries (e.g. `attn.k.bias`, whose true gradient is exactly zero: softmax is
shift invariant) test noise, not the code.

Trajectories. Parameters after several steps are compared only under updates whose sensitivity to
gradient noise is bounded: SGD (gain `lr / (1 - momentum)`) or Adam with a large `eps` (gain at most
`lr / eps`). Adam with eps=1e-8 turns the rounding noise of a near-zero gradient into a full-size
step (sign(noise) * lr), so it is never compared that way; its moments (linear / quadratic in the
gradients) and the loss are.

Example:
    >>> tol = rtol(n=tokens * width)
    >>> assert_close(compiled_grads, eager_grads, tol)
"""

from __future__ import annotations

import math

import optree
import torch

SAFETY = 16.0


def rtol(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Norm-wise relative tolerance for a quantity computed with reductions over ~`n` terms."""
    return SAFETY * torch.finfo(dtype).eps * math.sqrt(max(n, 1))


def adam_gain(lr: float, eps: float) -> float:
    """Upper bound of |d update / d gradient| for Adam (the moments' own gains are <= 1)."""
    return lr / eps


def sgd_gain(lr: float, momentum: float = 0.0) -> float:
    """|d update / d gradient| summed over the momentum's memory."""
    return lr / (1.0 - momentum)


def trajectory_atol(*, steps: int, gain: float, grad_scale: float, n: int, dtype=torch.float32) -> float:
    """Absolute bound on parameter differences after `steps` updates whose gradients differ by
    `rtol(n) * grad_scale` each, through an optimizer of the given gain (x2: the loss feeds back)."""
    return 2.0 * steps * gain * rtol(n, dtype) * grad_scale


def split_run(steps: int, n: int, dtype=torch.float32, *, lr: float = 0.05, momentum: float = 0.9):
    """(loss, relative grad norm, params) tolerances of a run split over ranks against one process,
    after `steps` SGD steps of clipped (norm <= 1) gradients on a loss ~4, reductions over ~`n` terms.

    bf16 / fp16 compute rounds each matmul output to that dtype, differently per shard: 2 eps a step."""
    per_step = rtol(n) if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    params = 2 * steps * sgd_gain(lr, momentum) * per_step
    return 4.0 * per_step * steps, per_step * steps, params  # loss ~4: per_step relative, growing linearly


def _leaves(tree):
    """(name, tensor) pairs of a pytree (a bare tensor is one leaf)."""
    if isinstance(tree, torch.Tensor):
        return [("", tree)]
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    return [(".".join(map(str, p)), x) for p, x in zip(paths, leaves)]


def assert_close(actual, expected, tol: float, *, absolute: bool = False, msg: str = "") -> None:
    """Asserts every tensor leaf of `actual` is within `tol` of `expected`.

    Args:
      actual, expected: tensors or pytrees of tensors with the same structure.
      tol: norm-wise relative tolerance (`max|a - b| <= tol * max|b|`, both maxima over the whole
        tree), or an absolute one with `absolute=True`.
      absolute: treat `tol` as absolute.
      msg: prefix of the failure message.
    """
    a, b = _leaves(actual), _leaves(expected)
    assert [n for n, _ in a] == [n for n, _ in b], f"{msg}: structures differ"
    pairs = [
        (name, torch.as_tensor(x).detach().double(), torch.as_tensor(y).detach().double())
        for (name, x), (_, y) in zip(a, b)
    ]
    scale = 1.0 if absolute else max([y.abs().max().item() for _, _, y in pairs if y.numel()] + [1e-30])
    for name, x, y in pairs:
        assert x.shape == y.shape, f"{msg} {name}: shape {tuple(x.shape)} != {tuple(y.shape)}"
        err = (x - y).abs().max().item() if x.numel() else 0.0
        assert err <= tol * scale, f"{msg} {name}: max |diff| {err:.3g} > {tol:.3g} x {scale:.3g}"
