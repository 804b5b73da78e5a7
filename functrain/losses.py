"""Memory-lean language-model loss: cross-entropy through an output projection, chunked.

Internals: docs/internals.md "functrain.losses".

Example:
    >>> loss = chunked_cross_entropy(hidden, params["wte.weight"], y, chunk_size=1024)
"""

from __future__ import annotations

import torch

__all__ = ["chunked_cross_entropy"]

DEFAULT_CHUNK_SIZE = 1024


def _chunks(n: int, chunk_size: int) -> list[tuple[int, int]]:
    """[(start, stop), ...] covering range(n) in steps of chunk_size."""
    return [(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype softmax and sums run in: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits (n, V) of one chunk of hidden states (n, C): matmul in the input dtype, result upcast."""
    logits = h @ weight.t()
    return logits.to(_acc_dtype(logits.dtype))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean CE of `hidden @ weight.T` over non-ignored targets, logits built one chunk at a time."""

    generate_vmap_rule = True

    @staticmethod
    def forward(hidden, weight, targets, chunk_size, ignore_index):
        """Returns (mean loss, per-token logsumexp (N,) float32, number of counted tokens)."""
        n = hidden.shape[0]
        valid = targets != ignore_index  # (N,)
        safe = torch.where(valid, targets, torch.zeros_like(targets))  # (N,) in range(V)
        lse_parts, nll_parts = [], []
        for s, e in _chunks(n, chunk_size):
            logits = _chunk_logits(hidden[s:e], weight)  # (n_c, V) float32
            lse = torch.logsumexp(logits, dim=-1)  # (n_c,)
            tgt = logits.gather(1, safe[s:e, None]).squeeze(1)  # (n_c,)
            lse_parts.append(lse)
            nll_parts.append(lse - tgt)
        lse = torch.cat(lse_parts)  # (N,)
        nll = torch.cat(nll_parts)  # (N,)
        count = valid.sum().to(lse.dtype)
        loss = torch.where(valid, nll, torch.zeros_like(nll)).sum() / count.clamp(min=1.0)  # 0 when all ignored
        return loss, lse, count

    @staticmethod
    def setup_context(ctx, inputs, output):
        """Saves what the backward recomputes the softmax from."""
        hidden, weight, targets, chunk_size, ignore_index = inputs
        _, lse, count = output
        ctx.save_for_backward(hidden, weight, targets, lse, count)
        ctx.chunk_size = chunk_size
        ctx.ignore_index = ignore_index
        ctx.mark_non_differentiable(lse, count)

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, grad_count):
        """grad_hidden (N, C) and grad_weight (V, C), recomputing each chunk's softmax."""
        # No graph of the backward itself: torch.func.grad differentiates with create_graph=True,
        # which would otherwise keep every chunk's softmax alive for a double backward (measured:
        # the same peak as the plain loss). So this function is differentiable once.
        with torch.no_grad():
            return _ChunkedCrossEntropy._grads(ctx, grad_loss)

    @staticmethod
    def _grads(ctx, grad_loss):
        """(grad_hidden, grad_weight, None, None, None) for the backward."""
        hidden, weight, targets, lse, count = ctx.saved_tensors
        n = hidden.shape[0]
        valid = targets != ctx.ignore_index  # (N,)
        safe = torch.where(valid, targets, torch.zeros_like(targets))  # (N,)
        # d loss / d logit[i, v] = valid_i / count * (softmax[i, v] - [v == target_i]).
        scale = torch.where(valid, grad_loss.to(lse.dtype) / count.clamp(min=1.0), torch.zeros_like(lse))  # (N,)
        grad_h_parts: list[torch.Tensor] = []
        grad_w: torch.Tensor | None = None
        for s, e in _chunks(n, ctx.chunk_size):
            h = hidden[s:e]  # (n_c, C)
            g = _chunk_logits(h, weight)  # (n_c, V), a fresh buffer: updated in place below
            g.sub_(lse[s:e, None]).exp_()  # softmax
            g.scatter_add_(1, safe[s:e, None], torch.full_like(lse[s:e, None], -1.0))  # minus one-hot
            g = (g * scale[s:e, None]).to(hidden.dtype)  # (n_c, V) = d loss / d logits
            grad_h_parts.append(g @ weight)  # (n_c, C)
            if grad_w is None:
                grad_w = (g.t() @ h).to(lse.dtype)  # (V, C) accumulator (float32 or float64)
            elif g.dtype == grad_w.dtype:
                grad_w.addmm_(g.t(), h)  # in place: no (V, C) temporary per chunk
            else:
                grad_w.add_((g.t() @ h).to(grad_w.dtype))  # low-precision matmul, wide sum
        # Both gradients always: under torch.compile(torch.func.grad_and_value(f, argnums=(0, 1)))
        # ctx.needs_input_grad[1] reads False (torch 2.13), and skipping on it gave zero weight grads.
        if grad_w is None:  # no rows
            return torch.zeros_like(hidden), torch.zeros_like(weight), None, None, None
        return torch.cat(grad_h_parts), grad_w.to(weight.dtype), None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    ignore_index: int = -1,
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets`, without materializing the logits.

    Equal (to float32 rounding) to `F.cross_entropy((hidden @ weight.T).float(), targets,
    ignore_index=ignore_index)` in value and in gradients (except that all ignored gives 0, not NaN) for `hidden` and
    `weight`, but only
    `chunk_size` rows of logits exist at any time, in the forward and in the backward.

    Args:
      hidden: final hidden states, (B, T, C) or (N, C), any floating dtype (the matmuls run in it;
        softmax and accumulation are float32, float64 for float64 inputs).
      weight: the output projection (V, C), e.g. a GPT's tied `wte.weight`.
      targets: int64 target ids, (B, T) or (N,); entries equal to `ignore_index` are left out of
        the mean (all ignored gives 0 with zero gradients, as `models.lm.cross_entropy`).
      chunk_size: tokens per chunk; the transient memory is about `3 * chunk_size * V` floats.
      ignore_index: target value to ignore.

    Returns:
      A float32 scalar tensor (float64 for float64 inputs).

    Example:
      >>> hidden = gpt_hidden(model, params, x)                                  # (B, T, C)
      >>> loss = chunked_cross_entropy(hidden, params["wte.weight"], y, chunk_size=1024)
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    c = hidden.shape[-1]
    if weight.ndim != 2 or weight.shape[1] != c:
        raise ValueError(f"weight must be (V, {c}) to match hidden {tuple(hidden.shape)}, got {tuple(weight.shape)}")
    flat_h = hidden.reshape(-1, c)  # (N, C)
    flat_t = targets.reshape(-1)  # (N,)
    if flat_t.shape[0] != flat_h.shape[0]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match hidden {tuple(hidden.shape)}")
    loss, _, _ = _ChunkedCrossEntropy.apply(flat_h, weight, flat_t, int(chunk_size), int(ignore_index))
    return loss
